"""openpilot's VisionIPC (msgq as pinned by 0.11), in pure Python: camera frames in shared buffers, announced over msgq.

Control channel: AF_UNIX SOCK_SEQPACKET at /tmp/visionipc_<server> (/tmp/<OPENPILOT_PREFIX>_visionipc_<server>). A client
sends its stream type as an int32 and gets back, in one message, N raw 112-byte C `VisionBuf` structs plus N fds
(SCM_RIGHTS); type 4 (VISION_STREAM_MAX) asks for the int32 list of streams instead. Each fd maps len + 8 bytes; the
last 8 hold the frame id. Frames are announced on msgq endpoint visionipc_<server>_<type> (msgq's 1 MiB default) as a
48-byte packet: server_id, idx, frame_id, timestamp_sof, timestamp_eof, valid.

Buffers here are memfds (camerad on a PC uses unlinked /dev/shm files; either is just an fd to the client).
On a device camerad's buffers are cached ION dma-bufs and the C++ client syncs caches on recv; a plain mmap does not.
"""
from __future__ import annotations

import array
import logging
import mmap
import os
import random
import select
import socket
import struct
import threading
import time
from enum import IntEnum

import numpy as np

from selfdrive_glue import msgq
from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.services import DEFAULT_SEGMENT_SIZE

log = logging.getLogger(__name__)


class VisionStreamType(IntEnum):
  ROAD = 0
  DRIVER = 1
  WIDE_ROAD = 2
  MAP = 3


VISION_STREAM_MAX = 4
MAX_FDS = 128
# size_t len, mmap_len; void *addr; uint64_t *frame_id; int fd; size_t width, height, stride, uv_offset; uint8_t *y, *uv;
# uint64_t server_id; size_t idx; enum type; int handle   (LP64 layout, 112 bytes)
_DESC = struct.Struct("<QQQQi4xQQQQQQQQIi")
_PACKET = struct.Struct("<QQI4xQQ?7x")   # VisionIpcPacket: server_id, idx, {frame_id, timestamp_sof, timestamp_eof, valid}
assert _DESC.size == 112 and _PACKET.size == 48


def ipc_path(name: str) -> str:
  prefix = os.environ.get("OPENPILOT_PREFIX")
  return f"/tmp/{prefix}_visionipc_{name}" if prefix else f"/tmp/visionipc_{name}"


def endpoint_name(name: str, stream: int) -> str:
  return f"visionipc_{name}_{int(stream)}"


