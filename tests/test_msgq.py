"""msgq ring buffer: real processes, real /dev/shm files."""
import logging
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from selfdrive_glue import msgq

CTX = multiprocessing.get_context("fork")
pytestmark = [pytest.mark.device, pytest.mark.usefixtures("prefix")]   # plain Linux shared memory and sockets: runs unchanged on a vamOS device


def _payload(i: int, size: int) -> bytes:
  head = struct.pack("<II", i, size)
  return head + bytes((i + k) % 251 for k in range(size - 8))


def _check(msg: bytes) -> int:
  i, size = struct.unpack_from("<II", msg)
  assert len(msg) == size and msg == _payload(i, size), f"message {i} corrupted"
  return i


def _wait_readers(pub: msgq.PubSocket, n: int, timeout=10.0):
  end = time.monotonic() + timeout
  while pub.q.num_readers() < n:
    assert time.monotonic() < end, "readers never registered"
    time.sleep(0.002)


def _reader(name, size, n, conflate, out, ready):
  sock = msgq.SubSocket(name, size, conflate=conflate, timeout=3000)
  ready.set()
  got = []
  while len(got) < n:
    m = sock.receive()
    if m is None:
      break
    got.append(_check(m))
  out.put(got)


def test_header_layout_and_path(prefix):
  pub = msgq.PubSocket("modelV2")   # BIG queue from the service table
  sub = msgq.SubSocket("modelV2")
  assert pub.q.path == f"/dev/shm/msgq_{prefix}/modelV2"
  assert os.path.getsize(pub.q.path) == 10 * 1024 * 1024 + 384
  pub.send(b"x" * 13)
  h = msgq.header("modelV2")
  assert h["num_readers"] == 1 and h["write_pointer"] == (0, 24) and h["write_uid"] == pub.uid
  assert h["read_uids"][0] == sub.uid and sub.uid & 0xFFFFFFFF == __import__("threading").get_native_id()
  assert h["read_valids"][0] == 1 and h["read_pointers"][0] == (0, 0)
  raw = open(pub.q.path, "rb").read(384 + 24)
  assert struct.unpack_from("<q", raw, 384)[0] == 13 and raw[392:405] == b"x" * 13
  assert sub.receive(non_blocking=True) == b"x" * 13
  assert msgq.header("modelV2")["read_pointers"][0] == (0, 24)


def test_unknown_endpoint_uses_msgq_default_size():
  pub = msgq.PubSocket("visionipc_camerad_0")
  assert pub.q.size == 1024 * 1024


def test_reader_sees_only_future_messages():
  pub = msgq.PubSocket("carState")
  pub.send(b"before-reader...")
  sub = msgq.SubSocket("carState")
  assert sub.receive(non_blocking=True) is None
  pub.send(b"after")
  assert sub.receive(non_blocking=True) == b"after"


def test_round_trip_and_two_readers_across_processes():
  # a ring that holds all 300 messages (~160 KB): a reader starved by a loaded box must not be lapped (tested separately)
  name, size, n = "liveCalibration", 1024 * 1024, 300
  pub = msgq.PubSocket(name, size)
  out, readies = CTX.Queue(), [CTX.Event() for _ in range(2)]
  procs = [CTX.Process(target=_reader, args=(name, size, n, False, out, r)) for r in readies]
  for p in procs:
    p.start()
  for r in readies:
    assert r.wait(10)
  _wait_readers(pub, 2)
  for i in range(n):
    pub.send(_payload(i, 64 + (i * 37) % 900))
  results = [out.get(timeout=20) for _ in procs]
  for p in procs:
    p.join(5)
  assert results[0] == list(range(n)) and results[1] == list(range(n))


