"""openpilot's VisionIPC in pure Python: camera frames in shared buffers, announced over msgq.

Control channel: AF_UNIX SOCK_SEQPACKET at /tmp/visionipc_<server> (/tmp/<OPENPILOT_PREFIX>_visionipc_<server>). A client
sends its stream type as a 32-bit integer and gets back, in one message, N raw 112-byte C `VisionBuf` structs plus N fds
(SCM_RIGHTS). Each fd maps len + 8 bytes; the last 8 hold the frame id. Frames are announced on msgq endpoint
visionipc_<server>_<type> (msgq's 1 MiB default) as a 48-byte packet: server_id, idx, frame_id, timestamp_sof,
timestamp_eof, valid.

Two dialects of the stream-list request are in the field, and both sides here speak both:
- msgq as pinned by openpilot 0.11: request 4 (VISION_STREAM_MAX), reply an int32 array (stream types 0..3).
- msgq after "Remove camera knowledge from visionipc" (commaai/msgq 0e266c1): stream ids are opaque uint32s, request
  0xffffffff (VISION_STREAM_LIST), reply a uint32 array of up to 64 ids. There 4 is an ordinary stream id.
A server of either dialect closes the connection without a reply on a request it does not know.

Buffers here are memfds (camerad on a PC uses unlinked /dev/shm files; either is just an fd to the client).
On a device camerad's buffers are cached dma-bufs: the C++ client syncs CPU caches on recv, and so does this one
(DMA_BUF_IOCTL_SYNC start at recv, end when the next frame arrives), where the fd is a dma-buf.
"""
from __future__ import annotations

import array
import errno
import fcntl
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
  # openpilot master's names since PR #38585 (VISION_STREAM_NARROW_ROAD / VISION_STREAM_CABIN): the same ids, so a server
  # of either version serves a client of the other
  NARROW_ROAD = 0
  CABIN = 1


VISION_STREAM_MAX = 4                 # 0.11's list request (and its enum's end)
VISION_STREAM_LIST = 0xFFFFFFFF       # the newest msgq's list request
MAX_STREAMS = 64                      # the newest client reads at most this many ids
MAX_FDS = 128
# linux/dma-buf.h: DMA_BUF_IOCTL_SYNC = _IOW('b', 0, struct dma_buf_sync { __u64 flags; })
DMA_BUF_IOCTL_SYNC = 0x40086200
DMA_BUF_SYNC_READ, DMA_BUF_SYNC_START, DMA_BUF_SYNC_END = 1 << 0, 0 << 2, 1 << 2
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


# dma-buf fds of client buffers by the address of their data: what a GPU process imports (PRIME) instead of copying frames
_DMABUF_FDS: dict[int, int] = {}


def dmabuf_fd(data: np.ndarray) -> int | None:
  """The dma-buf fd behind a client buffer's frame data (its first byte), or None (a memfd/shm buffer, or not ours)."""
  return _DMABUF_FDS.get(data.ctypes.data)


def register_dmabuf(data: np.ndarray, fd: int) -> None:
  """Marks `data` (a buffer's frame, from its first byte) as backed by dma-buf `fd` at offset 0."""
  _DMABUF_FDS[data.ctypes.data] = fd


class VisionBuf:
  """One shared frame buffer. `data` is a zero-copy uint8 view of its `len` bytes (NV12: Y rows, then UV at uv_offset)."""

  def __init__(self, fd: int, length: int, width: int, height: int, stride: int, uv_offset: int, idx: int, stream: int,
               server_id: int = 0, mmap_len: int | None = None):
    self.len, self.mmap_len = length, mmap_len or length + 8
    self.width, self.height, self.stride, self.uv_offset = width, height, stride, uv_offset
    self.idx, self.type, self.server_id = idx, stream, server_id
    self.fd = fd
    self.sync_fd = -1        # a client's own dup of a dma-buf fd, kept for cache syncs; -1: not a dma-buf
    self._reading = False
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

  def begin_read(self) -> None:
    """Make the device's writes visible to the CPU (a no-op unless the buffer is a dma-buf)."""
    if self.sync_fd >= 0 and not self._reading:
      _dmabuf_sync(self.sync_fd, DMA_BUF_SYNC_START | DMA_BUF_SYNC_READ)
      self._reading = True

  def end_read(self) -> None:
    if self._reading:
      self._reading = False
      _dmabuf_sync(self.sync_fd, DMA_BUF_SYNC_END | DMA_BUF_SYNC_READ)

  def release(self) -> None:
    """Drop our references; the mapping goes when the last numpy view handed out does."""
    if self.data is not None:
      _DMABUF_FDS.pop(self.data.ctypes.data, None)
    if self.sync_fd >= 0:
      try:
        self.end_read()
      except OSError:
        pass   # the fd goes anyway; the next importer starts its own access
      os.close(self.sync_fd)
      self.sync_fd = -1
    self.data = self._fid = None  # type: ignore[assignment]
    self._mm = None


