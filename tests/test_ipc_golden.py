"""msgq and VisionIPC wire layouts as fixed bytes, from docs/openpilot-ipc.md §3.1 and §4 (not from our constants).

Every offset and size below is a literal copied from the doc, so a swapped or mistyped constant in selfdrive_glue/msgq.py
or visionipc.py fails here even where our own reader and writer would agree with each other (and the C++ interop tests,
which would also catch it, run only with MSGQ_PATH set).
"""
from __future__ import annotations

import array
import mmap
import os
import socket
import struct
import threading

import pytest
from conftest import FakeControlSocket

from selfdrive_glue import msgq
from selfdrive_glue.visionipc import VisionIpcClient, VisionIpcServer

pytestmark = [pytest.mark.device, pytest.mark.usefixtures("prefix")]

SEG = 4096   # a segment size of our choosing: the header and record layout do not depend on it


def u64(raw: bytes, off: int) -> int:
  return struct.unpack_from("<Q", raw, off)[0]


def shm_file(prefix: str, name: str) -> str:
  return f"/dev/shm/msgq_{prefix}/{name}"   # §3.1: /dev/shm/msgq_<OPENPILOT_PREFIX>/<name>


def read_file(prefix: str, name: str) -> bytes:
  with open(shm_file(prefix, name), "rb") as f:
    return f.read()


# *** msgq ***

def test_publisher_and_reader_write_the_documented_header(prefix):
  pub = msgq.PubSocket("golden", SEG)
  sub = msgq.SubSocket("golden", SEG)
  tid = threading.get_native_id()
  try:
    pub.send(b"hello world")   # 11 bytes: an 8-byte length, the payload, padded to 24
    raw = read_file(prefix, "golden")
    assert len(raw) == SEG + 384   # a 384-byte header, then the data
    assert u64(raw, 0) == 1                          # num_readers
    assert u64(raw, 8) == (0 << 32) | 24             # write_pointer: (cycle << 32) | offset
    assert u64(raw, 16) == pub.uid and u64(raw, 16) & 0xffffffff == tid and u64(raw, 16) >> 32   # write_uid = (rand32 << 32) | tid
    assert u64(raw, 24) == 0                         # read_pointers[0]: registered at the old write pointer
    assert u64(raw, 144) == 1                        # read_valids[0]
    assert u64(raw, 264) == sub.uid and u64(raw, 264) & 0xffffffff == tid   # read_uids[0]
    assert raw[32:144] == bytes(112) and raw[152:264] == bytes(112) and raw[272:384] == bytes(112)   # the other 14 slots
    assert raw[384:384 + 24] == struct.pack("<q", 11) + b"hello world" + bytes(5)
    assert sub.receive(non_blocking=True) == b"hello world"
    assert u64(read_file(prefix, "golden"), 24) == 24   # the reader advanced its own pointer, in place
  finally:
    sub.close()
    pub.close()


def test_publisher_wraps_with_a_minus_one_marker(prefix):
  pub = msgq.PubSocket("wrap", SEG)
  sub = msgq.SubSocket("wrap", SEG)
  try:
    body = b"x" * 1000   # 1008 bytes a record: after four, the fifth does not fit with the 8 bytes kept for the marker
    for _ in range(5):
      pub.send(body)
      assert sub.receive(non_blocking=True) == body
    raw = read_file(prefix, "wrap")
    assert struct.unpack_from("<q", raw, 384 + 4 * 1008)[0] == -1   # the wrap marker where the fifth would have gone
    assert u64(raw, 8) == (1 << 32) | 1008                          # cycle 1, one record in
    assert u64(raw, 384) == 1000 and u64(raw, 24) == (1 << 32) | 1008
  finally:
    sub.close()
    pub.close()


class RawRing:
  """A C++-style publisher written from §3.1 alone: header words and records at the doc's offsets."""

  def __init__(self, prefix: str, name: str):
    self.fd = os.open(shm_file(prefix, name), os.O_RDWR)
    self.mm = mmap.mmap(self.fd, SEG + 384)
    self.cycle = self.off = 0

  def write(self, payload: bytes) -> None:
    total = 8 + (len(payload) + 7) // 8 * 8
    if SEG - self.off - total - 8 <= 0:
      struct.pack_into("<q", self.mm, 384 + self.off, -1)
      self.cycle, self.off = self.cycle + 1, 0
    struct.pack_into("<q", self.mm, 384 + self.off, len(payload))
    self.mm[384 + self.off + 8:384 + self.off + 8 + len(payload)] = payload
    self.off += total
    struct.pack_into("<Q", self.mm, 8, (self.cycle << 32) | self.off)

  def close(self) -> None:
    self.mm.close()
    os.close(self.fd)