def test_wrap_around_lockstep_across_processes():
  # a 4 KiB ring wraps every few messages; the writer waits for the reader so nothing may be lost or garbled
  name, size, n = "wrapTest", 4096, 400
  pub = msgq.PubSocket(name, size)
  out, ready = CTX.Queue(), CTX.Event()
  p = CTX.Process(target=_reader, args=(name, size, n, False, out, ready))
  p.start()
  assert ready.wait(10)
  _wait_readers(pub, 1)
  cycles = set()
  for i in range(n):
    pub.send(_payload(i, 8 + (i * 53) % 1300))
    cycles.add(msgq.header(name, size)["write_pointer"][0])
    end = time.monotonic() + 5
    while not pub.all_readers_updated():
      assert time.monotonic() < end
      time.sleep(0.0002)
  assert out.get(timeout=20) == list(range(n))
  p.join(5)
  assert len(cycles) > 50


def test_conflate_returns_only_newest():
  pub = msgq.PubSocket("deviceState")
  sub = msgq.SubSocket("deviceState", conflate=True)
  for i in range(20):
    pub.send(_payload(i, 40))
  assert _check(sub.receive(non_blocking=True)) == 19
  assert sub.receive(non_blocking=True) is None


def test_slow_reader_never_blocks_writer_and_recovers():
  name, size = "slowTest", 8192
  pub = msgq.PubSocket(name, size)
  sub = msgq.SubSocket(name, size)
  for i in range(5000):   # laps the idle reader hundreds of times
    pub.send(_payload(i, 8 + i % 700))
  assert sub.receive(non_blocking=True) is None   # lapped: msgq drops the backlog rather than hand out overwritten bytes
  pub.send(_payload(5000, 100))
  assert _check(sub.receive(non_blocking=True)) == 5000


def test_publisher_restart_in_new_process_keeps_reader():
  name = "roadCameraState"

  def publish(tag):
    p = msgq.PubSocket(name)
    _wait_readers(p, 1)   # the reader re-registers after the new publisher cleared all slots
    for _ in range(3):
      p.send(tag)
      time.sleep(0.01)

  sub = msgq.SubSocket(name, timeout=3000)
  for tag in (b"first-publisher", b"second-publisher"):
    proc = CTX.Process(target=publish, args=(tag,))
    proc.start()
    deadline = time.monotonic() + 10
    got = None
    while got != tag and time.monotonic() < deadline:
      got = sub.receive()
    proc.join(10)
    assert got == tag


def test_old_publisher_is_refused():
  a = msgq.PubSocket("carControl")
  b = msgq.PubSocket("carControl")
  b.send(b"ok")
  with pytest.raises(msgq.MultiplePublishersError):
    a.send(b"stale")


def test_oversized_and_empty_messages_are_refused():
  pub = msgq.PubSocket("tinyQueue", 3000)
  with pytest.raises(msgq.IpcError, match="too big"):
    pub.send(b"x" * 1001)
  with pytest.raises(msgq.IpcError, match="empty"):
    pub.send(b"")


def test_corrupt_length_tag_is_counted_not_fatal(caplog):
  pub = msgq.PubSocket("corruptTest", 4096)
  sub = msgq.SubSocket("corruptTest", 4096)
  pub.send(b"a" * 16)
  pub.q.w[0] = 1 << 40   # a scribbled length tag
  with caplog.at_level(logging.WARNING):
    assert sub.receive(non_blocking=True) is None
  assert sub.corrupt == 1 and sum("corrupt length tag" in r.message for r in caplog.records) == 1
  pub.send(b"b" * 16)
  assert sub.receive(non_blocking=True) == b"b" * 16


def test_sixteenth_reader_evicts_and_evicted_readers_come_back():
  pub = msgq.PubSocket("manyReaders")
  subs = [msgq.SubSocket("manyReaders") for _ in range(15)]
  assert pub.q.num_readers() == 15
  newcomer = msgq.SubSocket("manyReaders")
  assert pub.q.num_readers() == 1   # no slot left: everyone was evicted and the newcomer took slot 0
  for s in subs[:2]:
    s.close()                        # dead readers never come back; the live ones re-register on their next call
  live = subs[2:] + [newcomer]
  assert all(s.receive(non_blocking=True) is None for s in live)
  assert pub.q.num_readers() == 14
  pub.send(b"again")
  assert [s.receive(non_blocking=True) for s in live] == [b"again"] * 14


