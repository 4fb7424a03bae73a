"""openpilot's msgq shared-memory transport, in pure Python (wire-compatible with commaai/msgq as pinned by 0.11).

One file per endpoint, /dev/shm/msgq_<name> (or /dev/shm/msgq_<OPENPILOT_PREFIX>/<name>): a 384-byte header of
little-endian u64 words, then a ring of [int64 length][payload, padded to 8]. A length of -1 means "wrap to 0".
Pointers pack (cycle << 32) | offset. One writer owns the queue (write_uid); up to 15 readers own a slot each.
Writers wake readers with tkill(tid, SIGUSR2); readers here sleep in sigtimedwait with SIGUSR2 blocked just for the
wait, and the process gets a no-op SIGUSR2 handler at import and SIG_IGN at exit, so the signal is a wake-up, never a death.

Two things C++ has that Python lacks, and how they are covered:
- compare-and-swap for the reader count: Python registrants serialise on flock(); a C++ reader registering in the
  same microsecond could still collide, which the protocol's eviction/re-registration heals.
- memory fences: x86-64 keeps stores in order (TSO); elsewhere a pthread spinlock lock/unlock pair is the fence.
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import platform
import random
import signal
import threading
import time
from collections.abc import Iterable

from selfdrive_glue.services import segment_size

log = logging.getLogger(__name__)

HEADER_SIZE = 384
NUM_READERS = 15
_NUM_READERS, _WRITE_POINTER, _WRITE_UID = 0, 1, 2
_READ_POINTERS, _READ_VALIDS, _READ_UIDS = 3, 3 + NUM_READERS, 3 + 2 * NUM_READERS
_WRAP = -1
_SYS_TKILL = {"x86_64": 200, "aarch64": 130, "arm64": 130}.get(platform.machine())


class IpcError(Exception):
  pass


class MultiplePublishersError(IpcError):
  pass


def _align8(n: int) -> int:
  return (n + 7) & ~7


def _split(ptr: int) -> tuple[int, int]:
  return ptr >> 32, ptr & 0xFFFFFFFF


def _pack(cycle: int, offset: int) -> int:
  return ((cycle & 0xFFFFFFFF) << 32) | (offset & 0xFFFFFFFF)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _make_fence(machine: str = platform.machine()):
  if machine in ("x86_64", "AMD64", "i686"):
    return lambda: None
  lock = ctypes.create_string_buffer(64)
  _libc.pthread_spin_init(lock, 0)

  def fence():
    # acquire + release on a private lock: on ARMv8 (ldaxr / stlr, RCsc) nothing crosses the pair
    _libc.pthread_spin_lock(lock)
    _libc.pthread_spin_unlock(lock)
  return fence


_fence = _make_fence()


def wake(tid: int) -> None:
  """tkill(tid, SIGUSR2): what msgq does to each reader after a write."""
  if tid <= 0:
    return
  if _SYS_TKILL is None:
    try:
      os.kill(tid, signal.SIGUSR2)
    except OSError:
      pass
    return
  _libc.syscall(_SYS_TKILL, ctypes.c_int(tid), ctypes.c_int(signal.SIGUSR2))


def _noop_handler(signum, frame):
  pass


def prepare_signals() -> None:
  """Make SIGUSR2 harmless to this process: a no-op handler unless someone installed one. A handler rather than SIG_IGN
  because exec() resets handlers, so programs we start (maybe openpilot's own) get msgq's default back.
  Only the main thread may change it, so this also runs at import."""
  if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None):
    signal.signal(signal.SIGUSR2, _noop_handler)


def _ignore_at_exit() -> None:
  """Python puts every signal it caught back to SIG_DFL while it finalizes, after the atexit hooks: a publisher that still
  lists this process as a reader would then kill it with its next tkill (exit status 140, or -12 to a parent), so a clean
  stop would look like a crash. SIG_IGN is the one disposition finalization leaves alone, and nothing is exec'd after this.
  A wake-up caught just before the switch would find SIG_IGN when Python gets to run its handler, and CPython reports that
  as "Signal 12 ignored due to race condition" on stderr: so the signal is blocked first (pthread_sigmask runs the handlers
  of what was already caught), ignored (which drops what is pending), then unblocked."""
  if threading.current_thread() is threading.main_thread():
    usr2 = {signal.SIGUSR2}
    signal.pthread_sigmask(signal.SIG_BLOCK, usr2)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, usr2)


prepare_signals()
atexit.register(_ignore_at_exit)


def _new_uid() -> int:
  return (random.getrandbits(32) << 32) | threading.get_native_id()


def shm_path(name: str) -> str:
  prefix = os.environ.get("OPENPILOT_PREFIX")
  base = "/dev/shm/msgq_"
  return f"{base}{prefix}/{name}" if prefix else f"{base}{name}"


class Queue:
  """The mapped file of one endpoint. Opening it (like msgq) sets its size to size + 384."""

  def __init__(self, name: str, size: int | None = None):
    if not name or "/" in name:
      raise IpcError(f"bad msgq endpoint name {name!r}")
    self.name = name
    self.size = int(size or segment_size(name))
    if self.size % 8 or self.size >= 1 << 32:
      raise IpcError(f"segment size {self.size} for {name} must be a multiple of 8 below 4 GiB")
    self.path = shm_path(name)
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o664)
    try:
      os.ftruncate(fd, self.size + HEADER_SIZE)
      self._mm: mmap.mmap | None = mmap.mmap(fd, self.size + HEADER_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
      self._lockfd = os.dup(fd)
    finally:
      os.close(fd)
    mv = memoryview(self._mm)
    self.h = mv[:HEADER_SIZE].cast("Q")       # header words
    self.w = mv[HEADER_SIZE:].cast("q")       # ring, as signed 8-byte words (length tags)
    self.b = mv[HEADER_SIZE:]                 # ring, as bytes

  def close(self) -> None:
    if self._mm is None:
      return
    for v in (self.h, self.w, self.b):
      v.release()
    self._mm.close()
    os.close(self._lockfd)
    self._mm = None

  def num_readers(self) -> int:
    return min(self.h[_NUM_READERS], NUM_READERS)

  def shrunk(self) -> bool:
    """Another party re-truncated the file to a smaller segment: touching our mapping past its end would SIGBUS."""
    return os.fstat(self._lockfd).st_size < self.size + HEADER_SIZE

  def size_error(self) -> IpcError:
    have = os.fstat(self._lockfd).st_size - HEADER_SIZE
    return IpcError(f"msgq '{self.name}' was reopened with a {have}-byte segment, we use {self.size}: every process must use "
                    "openpilot 0.11's queue sizes (selfdrive_glue.services)")


class PubSocket:
  def __init__(self, name: str, size: int | None = None):
    self.q = Queue(name, size)
    self.uid = _new_uid()
    h = self.q.h
    h[_WRITE_UID] = self.uid
    h[_NUM_READERS] = 0
    for i in range(NUM_READERS):
      h[_READ_VALIDS + i] = 0
      h[_READ_UIDS + i] = 0

  @property
  def name(self) -> str:
    return self.q.name

  def send(self, data: bytes | bytearray | memoryview) -> int:
    q, h = self.q, self.q.h
    if q.shrunk():
      raise q.size_error()
    if h[_WRITE_UID] != self.uid:
      raise MultiplePublishersError(f"another publisher took over '{q.name}' ({os.strerror(errno.EADDRINUSE)})")
    size = len(data)
    if size == 0:
      raise IpcError(f"refusing to send an empty message on '{q.name}' (readers treat length 0 as corrupt)")
    total = _align8(size + 8)
    if 3 * total > q.size:
      raise IpcError(f"message of {size} bytes is too big for '{q.name}' (segment {q.size} bytes holds at most a third)")
    nr = q.num_readers()
    wc, wp = _split(h[_WRITE_POINTER])
    if wp % 8 or wp >= q.size:
      # a scribbled header (or a file left by a different segment size): restart the ring, every reader resyncs
      log.warning("msgq '%s': write pointer %d is outside the %d-byte ring; restarting it", q.name, wp, q.size)
      for i in range(NUM_READERS):
        h[_READ_VALIDS + i] = 0
      wp, wc = 0, (wc + 1) & 0xFFFFFFFF
    if q.size - wp - total - 8 <= 0:
      q.w[wp // 8] = _WRAP
      for i in range(nr):
        rc, rp = _split(h[_READ_POINTERS + i])
        if rp > wp and rc != wc:
          h[_READ_VALIDS + i] = 0
      wp, wc = 0, (wc + 1) & 0xFFFFFFFF
      h[_WRITE_POINTER] = _pack(wc, 0)
    end = _align8(wp + 8 + size)
    for i in range(nr):
      rc, rp = _split(h[_READ_POINTERS + i])
      if wp <= rp < end and rc != wc:
        h[_READ_VALIDS + i] = 0
    q.w[wp // 8] = size
    q.b[wp + 8:wp + 8 + size] = data
    _fence()
    h[_WRITE_POINTER] = _pack(wc, end)
    for i in range(nr):
      wake(h[_READ_UIDS + i] & 0xFFFFFFFF)
    return size

  def all_readers_updated(self) -> bool:
    h = self.q.h
    nr = self.q.num_readers()
    wp = h[_WRITE_POINTER]
    return nr > 0 and all(not h[_READ_VALIDS + i] or h[_READ_POINTERS + i] == wp for i in range(nr))

  def close(self) -> None:
    self.q.close()


class SubSocket:
  """A reader slot. receive() -> bytes or None; corrupt length tags reset the reader instead of crashing."""

  def __init__(self, name: str, size: int | None = None, conflate: bool = False, timeout: int | None = None):
    prepare_signals()
    self.q = Queue(name, size)
    self.conflate = conflate
    self.timeout = -1 if timeout is None else int(timeout)
    self.corrupt = 0
    self._size_warned = False
    self.reader_id = -1
    self.uid = 0
    self._register()

  @property
  def name(self) -> str:
    return self.q.name

  def set_timeout(self, timeout_ms: int | None) -> None:
    self.timeout = -1 if timeout_ms is None else int(timeout_ms)

  setTimeout = set_timeout

  def _register(self) -> None:
    h = self.q.h
    uid = _new_uid()
    fcntl.flock(self.q._lockfd, fcntl.LOCK_EX)
    try:
      while True:
        cur = h[_NUM_READERS]
        if cur + 1 > NUM_READERS:
          # all slots taken: evict everyone (dead readers never give theirs back); live ones re-register
          h[_NUM_READERS] = 0
          for i in range(NUM_READERS):
            h[_READ_VALIDS + i] = 0
            old = h[_READ_UIDS + i]
            h[_READ_UIDS + i] = 0
            wake(old & 0xFFFFFFFF)
          continue
        h[_NUM_READERS] = cur + 1
        if h[_NUM_READERS] != cur + 1:
          continue
        self.reader_id, self.uid = cur, uid
        h[_READ_VALIDS + cur] = 0
        h[_READ_POINTERS + cur] = 0
        h[_READ_UIDS + cur] = uid
        break
    finally:
      fcntl.flock(self.q._lockfd, fcntl.LOCK_UN)
    self._reset()

  def _reset(self) -> None:
    h = self.q.h
    h[_READ_VALIDS + self.reader_id] = 1
    h[_READ_POINTERS + self.reader_id] = h[_WRITE_POINTER]

  def _check_slot(self) -> None:
    h = self.q.h
    if h[_READ_UIDS + self.reader_id] != self.uid:
      self._register()   # evicted, or a new publisher cleared the slots
    if not h[_READ_VALIDS + self.reader_id]:
      self._reset()      # the writer lapped us: drop the backlog

  def _usable(self) -> bool:
    if not self.q.shrunk():
      self._size_warned = False
      return True
    if not self._size_warned:
      log.error("%s; not reading until it is fixed", self.q.size_error())
      self._size_warned = True
    return False

  def publisher(self) -> int:
    """The uid of the endpoint's current publisher (0: none yet). A new publisher clears every reader slot, and a reader
    re-registers at the newest message when it next looks, so what was sent in between is not read (msgq's semantics)."""
    return int(self.q.h[_WRITE_UID])

  def ready(self) -> bool:
    if not self._usable():
      return False
    self._check_slot()
    h = self.q.h
    return (h[_READ_POINTERS + self.reader_id] & 0xFFFFFFFF) != (h[_WRITE_POINTER] & 0xFFFFFFFF)

  def _recv_now(self) -> bytes | None:
    q, h = self.q, self.q.h
    if not self._usable():
      return None
    for _ in range(1 << 20):
      self._check_slot()
      rid = self.reader_id
      rc, rp = _split(h[_READ_POINTERS + rid])
      wp = h[_WRITE_POINTER] & 0xFFFFFFFF
      if rp == wp or wp % 8 or wp >= q.size:
        return None    # nothing new, or a header no writer could have made (the writer repairs it on its next send)
      if rp % 8 or rp >= q.size:
        self.corrupt += 1
        log.warning("msgq '%s': read pointer %d is outside the ring; resyncing", q.name, rp)
        self._reset()
        continue
      _fence()
      size = q.w[rp // 8]
      if not h[_READ_VALIDS + rid]:
        continue
      if size == _WRAP:
        h[_READ_POINTERS + rid] = _pack(rc + 1, 0)
        continue
      if size <= 0 or size >= q.size or rp + 8 + size > q.size:
        # msgq asserts here; a service must not die, so drop everything pending and say so once per burst
        self.corrupt += 1
        log.warning("msgq '%s': corrupt length tag %d at offset %d; skipping to the newest data", q.name, size, rp)
        self._reset()
        return None
      new_rp = _align8(rp + 8 + size)
      if self.conflate and new_rp != wp:
        h[_READ_POINTERS + rid] = _pack(rc, new_rp)
        continue
      _fence()
      data = bytes(q.b[rp + 8:rp + 8 + size])
      _fence()
      h[_READ_POINTERS + rid] = _pack(rc, new_rp)
      if not h[_READ_VALIDS + rid]:
        self._reset()   # overwritten while we copied
        continue
      return data
    raise IpcError(f"msgq '{q.name}': reader could not catch up with the writer")

  def receive(self, non_blocking: bool = False) -> bytes | None:
    data = self._recv_now()
    if data is not None or non_blocking:
      return data
    deadline = None if self.timeout < 0 else time.monotonic() + self.timeout / 1000
    while True:
      remaining = _POLL_SLICE if deadline is None else deadline - time.monotonic()
      if remaining <= 0:
        return None
      if _wait_for(self.ready, remaining):
        data = self._recv_now()
        if data is not None:
          return data

  def close(self) -> None:
    self.q.close()


# tkill targets the thread that registered the reader; polling from another thread still works, a slice later
_POLL_SLICE = 0.02


def _wait_for(check, seconds: float) -> bool:
  """check(), and if false sleep until SIGUSR2 (or seconds, at most one slice), then check() again.

  SIGUSR2 is blocked only while we wait, so it queues for sigtimedwait instead of being lost between check and sleep,
  and children we fork or exec never inherit a blocked SIGUSR2 (a C++ msgq reader would then never wake)."""
  old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
  try:
    if check():
      return True
    signal.sigtimedwait({signal.SIGUSR2}, min(seconds, _POLL_SLICE))
  finally:
    if signal.SIGUSR2 not in old:
      signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
  return check()


def poll(socks: Iterable[SubSocket], timeout_ms: int) -> list[SubSocket]:
  """Sockets with a message ready, waiting up to timeout_ms (-1: forever) for the first one."""
  socks = list(socks)
  ready: list[SubSocket] = []

  def check() -> bool:
    ready[:] = [s for s in socks if s.ready()]
    return bool(ready)

  if check() or timeout_ms == 0:
    return ready
  deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
  while True:
    remaining = _POLL_SLICE if deadline is None else deadline - time.monotonic()
    if remaining <= 0 or _wait_for(check, remaining):
      return ready


class Poller:
  def __init__(self) -> None:
    self.socks: list[SubSocket] = []

  def registerSocket(self, sock: SubSocket) -> None:
    self.socks.append(sock)

  register = registerSocket

  def poll(self, timeout_ms: int) -> list[SubSocket]:
    return poll(self.socks, timeout_ms)


def header(name: str, size: int | None = None) -> dict:
  """Decoded header of an endpoint, for debugging and tests. size must be the one its users open it with."""
  q = Queue(name, size)
  try:
    h = q.h
    return {"num_readers": h[_NUM_READERS], "write_pointer": _split(h[_WRITE_POINTER]), "write_uid": h[_WRITE_UID],
            "read_pointers": [_split(h[_READ_POINTERS + i]) for i in range(NUM_READERS)],
            "read_valids": [h[_READ_VALIDS + i] for i in range(NUM_READERS)],
            "read_uids": [h[_READ_UIDS + i] for i in range(NUM_READERS)]}
  finally:
    q.close()