def test_reader_follows_a_ring_written_from_the_doc(prefix):
  sub = msgq.SubSocket("raw", SEG)   # creates the file; a reader only sees what is written after it registered
  ring = RawRing(prefix, "raw")
  try:
    assert u64(read_file(prefix, "raw"), 0) == 1 and u64(read_file(prefix, "raw"), 144) == 1
    ring.write(b"first")
    assert sub.receive(non_blocking=True) == b"first"
    assert u64(read_file(prefix, "raw"), 24) == 16
    for i in range(5):   # 5 x 1008 bytes: wraps once
      ring.write(bytes([i]) * 1000)
      assert sub.receive(non_blocking=True) == bytes([i]) * 1000
    assert ring.cycle == 1 and u64(read_file(prefix, "raw"), 24) == (1 << 32) | ring.off
    ring.write(b"dropped")
    struct.pack_into("<Q", ring.mm, 144, 0)   # the writer lapped this reader: valid cleared at read_valids[0]
    assert sub.receive(non_blocking=True) is None   # the backlog is dropped, the reader resyncs to the write pointer
    assert u64(read_file(prefix, "raw"), 144) == 1 and u64(read_file(prefix, "raw"), 24) == (1 << 32) | ring.off
    ring.write(b"after")
    assert sub.receive(non_blocking=True) == b"after"
    struct.pack_into("<Q", ring.mm, 264, 12345)   # another process took read_uids[0]: this reader was evicted
    ring.write(b"lost")
    assert sub.receive(non_blocking=True) is None   # re-registered in the next slot, from the write pointer on
    raw = read_file(prefix, "raw")
    assert (u64(raw, 0), u64(raw, 272), u64(raw, 152), u64(raw, 32)) == (2, sub.uid, 1, (1 << 32) | ring.off)
    ring.write(b"again")
    assert sub.receive(non_blocking=True) == b"again"
  finally:
    ring.close()
    sub.close()


# *** VisionIPC ***

W, H, STRIDE, UV_OFF, SIZE = 64, 32, 128, 4096, 8192   # a small NV12 geometry: stride 128, 32 rows of Y, then UV