def test_send_wakes_the_reader_thread_with_sigusr2():
  sub = msgq.SubSocket("wakeTest")
  pub = msgq.PubSocket("wakeTest")
  sub.ready()   # re-registers after the publisher cleared the slots
  assert signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None)
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
  try:
    signal.sigtimedwait({signal.SIGUSR2}, 0)   # drain anything pending
    pub.send(b"ping")
    assert signal.SIGUSR2 in signal.sigpending()   # tkill went to this thread, the one that registered
  finally:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
  assert msgq.poll([sub], 1000) == [sub]
  assert sub.receive(non_blocking=True) == b"ping"


def test_children_do_not_inherit_a_blocked_sigusr2():
  # a C++ msgq reader started by us would otherwise never be woken
  sub = msgq.SubSocket("maskTest")
  assert msgq.poll([sub], 30) == []
  assert signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
  out = subprocess.run(["grep", "SigBlk", "/proc/self/status"], capture_output=True, text=True, check=True).stdout
  assert not int(out.split()[1], 16) & (1 << (signal.SIGUSR2 - 1))


def _late_sender(name, delay):
  p = msgq.PubSocket(name)
  time.sleep(delay)
  p.send(b"late")
  time.sleep(0.5)


def test_blocking_receive_wakes_on_publish_from_other_process():
  sub = msgq.SubSocket("pollTest", timeout=5000)
  proc = CTX.Process(target=_late_sender, args=("pollTest", 0.2))
  proc.start()
  assert sub.receive() == b"late"
  proc.join(5)


def test_poll_timeout_returns_empty():
  sub = msgq.SubSocket("quietTest")
  t = time.monotonic()
  assert msgq.poll([sub], 50) == []
  assert time.monotonic() - t >= 0.045


def test_weakly_ordered_fence_runs():
  fence = msgq._make_fence("aarch64")   # what a comma device uses: a spinlock acquire/release pair
  for _ in range(3):
    fence()


def test_path_without_prefix_and_bad_names(monkeypatch):
  monkeypatch.delenv("OPENPILOT_PREFIX")
  assert msgq.shm_path("modelV2") == "/dev/shm/msgq_modelV2"
  for bad in ("", "a/b"):
    with pytest.raises(msgq.IpcError):
      msgq.Queue(bad)
  with pytest.raises(msgq.IpcError, match="multiple of 8"):
    msgq.Queue("oddSize", 1001)


def _fast_writer(name, size, n, ready):
  pub = msgq.PubSocket(name, size)
  ready.wait(10)
  _wait_readers(pub, 1)
  for i in range(n):
    pub.send(_payload(i, 8 + (i * 29) % 1000))


def test_concurrent_lapping_never_yields_torn_messages():
  # a writer that never waits, a 4 KiB ring and a reader in another process: whatever arrives must be whole and in order
  name, size, n = "tornTest", 4096, 20000
  ready = CTX.Event()
  sub = msgq.SubSocket(name, size, timeout=500)
  proc = CTX.Process(target=_fast_writer, args=(name, size, n, ready))
  proc.start()
  time.sleep(0.05)
  sub.ready()   # re-register after the writer's init cleared the slots
  ready.set()
  got = []
  while (m := sub.receive()) is not None:
    got.append(_check(m))
  proc.join(10)
  assert len(got) > 10 and all(a < b for a, b in zip(got, got[1:]))


CPP_ECHO = """
import sys
from msgq import pub_sock, sub_sock
sub = sub_sock("modelV2", segment_size=10 * 1024 * 1024, timeout=5000)
pub = pub_sock("cameraOdometry", segment_size=250 * 1024)
print("ready", flush=True)
while (d := sub.receive()) is not None and d != b"STOP----":
  pub.send(d)
"""