class VisionBuf:
  """One shared frame buffer. `data` is a zero-copy uint8 view of its `len` bytes (NV12: Y rows, then UV at uv_offset)."""

  def __init__(self, fd: int, length: int, width: int, height: int, stride: int, uv_offset: int, idx: int, stream: int,
               server_id: int = 0, mmap_len: int | None = None):
    self.len, self.mmap_len = length, mmap_len or length + 8
    self.width, self.height, self.stride, self.uv_offset = width, height, stride, uv_offset
    self.idx, self.type, self.server_id = idx, stream, server_id
    self.fd = fd
    self._mm: mmap.mmap | None = mmap.mmap(fd, self.mmap_len, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    self.data = np.frombuffer(self._mm, dtype=np.uint8, count=self.len)
    self._fid = np.frombuffer(self._mm, dtype="<u8", count=1, offset=self.len)

  @property
  def frame_id(self) -> int:
    return int(self._fid[0])

  @frame_id.setter
  def frame_id(self, v: int) -> None:
    self._fid[0] = v

  @property
  def y(self) -> np.ndarray:
    """(height, width) view of the luma plane."""
    return self.data[:self.stride * self.height].reshape(self.height, self.stride)[:, :self.width]

  @property
  def uv(self) -> np.ndarray:
    """(height/2, width) view of the interleaved chroma plane."""
    h2 = self.height // 2
    return self.data[self.uv_offset:self.uv_offset + self.stride * h2].reshape(h2, self.stride)[:, :self.width]

  def descriptor(self) -> bytes:
    return _DESC.pack(self.len, self.mmap_len, 0, 0, self.fd, self.width, self.height, self.stride, self.uv_offset, 0, 0,
                      self.server_id, self.idx, self.type, 0)

  def release(self) -> None:
    """Drop our references; the mapping goes when the last numpy view handed out does."""
    self.data = self._fid = None  # type: ignore[assignment]
    self._mm = None


class VisionIpcServer:
  def __init__(self, name: str):
    self.name = name
    self.server_id = random.getrandbits(64)
    self.buffers: dict[int, list[VisionBuf]] = {}
    self.cur_idx: dict[int, int] = {}
    self.socks: dict[int, msgq.PubSocket] = {}
    self._listener: threading.Thread | None = None
    self._stop = threading.Event()
    self._path = ipc_path(name)

  def create_buffers(self, stream: int, num_buffers: int, width: int, height: int) -> None:
    """Buffers with camerad's VENUS NV12 geometry (stride and heights aligned, padded tail), not msgq's tight NV12:
    1928x1208 -> stride 2048, uv_offset 2490368, len 4804608. Use create_buffers_with_sizes for any other layout."""
    g = nv12_info(width, height)
    self.create_buffers_with_sizes(stream, num_buffers, width, height, g.size, g.stride, g.uv_offset)

  def create_buffers_with_sizes(self, stream: int, num_buffers: int, width: int, height: int, size: int, stride: int,
                                uv_offset: int) -> None:
    stream = int(stream)
    if not 0 < num_buffers < MAX_FDS:
      raise ValueError(f"num_buffers must be 1..{MAX_FDS - 1}, got {num_buffers}")
    if stream in self.buffers:
      raise ValueError(f"buffers for stream {stream} already exist")
    if stride < width or uv_offset < stride * height or size < uv_offset + stride * ((height + 1) // 2):
      raise ValueError(f"inconsistent NV12 geometry: {width}x{height} stride {stride} uv_offset {uv_offset} size {size}")
    bufs = []
    for i in range(num_buffers):
      fd = os.memfd_create(f"visionbuf_{self.name}_{stream}_{i}", os.MFD_CLOEXEC)
      os.ftruncate(fd, size + 8)
      bufs.append(VisionBuf(fd, size, width, height, stride, uv_offset, i, stream, self.server_id))
    self.buffers[stream] = bufs
    self.cur_idx[stream] = 0
    self.socks[stream] = msgq.PubSocket(endpoint_name(self.name, stream), DEFAULT_SEGMENT_SIZE)

  def start_listener(self) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
      os.unlink(self._path)
    except FileNotFoundError:
      pass
    sock.bind(self._path)
    sock.listen(8)
    self._listener = threading.Thread(target=self._listen, args=(sock,), name=f"vipc-{self.name}", daemon=True)
    self._listener.start()

  def _listen(self, sock: socket.socket) -> None:
    # poll, not select: a process with more than 1024 open files (camera buffers, GPU objects) gets socket fds select() refuses
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    with sock:
      while not self._stop.is_set():
        if not poller.poll(100):
          continue
        try:
          conn, _ = sock.accept()
        except OSError:
          continue
        with conn:
          try:
            self._serve(conn)
          except OSError as e:
            log.warning("visionipc %s: client request failed: %s", self.name, e)

  def _serve(self, conn: socket.socket) -> None:
    conn.settimeout(1.0)
    req = conn.recv(64)
    if len(req) != 4:
      log.warning("visionipc %s: bad request of %d bytes", self.name, len(req))
      return
    stream = struct.unpack("<i", req)[0]
    if stream == VISION_STREAM_MAX:
      conn.send(array.array("i", sorted(self.buffers)).tobytes())
      return
    bufs = self.buffers.get(stream)
    if not bufs:
      log.warning("visionipc %s: request for stream %d, which this server does not have", self.name, stream)
      return
    payload = b"".join(b.descriptor() for b in bufs)
    conn.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [b.fd for b in bufs]))])

  def get_buffer(self, stream: int) -> VisionBuf:
    """The next buffer, round-robin, to fill in place (zero-copy) and hand to send_buf."""
    bufs = self.buffers[int(stream)]
    idx = self.cur_idx[int(stream)] % len(bufs)
    self.cur_idx[int(stream)] = idx + 1
    return bufs[idx]

  def send_buf(self, buf: VisionBuf, frame_id: int = 0, timestamp_sof: int = 0, timestamp_eof: int = 0, valid: bool = True) -> None:
    buf.frame_id = frame_id
    self.socks[buf.type].send(_PACKET.pack(self.server_id, buf.idx, frame_id & 0xFFFFFFFF, timestamp_sof, timestamp_eof, valid))

  def send(self, stream: int, data, frame_id: int = 0, timestamp_sof: int = 0, timestamp_eof: int = 0) -> None:
    buf = self.get_buffer(stream)
    src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    if src.size != buf.len:
      raise ValueError(f"frame of {src.size} bytes does not fit stream {int(stream)} buffers of {buf.len} bytes")
    buf.data[:] = src
    self.send_buf(buf, frame_id, timestamp_sof, timestamp_eof)

  def close(self) -> None:
    self._stop.set()
    if self._listener is not None:
      self._listener.join(2)
      self._listener = None
    try:
      os.unlink(self._path)
    except FileNotFoundError:
      pass
    for s in self.socks.values():
      s.close()
    for bufs in self.buffers.values():
      for b in bufs:
        os.close(b.fd)
        b.release()
    self.socks, self.buffers = {}, {}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _connect(name: str, blocking: bool) -> socket.socket | None:
  path = ipc_path(name)
  while True:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
      s.connect(path)
      s.settimeout(2.0)
      return s
    except OSError:
      s.close()
      if not blocking:
        return None
      time.sleep(0.1)