def test_server_reply_and_packet_are_the_documented_bytes(prefix):
  srv = VisionIpcServer("golden")
  srv.create_buffers_with_sizes(2, 3, W, H, SIZE, STRIDE, UV_OFF)   # stream type 2 = WIDE_ROAD
  srv.create_buffers_with_sizes(0x8000_0001, 1, W, H, SIZE, STRIDE, UV_OFF)   # the newest msgq's ids are opaque uint32s
  srv.start_listener()
  sub = msgq.SubSocket("visionipc_golden_2", 1 << 20)   # §4.2: endpoint visionipc_<name>_<type>, the default 1 MiB segment
  fds: list[int] = []
  try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
      s.connect(f"/tmp/{prefix}_visionipc_golden")     # §4.1
      s.send(struct.pack("<i", 2))
      msg, anc, _, _ = s.recvmsg(112 * 128, socket.CMSG_SPACE(128 * 4))
    for level, kind, data in anc:
      if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
        fds.extend(array.array("i", data))
    assert len(msg) == 3 * 112 and len(fds) == 3
    for i in range(3):
      d = msg[i * 112:(i + 1) * 112]
      assert (u64(d, 0), u64(d, 8)) == (SIZE, SIZE + 8)                        # len, mmap_len = len + 8
      assert (u64(d, 40), u64(d, 48), u64(d, 56), u64(d, 64)) == (W, H, STRIDE, UV_OFF)
      assert (u64(d, 88), u64(d, 96), struct.unpack_from("<I", d, 104)[0]) == (srv.server_id, i, 2)   # server_id, idx, type
      assert os.fstat(fds[i]).st_size >= SIZE + 8
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
      s.connect(f"/tmp/{prefix}_visionipc_golden")
      s.send(struct.pack("<I", 0x8000_0001))
      msg, anc, _, _ = s.recvmsg(112 * 128, socket.CMSG_SPACE(128 * 4))
    fds.extend(fd for level, kind, data in anc if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS) for fd in array.array("i", data))
    assert len(msg) == 112 and struct.unpack_from("<I", msg, 104)[0] == 0x8000_0001   # type is a u32
    frame = bytes(range(256)) * (SIZE // 256)
    srv.send(2, frame, frame_id=0x1_2345_6789, timestamp_sof=111_000_000_001, timestamp_eof=111_000_000_999)
    pkt = sub.receive(non_blocking=True)
    want = bytearray(48)   # §4.2 VisionIpcPacket
    struct.pack_into("<Q", want, 0, srv.server_id)
    struct.pack_into("<Q", want, 8, 0)
    struct.pack_into("<I", want, 16, 0x2345_6789)   # frame_id is a u32 on the wire
    struct.pack_into("<Q", want, 24, 111_000_000_001)
    struct.pack_into("<Q", want, 32, 111_000_000_999)
    want[40] = 1
    assert pkt == bytes(want)
    with mmap.mmap(fds[0], SIZE + 8, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
      assert mm[:SIZE] == frame and u64(mm, SIZE) == 0x1_2345_6789   # the last 8 bytes hold the frame_id as a u64
  finally:
    for fd in fds:
      os.close(fd)
    sub.close()
    srv.close()


class RawServer:
  """A camera server written from §4.1/§4.2 alone: 112-byte VisionBuf structs at the doc's offsets, 48-byte packets."""

  def __init__(self, prefix: str, name: str, stream: int, n: int, server_id: int):
    self.stream, self.server_id = stream, server_id
    self.pub = msgq.PubSocket(f"visionipc_{name}_{stream}", 1 << 20)   # before any client: a new publisher clears reader slots
    self.fds = []
    for i in range(n):
      fd = os.memfd_create(f"raw{i}")
      os.ftruncate(fd, SIZE + 8)
      os.pwrite(fd, bytes([i + 1]) * SIZE, 0)
      self.fds.append(fd)
    self.control = FakeControlSocket(f"/tmp/{prefix}_visionipc_{name}", self._answer)

  def desc(self, i: int) -> bytes:
    d = bytearray(112)
    struct.pack_into("<QQ", d, 0, SIZE, SIZE + 8)
    struct.pack_into("<i", d, 32, self.fds[i])
    struct.pack_into("<QQQQ", d, 40, W, H, STRIDE, UV_OFF)
    struct.pack_into("<QQ", d, 88, self.server_id, i)
    struct.pack_into("<I", d, 104, self.stream)
    struct.pack_into("<i", d, 108, -1)
    return bytes(d)

  def _answer(self, conn, req: bytes) -> None:
    if struct.unpack("<i", req)[0] == self.stream:
      conn.sendmsg([b"".join(self.desc(i) for i in range(len(self.fds)))],
                   [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", self.fds))])

  def notify(self, idx: int, frame_id: int, sof: int, eof: int, valid: bool) -> None:
    os.pwrite(self.fds[idx], struct.pack("<Q", frame_id), SIZE)
    p = bytearray(48)
    struct.pack_into("<QQ", p, 0, self.server_id, idx)
    struct.pack_into("<I", p, 16, frame_id & 0xffffffff)
    struct.pack_into("<QQ", p, 24, sof, eof)
    p[40] = int(valid)
    p[20:24], p[41:48] = b"\xa5" * 4, b"\x5a" * 7   # C++ leaves padding unset: a reader must not take it for data
    self.pub.send(bytes(p))

  def close(self) -> None:
    self.control.close()
    self.pub.close()
    for fd in self.fds:
      os.close(fd)


def test_client_reads_a_server_written_from_the_doc(prefix):
  srv = RawServer(prefix, "rawcam", 0, 4, server_id=0xfeed_beef_0123_4567)
  client = VisionIpcClient("rawcam", 0, conflate=False)
  try:
    assert client.connect(True)
    assert (client.num_buffers, client.width, client.height, client.stride, client.uv_offset, client.buffer_len) == (4, W, H, STRIDE, UV_OFF, SIZE)
    assert [b.idx for b in client.buffers] == [0, 1, 2, 3] and {b.server_id for b in client.buffers} == {srv.server_id}
    srv.notify(2, frame_id=77, sof=5_000_000_000, eof=5_000_020_000, valid=True)
    buf = client.recv(1000)
    assert buf is not None and buf.idx == 2 and bytes(buf.data[:4]) == b"\x03" * 4 and buf.frame_id == 77
    assert (client.frame_id, client.timestamp_sof, client.timestamp_eof, client.valid) == (77, 5_000_000_000, 5_000_020_000, True)
    srv.notify(1, frame_id=78, sof=5_050_000_000, eof=5_050_020_000, valid=False)
    buf = client.recv(1000)
    assert buf is not None and buf.idx == 1 and (client.frame_id, client.valid) == (78, False)
  finally:
    client.close()
    srv.close()