@pytest.mark.skipif(not os.environ.get("MSGQ_PATH"), reason="set MSGQ_PATH to a built commaai/msgq checkout to test against C++")
def test_interop_with_cpp_msgq():
  """Python writer -> C++ reader -> C++ writer -> Python reader, through rings that wrap many times."""
  pub = msgq.PubSocket("modelV2")
  echo = subprocess.Popen([sys.executable, "-c", CPP_ECHO], env={**os.environ, "PYTHONPATH": os.environ["MSGQ_PATH"]},
                          stdout=subprocess.PIPE, text=True)
  try:
    assert echo.stdout.readline().strip() == "ready"
    sub = msgq.SubSocket("cameraOdometry", timeout=3000)   # after the C++ publisher started, so not evicted by it
    _wait_readers(pub, 1)
    for i in range(600):
      msg = _payload(i, 8 + (i * 7919) % 60000)
      pub.send(msg)
      assert sub.receive() == msg, f"message {i} lost or changed on the way through C++"
    assert msgq.header("modelV2")["write_pointer"][0] >= 1 and msgq.header("cameraOdometry")["write_pointer"][0] >= 50
  finally:
    pub.send(b"STOP----")
    echo.wait(10)


def test_segment_shrunk_by_another_process_is_an_error_not_a_crash(caplog):
  pub = msgq.PubSocket("sizeTest", 64 * 1024)
  sub = msgq.SubSocket("sizeTest", 64 * 1024)
  pub.send(b"before")
  os.truncate(pub.q.path, 384 + 4096)   # what an opener with a smaller queue size does; reading past it would SIGBUS
  with caplog.at_level(logging.ERROR):
    assert sub.receive(non_blocking=True) is None and msgq.poll([sub], 10) == []
  assert sum("reopened with a 4096-byte segment" in r.message for r in caplog.records) == 1
  with pytest.raises(msgq.IpcError, match="queue sizes"):
    pub.send(b"after")
  os.truncate(pub.q.path, 384 + 64 * 1024)
  pub.send(b"healed")
  assert sub.receive(non_blocking=True) in (b"before", b"healed")


def _register_and_hold(name, go, out, hold):
  go.wait(10)
  sub = msgq.SubSocket(name)
  out.put((sub.reader_id, sub.uid))
  hold.wait(10)


def test_simultaneous_registrations_get_distinct_slots():
  name = "raceTest"
  pub = msgq.PubSocket(name)
  go, hold, out = CTX.Event(), CTX.Event(), CTX.Queue()
  procs = [CTX.Process(target=_register_and_hold, args=(name, go, out, hold)) for _ in range(10)]
  for p in procs:
    p.start()
  go.set()
  slots = [out.get(timeout=10) for _ in procs]
  h = msgq.header(name)
  hold.set()
  for p in procs:
    p.join(10)
  assert sorted(r for r, _ in slots) == list(range(10)) and h["num_readers"] == 10
  assert sorted(h["read_uids"][:10]) == sorted(u for _, u in slots)
  pub.close()


def test_scribbled_pointers_are_repaired_not_fatal():
  pub = msgq.PubSocket("scribble", 4096)
  sub = msgq.SubSocket("scribble", 4096)
  pub.send(b"one-----")
  assert sub.receive(non_blocking=True) == b"one-----"
  pub.q.h[1] = (3 << 32) | 99999            # write pointer far outside the ring
  assert sub.receive(non_blocking=True) is None
  pub.send(b"two-----")                     # the writer restarts the ring and invalidates readers...
  assert sub.receive(non_blocking=True) is None   # ...which resync to the newest data, as after being lapped
  pub.send(b"three---")
  assert sub.receive(non_blocking=True) == b"three---"
  sub.q.h[3 + sub.reader_id] = 12345        # this reader's own pointer, misaligned
  assert sub.receive(non_blocking=True) is None and sub.corrupt == 1
  pub.send(b"four----")
  assert sub.receive(non_blocking=True) == b"four----"
