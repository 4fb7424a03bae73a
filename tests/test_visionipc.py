"""VisionIPC: a camera server and a client in different processes, real fd passing, real shared buffers."""
import array
import contextlib
import multiprocessing
import os
import socket
import struct
import time

import numpy as np
import pytest

from selfdrive_glue import msgq
from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.visionipc import VisionIpcClient, VisionIpcServer, VisionStreamType, endpoint_name, ipc_path

CTX = multiprocessing.get_context("fork")
pytestmark = [pytest.mark.device, pytest.mark.usefixtures("prefix")]   # plain Linux shared memory and sockets: runs unchanged on a vamOS device
ROAD, WIDE = VisionStreamType.ROAD, VisionStreamType.WIDE_ROAD


def _frame(i: int, size: int) -> np.ndarray:
  f = np.full(size, i % 251, dtype=np.uint8)
  f[:8] = np.frombuffer(struct.pack("<Q", 1_000_003 * i), np.uint8)
  return f


def _is_frame(data: np.ndarray, i: int) -> bool:
  return struct.unpack("<Q", data[:8].tobytes())[0] == 1_000_003 * i and int(data[-1]) == i % 251 and int(data[len(data) // 2]) == i % 251


def _camera(go, done, frames, streams=(ROAD, WIDE), start=0, w=1928, h=1208, nbuf=4, hold=0.0):
  srv = VisionIpcServer("camerad")
  for s in streams:
    srv.create_buffers(s, nbuf, w, h)
  srv.start_listener()
  size = srv.buffers[streams[0]][0].len
  go.wait(10)
  for i in range(start, start + frames):
    for s in streams:
      srv.send(s, _frame(i, size), frame_id=i, timestamp_sof=10_000 + i, timestamp_eof=20_000 + i)
    time.sleep(0.01)
  done.wait(10)
  time.sleep(hold)
  srv.close()


def _start_camera(**kw):
  go, done = CTX.Event(), CTX.Event()
  p = CTX.Process(target=_camera, args=(go, done), kwargs=kw)
  p.start()
  return p, go, done


def test_geometry_matches_camerad():
  with VisionIpcServer("geom") as srv:
    srv.create_buffers(ROAD, 2, 1928, 1208)
    srv.create_buffers(VisionStreamType.DRIVER, 2, 1344, 760)
    b = srv.buffers[ROAD][0]
    assert (b.stride, b.uv_offset, b.len) == (2048, 2490368, 4804608)
    d, g = srv.buffers[VisionStreamType.DRIVER][0], nv12_info(1344, 760)
    assert (d.stride, d.uv_offset, d.len) == (g.stride, g.uv_offset, g.size) == (1408, 1081344, 2428928)
    with pytest.raises(ValueError, match="does not fit"):
      srv.send(ROAD, np.zeros(100, np.uint8))
    with pytest.raises(ValueError, match="inconsistent NV12"):
      srv.create_buffers_with_sizes(WIDE, 2, 1928, 1208, 1000, 2048, 2490368)


def test_frames_across_processes_with_metadata(prefix):
  p, go, done = _start_camera(frames=6, nbuf=8)
  assert VisionIpcClient.available_streams("camerad", True) == {ROAD, WIDE}
  assert os.path.exists(f"/tmp/{prefix}_visionipc_camerad") and ipc_path("camerad") == f"/tmp/{prefix}_visionipc_camerad"
  client = VisionIpcClient("camerad", ROAD, False)
  assert client.connect(True) and client.is_connected()
  assert (client.width, client.height, client.stride, client.uv_offset, client.buffer_len, client.num_buffers) == \
    (1928, 1208, 2048, 2490368, 4804608, 8)
  go.set()
  got = []
  deadline = time.monotonic() + 10
  while len(got) < 6 and time.monotonic() < deadline:
    buf = client.recv(200)
    if buf is None:
      continue
    assert buf.data.dtype == np.uint8 and buf.data.shape == (4804608,)
    assert _is_frame(buf.data, client.frame_id) and buf.frame_id == client.frame_id
    assert (client.timestamp_sof, client.timestamp_eof, client.valid) == (10_000 + client.frame_id, 20_000 + client.frame_id, True)
    assert buf.idx == client.frame_id % 8 and (buf.width, buf.height, buf.stride, buf.uv_offset) == (1928, 1208, 2048, 2490368)
    got.append(client.frame_id)
  done.set()
  p.join(10)
  assert got == list(range(6))
  assert not os.path.exists(ipc_path("camerad"))   # the server removes its socket on close


def test_frames_are_zero_copy_views_of_the_server_buffers():
  with VisionIpcServer("zc") as srv:
    srv.create_buffers(ROAD, 2, 1344, 760)
    srv.start_listener()
    client = VisionIpcClient("zc", ROAD, False)
    assert client.connect(False)
    srv.send(ROAD, _frame(1, srv.buffers[ROAD][0].len), frame_id=1)
    buf = client.recv(1000)
    assert buf is not None and _is_frame(buf.data, 1)
    srv.buffers[ROAD][buf.idx].data[:8] = 7       # the server writes its mapping; the client's view sees it: same memory
    assert list(buf.data[:8]) == [7] * 8
    assert not buf.data.flags.owndata and buf.y.shape == (760, 1344) and buf.uv.shape == (380, 1344)
    client.close()


def test_conflate_client_sees_only_the_newest_frame():
  with VisionIpcServer("cf") as srv:
    srv.create_buffers(WIDE, 6, 1344, 760)
    srv.start_listener()
    latest = VisionIpcClient("cf", WIDE, True)
    every = VisionIpcClient("cf", WIDE, False)
    assert latest.connect(False) and every.connect(False)
    size = srv.buffers[WIDE][0].len
    for i in range(5):
      srv.send(WIDE, _frame(i, size), frame_id=i)
    assert latest.recv(100) is not None and latest.frame_id == 4
    assert latest.recv(0) is None
    ids = []
    while (b := every.recv(0)) is not None:
      assert _is_frame(b.data, every.frame_id)
      ids.append(every.frame_id)
    assert ids == [0, 1, 2, 3, 4]


def test_client_follows_a_camera_server_restart():
  client = VisionIpcClient("camerad", ROAD, True)
  manual = VisionIpcClient("camerad", ROAD, True, auto_reconnect=False)
  for start in (0, 100):
    p, go, done = _start_camera(frames=5, start=start, streams=(ROAD,), hold=0.2)
    assert VisionIpcClient.available_streams("camerad", True) == {ROAD}
    if start == 0:
      assert client.connect(True) and manual.connect(True)
    assert client.recv(0) is None and manual.recv(0) is None   # the new server's publisher evicted our readers: re-register now
    go.set()
    seen, manual_seen = set(), set()
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
      if (b := client.recv(100)) is not None:
        assert _is_frame(b.data, client.frame_id)
        seen.add(client.frame_id)
      if manual.recv(0) is not None:
        manual_seen.add(manual.frame_id)
    done.set()
    p.join(10)
    assert seen and min(seen) >= start, seen
    if start == 100:
      # without auto-reconnect the packets of the new server are refused, as in openpilot, until connect() is called again
      assert not manual_seen and not manual.is_connected()
    assert client.is_connected()


def test_bad_notification_is_counted_not_fatal():
  with VisionIpcServer("bad") as srv:
    srv.create_buffers(ROAD, 2, 1344, 760)
    srv.start_listener()
    client = VisionIpcClient("bad", ROAD, False)
    assert client.connect(False)
    srv.socks[ROAD].send(b"\x01" * 10)                                    # truncated packet
    srv.socks[ROAD].send(struct.pack("<QQI4xQQ?7x", srv.server_id, 99, 1, 2, 3, True))   # idx out of range
    assert client.recv(100) is None and client.bad_packets == 1
    assert client.recv(100) is None and client.bad_packets == 2
    srv.send(ROAD, _frame(3, srv.buffers[ROAD][0].len), frame_id=3)
    assert client.recv(100) is not None and client.frame_id == 3 and client.is_connected()


def test_unknown_stream_and_no_server():
  assert VisionIpcClient("nobody", ROAD, False).connect(False) is False
  assert VisionIpcClient.available_streams("nobody", False) == set()
  with VisionIpcServer("only_road") as srv:
    srv.create_buffers(ROAD, 2, 1344, 760)
    srv.start_listener()
    assert VisionIpcClient("only_road", VisionStreamType.DRIVER, False).connect(False) is False


def test_wire_format_seen_by_a_raw_client():
  """What a C++ client gets: 112-byte VisionBuf structs + SCM_RIGHTS fds, frame id in the 8 bytes after len."""
  with VisionIpcServer("raw") as srv:
    srv.create_buffers(ROAD, 3, 1928, 1208)
    srv.start_listener()
    notify = msgq.SubSocket(endpoint_name("raw", ROAD), 1024 * 1024)
    assert endpoint_name("raw", ROAD) == "visionipc_raw_0" and notify.q.size == 1024 * 1024
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(ipc_path("raw"))
    s.send(struct.pack("<i", 0))
    msg, anc, _, _ = s.recvmsg(112 * 128, socket.CMSG_SPACE(128 * 4))
    s.close()
    fds = list(array.array("i", anc[0][2]))
    assert len(msg) == 3 * 112 and len(fds) == 3
    for i in range(3):
      ln, mmap_len, width, height, stride, uv_offset, server_id, idx, tp = \
        (struct.unpack_from("<Q", msg, i * 112 + off)[0] for off in (0, 8, 40, 48, 56, 64, 88, 96, 104))
      assert (ln, mmap_len, width, height, stride, uv_offset) == (4804608, 4804616, 1928, 1208, 2048, 2490368)
      assert server_id == srv.server_id and idx == i and tp & 0xFFFFFFFF == 0
      assert os.fstat(fds[i]).st_size == mmap_len
    srv.send(ROAD, _frame(5, 4804608), frame_id=5, timestamp_sof=11, timestamp_eof=22)
    pkt = notify.receive(non_blocking=True)
    assert len(pkt) == 48 and struct.unpack("<QQI4xQQ?7x", pkt) == (srv.server_id, 0, 5, 11, 22, True)
    with open(fds[0], "rb", closefd=False) as f:
      f.seek(4804608)
      assert struct.unpack("<Q", f.read(8))[0] == 5
    for fd in fds:
      os.close(fd)


# stream types as plain ints (ROAD 0, WIDE_ROAD 2): msgq 0.11 takes them for its enum, the newest msgq has no enum at all
CPP_CAMERA = """
import time, numpy as np
from msgq.visionipc import VisionIpcServer, VisionIpcClient
s = VisionIpcServer("cppcam")
s.create_buffers_with_sizes(0, 4, 1928, 1208, 4804608, 2048, 2490368)
s.start_listener()
print("ready", flush=True)
input()
for i in range(10):
  s.send(0, np.full(4804608, i, np.uint8), i, 100 + i, 200 + i)
  time.sleep(0.02)
print("streams", *sorted(int(t) for t in VisionIpcClient.available_streams("pycam", True)), flush=True)
c = VisionIpcClient("pycam", 2, False)
assert c.connect(True)
print("geom", c.width, c.height, c.stride, c.uv_offset, c.buffer_len, flush=True)
ok = 0
while ok < 5:
  b = c.recv(2000)
  assert b is not None
  ok += int(np.asarray(b.data)[1000]) == c.frame_id and c.timestamp_sof == 100 + c.frame_id and c.timestamp_eof == 200 + c.frame_id
print("ok", ok, flush=True)
"""


def _expect(proc, word: str) -> str:
  """The next stdout line holding word, from word on (C++ logging shares the stream and lacks newlines)."""
  for _ in range(20):
    line = proc.stdout.readline()
    if word in line:
      return line[line.index(word):]
  raise AssertionError(f"no '{word}' from the C++ side")


@pytest.mark.skipif(not os.environ.get("MSGQ_PATH"), reason="set MSGQ_PATH to a built commaai/msgq checkout to test against C++")
def test_interop_with_cpp_visionipc(prefix):
  """Both ways against C++ msgq: run once per msgq revision (README's compatibility table: 0.11's ed27777, newest 0e266c1)."""
  import subprocess
  import sys
  os.makedirs(f"/dev/shm/msgq_{prefix}", exist_ok=True)   # C++ msgq expects the prefix folder to exist
  cpp = subprocess.Popen([sys.executable, "-c", CPP_CAMERA], env={**os.environ, "PYTHONPATH": os.environ["MSGQ_PATH"]},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  with VisionIpcServer("pycam") as srv:
    try:
      assert "ready" in _expect(cpp, "ready")
      assert VisionIpcClient.available_streams("cppcam", True) == {ROAD}   # blocks until its listener is up
      client = VisionIpcClient("cppcam", ROAD, False)        # our client, C++ camera
      assert client.connect(False) and (client.stride, client.uv_offset, client.buffer_len) == (2048, 2490368, 4804608)
      srv.create_buffers(WIDE, 4, 1928, 1208)                # our camera, C++ client
      srv.start_listener()
      cpp.stdin.write("\n")
      cpp.stdin.flush()
      ids = []
      while len(ids) < 10 and (b := client.recv(2000)) is not None:
        assert int(b.data[1000]) == client.frame_id and client.timestamp_sof == 100 + client.frame_id
        ids.append(client.frame_id)
      assert ids == list(range(10))
      assert _expect(cpp, "streams").split() == ["streams", "2"]   # our server answered the C++ client's list request
      assert _expect(cpp, "geom").split() == ["geom", "1928", "1208", "2048", "2490368", "4804608"]
      for i in range(40):
        srv.send(WIDE, np.full(4804608, i, np.uint8), i, 100 + i, 200 + i)
        time.sleep(0.02)
      assert _expect(cpp, "ok ").split() == ["ok", "5"]
    finally:
      try:
        cpp.wait(5)
      except subprocess.TimeoutExpired:
        cpp.kill()
        cpp.wait(5)


def test_server_accepts_clients_when_the_process_has_more_than_1024_files(prefix):
  """A camera server in a process with many open files (GPU objects, buffers) gets a listening socket numbered above
  select()'s limit; it must still serve."""
  import resource
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if hard != resource.RLIM_INFINITY and hard < 2048:
    pytest.skip("the hard file limit is below 2048")
  resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096) if hard == resource.RLIM_INFINITY else min(max(soft, 4096), hard), hard))
  fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
  try:
    info = nv12_info(64, 32)
    srv = VisionIpcServer("camerad")
    srv.create_buffers_with_sizes(ROAD, 2, 64, 32, info.size, info.stride, info.uv_offset)
    srv.start_listener()
    try:
      client = VisionIpcClient("camerad", ROAD, True)
      assert client.connect(True)
      assert client.num_buffers == 2
      client.close()
    finally:
      srv.close()
  finally:
    for fd in fillers:
      os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_client_syncs_dma_buf_caches_around_each_read(monkeypatch):
  """On the device camerad's buffers are cached dma-bufs and the C++ client syncs on recv. Ours brackets each frame
  with DMA_BUF_IOCTL_SYNC (_IOW('b', 0, u64) = 0x40086200): START|READ (1) at recv, END|READ (5) when the next
  frame is taken or the client closes. Memfds answer ENOTTY, so here the dma-buf is stood in for by the ioctl."""
  import errno
  import fcntl

  calls: list[tuple[int, int, int]] = []
  dmabuf_inodes: set[int] = set()
  fail = []

  def fake_ioctl(fd, req, arg):
    if os.fstat(fd).st_ino not in dmabuf_inodes:
      raise OSError(errno.ENOTTY, "not a dma-buf")
    if fail:
      fail.pop()
      raise OSError(errno.EIO, "sync failed")
    calls.append((os.fstat(fd).st_ino, req, struct.unpack("<Q", arg)[0]))
    return 0
  monkeypatch.setattr(fcntl, "ioctl", fake_ioctl)
  with VisionIpcServer("dmabuf") as srv:
    srv.create_buffers(ROAD, 2, 64, 32)
    srv.create_buffers(WIDE, 2, 64, 32)
    srv.start_listener()
    ino = [os.fstat(b.fd).st_ino for b in srv.buffers[ROAD]]
    dmabuf_inodes.update(ino)
    size = srv.buffers[ROAD][0].len

    inodes = set(ino) | {os.fstat(b.fd).st_ino for b in srv.buffers[WIDE]}

    def nfds():   # this process's fds open on the test's buffers (mmap dups included): other threads' fds cannot move it
      n = 0
      for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
          n += os.stat(f"/proc/self/fd/{fd}").st_ino in inodes
      return n
    fds_before = nfds()
    plain = VisionIpcClient("dmabuf", WIDE, False)          # not a dma-buf: no fd kept, no syncs, nothing counted
    fds_unconnected = nfds()
    assert plain.connect(False) and all(b.sync_fd == -1 for b in plain.buffers)
    per_mapping = nfds() - fds_unconnected                  # (Python's mmap holds a dup of each fd it maps)
    srv.send(WIDE, _frame(1, size), frame_id=1)
    assert plain.recv(1000) is not None and plain.sync_errors == 0 and calls == []

    client = VisionIpcClient("dmabuf", ROAD, False)
    fds_plain = nfds()
    assert client.connect(False) and all(b.sync_fd >= 0 for b in client.buffers)
    assert nfds() - fds_plain == per_mapping + 2            # plus the kept fd of each of the 2 buffers
    calls.clear()                                           # (connect probed each fd with a START/END pair)
    srv.send(ROAD, _frame(1, size), frame_id=1)
    assert client.recv(1000) is not None
    assert calls == [(ino[0], 0x40086200, 1)]
    srv.send(ROAD, _frame(2, size), frame_id=2)
    assert client.recv(1000) is not None and _is_frame(client.buffers[1].data, 2)
    assert calls[1:] == [(ino[0], 0x40086200, 5), (ino[1], 0x40086200, 1)]
    assert client.sync_errors == 0
    fail.append(True)                                       # a sync that fails is counted; the frame still comes
    srv.send(ROAD, _frame(3, size), frame_id=3)
    assert client.recv(1000) is not None and client.frame_id == 3 and client.sync_errors == 1
    assert calls[3:] == [(ino[0], 0x40086200, 1)]           # the END of frame 2 failed; the START of frame 3 still ran
    calls.clear()
    client.close()
    assert calls == [(ino[0], 0x40086200, 5)]               # the open access ends before the fds go
    plain.close()
    assert nfds() == fds_before