class VisionIpcClient:
  """Receives frames of one stream. After a camera server restart, recv() reconnects by itself (auto_reconnect)."""

  def __init__(self, name: str, stream: int, conflate: bool, auto_reconnect: bool = True):
    self.name, self.type, self.conflate, self.auto_reconnect = name, int(stream), conflate, auto_reconnect
    self.sock = msgq.SubSocket(endpoint_name(name, self.type), DEFAULT_SEGMENT_SIZE, conflate=conflate)
    self.buffers: list[VisionBuf] = []
    self.connected = False
    self.bad_packets = 0
    self.frame_id = self.timestamp_sof = self.timestamp_eof = 0
    self.valid = False

  def connect(self, blocking: bool) -> bool:
    self.connected = False
    for b in self.buffers:
      b.release()
    self.buffers = []
    s = _connect(self.name, blocking)
    if s is None:
      return False
    fds: list[int] = []
    try:
      with s:
        s.send(struct.pack("<i", self.type))
        msg, anc, flags, _ = s.recvmsg(_DESC.size * MAX_FDS, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, cdata in anc:
          if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", cdata[:len(cdata) - len(cdata) % 4]))
      if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or not msg or len(msg) != _DESC.size * len(fds):
        raise OSError(f"bad buffer reply: {len(msg)} bytes, {len(fds)} fds, flags {flags:#x}")
      bufs = []
      for i, fd in enumerate(fds):
        ln, mmap_len, _, _, _, w, h, stride, uv_off, _, _, sid, idx, tp, _ = _DESC.unpack_from(msg, i * _DESC.size)
        bufs.append(VisionBuf(fd, ln, w, h, stride, uv_off, idx, tp, sid, mmap_len))
        os.close(fd)   # the mapping keeps the memory
      fds = []
    except OSError as e:
      for fd in fds:
        os.close(fd)
      log.warning("visionipc %s: connect for stream %d failed: %s", self.name, self.type, e)
      return False
    self.buffers = bufs
    self.connected = True
    return True

  def is_connected(self) -> bool:
    return self.connected

  @property
  def num_buffers(self) -> int:
    return len(self.buffers)

  def _first(self, attr):
    return getattr(self.buffers[0], attr) if self.buffers else None

  width = property(lambda self: self._first("width"))
  height = property(lambda self: self._first("height"))
  stride = property(lambda self: self._first("stride"))
  uv_offset = property(lambda self: self._first("uv_offset"))
  buffer_len = property(lambda self: self._first("len"))

  def recv(self, timeout_ms: int = 100) -> VisionBuf | None:
    if not msgq.poll([self.sock], timeout_ms):
      return None
    pkt = self.sock.receive(non_blocking=True)
    if pkt is None:
      return None
    if len(pkt) != _PACKET.size:
      self.bad_packets += 1
      log.warning("visionipc %s: dropped a %d-byte notification (want %d)", self.name, len(pkt), _PACKET.size)
      return None
    server_id, idx, frame_id, sof, eof, valid = _PACKET.unpack(pkt)
    buf = self._lookup(server_id, idx)
    if buf is None and self.auto_reconnect and self.connect(False):
      buf = self._lookup(server_id, idx)   # the packet came from the new server: its buffer is ours now
    if buf is None:
      if self.connected and self.buffers and self.buffers[0].server_id == server_id:   # our server, impossible idx
        self.bad_packets += 1
        log.warning("visionipc %s: dropped a notification for buffer %d of %d", self.name, idx, len(self.buffers))
      if not self.auto_reconnect:
        self.connected = False   # openpilot's contract: the caller must connect() again
      return None
    self.frame_id, self.timestamp_sof, self.timestamp_eof, self.valid = frame_id, sof, eof, valid
    return buf

  def _lookup(self, server_id: int, idx: int) -> VisionBuf | None:
    if idx >= len(self.buffers) or self.buffers[idx].server_id != server_id:
      return None
    return self.buffers[idx]

  @staticmethod
  def available_streams(name: str, block: bool) -> set:
    """Stream types the server offers (VisionStreamType members), empty if no server answers."""
    s = _connect(name, block)
    if s is None:
      return set()
    with s:
      try:
        s.send(struct.pack("<i", VISION_STREAM_MAX))
        data = s.recv(4 * 64)
      except OSError:
        return set()
    known = {int(t) for t in VisionStreamType}
    return {VisionStreamType(t) if t in known else t for t in array.array("i", data[:len(data) - len(data) % 4])}

  def close(self) -> None:
    for b in self.buffers:
      b.release()
    self.buffers = []
    self.sock.close()