def _check_descriptor(fd: int, length: int, mmap_len: int, width: int, height: int, stride: int, uv_offset: int) -> None:
  """A buffer reply the frame views can be built on: a mapping longer than the fd would be a SIGBUS at the first read
  (found by testing/fuzz.py), and a geometry outside `len` a reshape error in the reader's loop. OSError: the caller's
  "connect failed" path."""
  size = os.fstat(fd).st_size   # memfd, shm file and dma-buf alike report their size
  if not (0 < length and length + 8 <= mmap_len and (size == 0 or mmap_len <= size)):
    raise OSError(f"buffer descriptor len {length} / mmap_len {mmap_len} does not fit its {size}-byte fd")
  if not (0 < width <= stride and 0 < height and stride * height <= uv_offset and uv_offset + stride * ((height + 1) // 2) <= length):
    raise OSError(f"buffer descriptor geometry {width}x{height} stride {stride} uv_offset {uv_offset} does not fit len {length}")


def _dmabuf_sync(fd: int, flags: int) -> None:
  fcntl.ioctl(fd, DMA_BUF_IOCTL_SYNC, struct.pack("<Q", flags))


def _is_dmabuf(fd: int) -> bool:
  """A buffer fd that takes DMA_BUF_IOCTL_SYNC. camerad's device buffers do; memfds and shm files answer ENOTTY."""
  try:
    _dmabuf_sync(fd, DMA_BUF_SYNC_START | DMA_BUF_SYNC_READ)
    _dmabuf_sync(fd, DMA_BUF_SYNC_END | DMA_BUF_SYNC_READ)
    return True
  except OSError as e:
    if e.errno != errno.ENOTTY:
      log.warning("visionipc: buffer fd refused a cache sync (%s); reading it without syncs", e)
    return False


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
    if not 0 <= stream < VISION_STREAM_LIST:
      raise ValueError(f"stream id must be 0..{VISION_STREAM_LIST - 1:#x} (the newest msgq's opaque uint32 ids), got {stream}")
    if stream not in self.buffers and len(self.buffers) >= MAX_STREAMS:
      raise ValueError(f"a server offers at most {MAX_STREAMS} streams (what the newest msgq client reads in its list)")
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
    stream = struct.unpack("<I", req)[0]
    # VISION_STREAM_MAX is 0.11's list request; a server with a stream 4 can only be in the newest dialect, where 4
    # names that stream. Both replies are the same bytes: little-endian 32-bit ids (int32 in 0.11, uint32 after).
    if stream == VISION_STREAM_LIST or (stream == VISION_STREAM_MAX and stream not in self.buffers):
      conn.send(struct.pack(f"<{len(self.buffers)}I", *sorted(self.buffers)))
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


_NO_SERVER = object()
_list_dialect: dict[str, int] = {}   # server socket path -> the list request it last answered


def _list_streams(name: str, blocking: bool, request: int):
  """One list request: the set of ids, None when the server did not answer this dialect, or _NO_SERVER."""
  s = _connect(name, blocking)
  if s is None:
    return _NO_SERVER
  with s:
    try:
      s.send(struct.pack("<I", request))
      data, anc, _, _ = s.recvmsg(4 * MAX_STREAMS, socket.CMSG_SPACE(MAX_FDS * 4))
    except OSError:
      return None   # reset or timed out: the server went away or ignored us; the other dialect may still answer
  fds = [fd for level, kind, cdata in anc if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
         for fd in array.array("i", cdata[:len(cdata) - len(cdata) % 4])]
  for fd in fds:
    os.close(fd)
  if fds or not data or len(data) % 4:
    # fds: a newest-dialect server took 4 for its stream 4 and sent buffers. Empty: closed without a reply (a server
    # of the other dialect), or a server with no streams, which the other request reports just as well.
    return None
  return set(struct.unpack(f"<{len(data) // 4}I", data))


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
    self.sync_errors = 0
    self._reading: VisionBuf | None = None   # the frame last handed out, while its CPU access is open
    self.frame_id = self.timestamp_sof = self.timestamp_eof = 0
    self.valid = False

  def connect(self, blocking: bool) -> bool:
    self.connected = False
    self._reading = None
    for b in self.buffers:
      b.release()
    self.buffers = []
    s = _connect(self.name, blocking)
    if s is None:
      return False
    fds: list[int] = []
    bufs: list[VisionBuf] = []
    try:
      with s:
        s.send(struct.pack("<I", self.type))
        msg, anc, flags, _ = s.recvmsg(_DESC.size * MAX_FDS, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, cdata in anc:
          if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", cdata[:len(cdata) - len(cdata) % 4]))
      if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or not msg or len(msg) != _DESC.size * len(fds):
        raise OSError(f"bad buffer reply: {len(msg)} bytes, {len(fds)} fds, flags {flags:#x}")
      for i, fd in enumerate(fds):
        ln, mmap_len, _, _, _, w, h, stride, uv_off, _, _, sid, idx, tp, _ = _DESC.unpack_from(msg, i * _DESC.size)
        _check_descriptor(fd, ln, mmap_len, w, h, stride, uv_off)
        bufs.append(VisionBuf(fd, ln, w, h, stride, uv_off, idx, tp, sid, mmap_len))
        if _is_dmabuf(fd):
          bufs[-1].sync_fd = fd   # cached device memory: keep the fd for the syncs around each read (and a GPU import)
          register_dmabuf(bufs[-1].data, fd)
        else:
          os.close(fd)            # the mapping keeps the memory
        fds[i] = -1
      fds = []
    except OSError as e:
      for fd in fds:
        if fd >= 0:
          os.close(fd)
      for b in bufs:
        b.release()
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
    self._sync_for_read(buf)
    return buf

  def _sync_for_read(self, buf: VisionBuf) -> None:
    """End the CPU access to the frame handed out before (the caller is done with it) and begin one for this frame,
    as the C++ client syncs each buffer on recv. A failed sync is logged and counted; the frame is still returned."""
    failed: OSError | None = None
    steps = [buf.begin_read] if self._reading is None or self._reading is buf else [self._reading.end_read, buf.begin_read]
    for step in steps:   # one failing step must not skip the other
      try:
        step()
      except OSError as e:
        failed = e
    self._reading = buf
    if failed is not None:
      self.sync_errors += 1
      if self.sync_errors == 1 or self.sync_errors % 100 == 0:
        log.warning("visionipc %s: buffer cache sync failed (%d so far): %s", self.name, self.sync_errors, failed)

  def _lookup(self, server_id: int, idx: int) -> VisionBuf | None:
    if idx >= len(self.buffers) or self.buffers[idx].server_id != server_id:
      return None
    return self.buffers[idx]

  @staticmethod
  def available_streams(name: str, block: bool) -> set:
    """Stream types the server offers (VisionStreamType members where known, else the raw id), empty if no server answers.

    Asks in the dialect this server answered last (0.11's first), then in the other: each dialect's server closes the
    connection on the other's request, so a second connection settles it."""
    order = (VISION_STREAM_MAX, VISION_STREAM_LIST)
    if _list_dialect.get(ipc_path(name)) == VISION_STREAM_LIST:
      order = order[::-1]
    for req in order:
      got = _list_streams(name, block, req)
      if got is _NO_SERVER:
        return set()
      if isinstance(got, set):
        _list_dialect[ipc_path(name)] = req
        known = {int(t) for t in VisionStreamType}
        return {VisionStreamType(t) if t in known else t for t in got}
    return set()

  def close(self) -> None:
    self._reading = None
    for b in self.buffers:
      b.release()
    self.buffers = []
    self.sock.close()
