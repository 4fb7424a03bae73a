"""The VisionIPC stream-list request in both dialects openpilot ships (facts: docs/openpilot-ipc.md §4.1):
- msgq as pinned by openpilot 0.11: request int32 4 (VISION_STREAM_MAX), reply int32 ids;
- msgq after "Remove camera knowledge from visionipc" (0e266c1): request uint32 0xffffffff, reply up to 64 uint32 ids,
  and 4 is an ordinary stream id.
A server of either dialect closes the connection on a request it does not know. The fake servers here are written
from those facts, byte for byte, so our client is checked against each dialect and not against our own server."""
import array
import contextlib
import os
import socket
import struct
import time

import pytest
from conftest import FakeControlSocket

from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.visionipc import VisionIpcClient, VisionIpcServer, VisionStreamType, ipc_path

pytestmark = [pytest.mark.device, pytest.mark.usefixtures("prefix")]
ROAD, WIDE = VisionStreamType.ROAD, VisionStreamType.WIDE_ROAD
LIST_011, LIST_NEW = b"\x04\x00\x00\x00", b"\xff\xff\xff\xff"   # the two requests as they are on the wire


class FakeServer:
  """A camera server's control socket in one dialect; records every raw request it gets."""

  def __init__(self, name: str, dialect: str, streams: list[int]):
    self.dialect, self.streams, self.requests = dialect, streams, []
    self.control = FakeControlSocket(ipc_path(name), self._answer)

  def _answer(self, conn, raw: bytes):
    self.requests.append(raw)
    req = struct.unpack("<I", raw)[0]
    if self.dialect == "0.11" and req == 4:
      conn.send(struct.pack(f"<{len(self.streams)}i", *self.streams))
    elif self.dialect == "newest" and req == 0xFFFFFFFF:
      conn.send(struct.pack(f"<{len(self.streams)}I", *self.streams))
    elif req in self.streams:
      # a buffer reply: one 112-byte VisionBuf struct and its fd (a stand-in; only the framing matters here)
      fd = os.memfd_create("fakebuf")
      os.ftruncate(fd, 4096)
      conn.sendmsg([bytes(112)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
      os.close(fd)
    # anything else: close without a reply, as both C++ servers do

  def close(self):
    self.control.close()


def _open_fds(name: str = "fakebuf") -> int:
  """This process's fds on the fake servers' buffer memfds (process-wide counts move with other threads' sockets)."""
  n = 0
  for fd in os.listdir("/proc/self/fd"):
    with contextlib.suppress(OSError):
      n += os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}")
  return n


def _settles_at(want: int, timeout: float = 2.0) -> bool:
  """Whether the count of buffer fds comes back to `want` (the server thread closes its own copy just after sending)."""
  end = time.monotonic() + timeout
  while _open_fds() != want:
    if time.monotonic() > end:
      return False
    time.sleep(0.01)
  return True


@pytest.fixture
def fake(request):
  servers = []

  def make(name, dialect, streams):
    servers.append(FakeServer(name, dialect, streams))
    return servers[-1]
  yield make
  for s in servers:
    s.close()


def test_client_lists_the_streams_of_a_0_11_server(fake):
  srv = fake("cam011", "0.11", [0, 2])
  assert VisionIpcClient.available_streams("cam011", True) == {ROAD, WIDE}
  assert srv.requests == [LIST_011]          # 0.11's request first: one connection, no retry
  assert VisionIpcClient.available_streams("cam011", False) == {ROAD, WIDE}
  assert srv.requests == [LIST_011] * 2


def test_client_lists_the_streams_of_a_newest_server(fake):
  srv = fake("camnew", "newest", [0, 2, 9, 0xFFFFFFFE])
  assert VisionIpcClient.available_streams("camnew", True) == {ROAD, WIDE, 9, 0xFFFFFFFE}
  assert srv.requests == [LIST_011, LIST_NEW]   # 4 is refused (no stream 4), the newest request answers
  assert VisionIpcClient.available_streams("camnew", False) == {ROAD, WIDE, 9, 0xFFFFFFFE}
  assert srv.requests == [LIST_011, LIST_NEW, LIST_NEW]   # the dialect that answered is asked first from then on


def test_newest_server_with_a_stream_4_is_not_misread(fake):
  """To the newest msgq, 4 is an ordinary stream: it answers 0.11's list request with that stream's buffers and fds."""
  srv = fake("cam4", "newest", [0, 4])
  before = _open_fds()
  assert VisionIpcClient.available_streams("cam4", True) == {ROAD, 4}
  assert srv.requests == [LIST_011, LIST_NEW]
  assert _settles_at(before)                 # the buffer fd that came with the misread reply was closed


def test_no_server_and_a_server_with_no_streams(fake):
  assert VisionIpcClient.available_streams("nobody", False) == set()
  srv = fake("empty", "newest", [])
  assert VisionIpcClient.available_streams("empty", True) == set()
  assert srv.requests == [LIST_011, LIST_NEW]


def _ask(name: str, request: bytes) -> tuple[bytes, list[int]]:
  s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
  s.connect(ipc_path(name))
  with s:
    s.send(request)
    data, anc, _, _ = s.recvmsg(112 * 128, socket.CMSG_SPACE(128 * 4))
  return data, [fd for _, _, c in anc for fd in array.array("i", c)]


def _server(name: str, streams) -> VisionIpcServer:
  srv = VisionIpcServer(name)
  g = nv12_info(64, 32)
  for s in streams:
    srv.create_buffers_with_sizes(s, 2, 64, 32, g.size, g.stride, g.uv_offset)
  srv.start_listener()
  return srv


def test_our_server_answers_both_list_requests():
  with _server("ours", [WIDE, ROAD]):
    assert _ask("ours", LIST_011) == (struct.pack("<2i", 0, 2), [])
    assert _ask("ours", LIST_NEW) == (struct.pack("<2I", 0, 2), [])


def test_our_server_with_a_stream_4_serves_it_in_the_newest_dialect():
  with _server("ours4", [ROAD, 4]) as srv:
    data, fds = _ask("ours4", LIST_011)
    for fd in fds:
      os.close(fd)
    assert len(data) == 2 * 112 and len(fds) == 2 and struct.unpack_from("<I", data, 104)[0] == 4
    assert _ask("ours4", LIST_NEW) == (struct.pack("<2I", 0, 4), [])
    client = VisionIpcClient("ours4", 4, False)           # and our client gets stream 4 with the same request
    assert client.connect(False) and client.num_buffers == 2 and client.buffers[0].type == 4
    client.close()
    assert srv.buffers[4][0].type == 4


def test_our_server_offers_up_to_64_opaque_ids():
  ids = [0, 2] + [1000 + i for i in range(61)] + [0xFFFFFFFE]
  with _server("many", ids) as srv:
    with pytest.raises(ValueError, match="at most 64 streams"):
      srv.create_buffers(5, 2, 64, 32)
    assert VisionIpcClient.available_streams("many", True) == {ROAD, WIDE, *ids[2:]}
    data, _ = _ask("many", LIST_NEW)
    assert len(data) == 64 * 4 and sorted(struct.unpack("<64I", data)) == sorted(ids)
  with VisionIpcServer("sentinel") as srv, pytest.raises(ValueError, match="stream id"):
    srv.create_buffers(0xFFFFFFFF, 2, 64, 32)             # the list sentinel can never name a stream
