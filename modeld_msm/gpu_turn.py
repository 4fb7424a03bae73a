"""Whose turn on the GPU: modeld (the lead) marks its frame's GPU work in flight on a page both model processes map, and
dmonitoringmodeld (the follower) holds its next chunk back while that mark is up, so the driving model keeps its own
time on the shared a630 (one ring, no preemption: a DM chunk in the ring delays modeld's by its length).

The follower never trusts the page blindly; every wait is bounded:
  - per chunk (`chunk_wait_ms`) and per follower frame (`frame_wait_ms`): the DM still makes its own 20 Hz;
  - by time: a mark older than the lead's own promise (`hold_until`) or than `stale_ms` is stale (a hung or stuck lead,
    a flag left set, a sequence number that does not advance), and so is a mark whose process is gone (killed mid-frame);
  - a stale mark is skipped for the rest of its sequence number, so a stuck lead costs the follower one bounded wait.
The lead never waits on anything here: nothing the follower does can slow modeld.

The page (one 4 KiB file, by default beside the msgq segments) holds, little-endian:
  0 magic b"GPUT" | 4 u32 version | 8 u32 seq (odd: the lead's GPU work in flight; the futex word) | 12 u32 lead pid
  16 i64 begin_ns | 24 i64 hold_until_ns (CLOCK_MONOTONIC, system-wide) | 32 u64 marks taken down
The lead writes pid and times before it makes seq odd; a reader that sees a torn update takes the mark as stale and
goes on (one chunk not held back), never as a reason to wait longer. Waits are futex waits on seq (woken by the lead's
end) in slices of POLL_MS, so a lead killed mid-wait is noticed within one slice.

MODELD_GPU_YIELD=0 turns it off in both processes; MODELD_GPU_YIELD_PATH moves the page.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import platform
import struct
import time
from collections import Counter
from collections.abc import Iterator

from backend import chunking
from selfdrive_glue.msgq import shm_path

ENV_SWITCH = "MODELD_GPU_YIELD"
ENV_PATH = "MODELD_GPU_YIELD_PATH"
PAGE_NAME = "modeld_gpu_turn"
MAGIC, VERSION = b"GPUT", 1
PAGE_BYTES = 4096
_HEAD = struct.Struct("<4sII")     # magic, version, seq
_BODY = struct.Struct("<IqqQ")     # pid, begin_ns, hold_until_ns, marks taken down (at offset 12)
SEQ_OFF, BODY_OFF = 8, 12
# the lead's promise per frame: modeld's frame is due within its 50 ms period; a longer one is not waited for
LEAD_HOLD_MS = 40.0
# the follower's bounds: one modeld frame per chunk; per DM frame no more than leaves its own ~20 ms inside 50 ms
CHUNK_WAIT_MS = 40.0
FRAME_WAIT_MS = 28.0
# the follower gives the kernel one chunk at a time (MSM_INFLIGHT, unless set): a chunk already in the ring when modeld's
# frame starts cannot be called back, so a second one queued behind it would delay modeld by a chunk more
FOLLOWER_INFLIGHT = 1
STALE_MS = 100.0   # whatever the lead promised, a mark this old is stale (two modeld periods)
POLL_MS = 5.0
log = logging.getLogger(__name__)

_FUTEX_NR = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
  _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)


def _futex_wait(addr: int, expected: int, timeout_ns: int) -> None:
  """Sleep while the u32 at addr holds expected, at most timeout_ns (a shared, not private, futex: two processes)."""
  if _FUTEX_NR is None:
    time.sleep(timeout_ns / 1e9)
    return
  ts = _Timespec(*divmod(max(timeout_ns, 0), 1_000_000_000))
  _libc.syscall(_FUTEX_NR, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
  if _FUTEX_NR is not None:
    _libc.syscall(_FUTEX_NR, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7fffffff, None, None, 0)


def now_ns() -> int:
  return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def enabled() -> bool:
  return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def default_path() -> str:
  return os.environ.get(ENV_PATH) or shm_path(PAGE_NAME)


def _alive(pid: int) -> bool:
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass   # someone else's process by that id: alive
  return True


class Page:
  """The mapped page. Either process may create it; a file that is not ours is refused (ValueError), never rewritten."""

  def __init__(self, path: str):
    self.path = path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
      size = os.fstat(fd).st_size
      if size not in (0, PAGE_BYTES):
        raise ValueError(f"{path}: {size} bytes, not a {PAGE_BYTES}-byte GPU turn page")
      if size == 0:
        os.ftruncate(fd, PAGE_BYTES)
      self.mm = mmap.mmap(fd, PAGE_BYTES)
    finally:
      os.close(fd)
    magic, version, _ = _HEAD.unpack_from(self.mm, 0)
    if magic == b"\0\0\0\0":
      self.mm[0:8] = MAGIC + struct.pack("<I", VERSION)
    elif (magic, version) != (MAGIC, VERSION):
      self.mm.close()
      raise ValueError(f"{path}: not a GPU turn page of version {VERSION} (magic {magic!r}, version {version})")
    self._seq = ctypes.c_uint32.from_buffer(self.mm, SEQ_OFF)
    self.seq_addr = ctypes.addressof(self._seq)

  @property
  def seq(self) -> int:
    return self._seq.value

  def body(self) -> tuple[int, int, int, int]:
    return _BODY.unpack_from(self.mm, BODY_OFF)

  def close(self) -> None:
    del self._seq
    self.mm.close()


class Lead:
  """modeld's side: `with lead.frame(): ...` around each frame; within it, the mark goes up at the frame's first chunk
  submitted (`on_submit`) and down once its chunks have all retired (`on_idle`) or the frame ends, whichever comes first,
  waking the follower. Outside a frame (start-up, warm-up) nothing is marked."""

  def __init__(self, page: Page, hold_ms: float = LEAD_HOLD_MS):
    self.page, self.hold_ns = page, int(hold_ms * 1e6)
    self.stats: Counter[str] = Counter()
    self.armed = False
    if page.seq & 1:   # a lead before us died mid-frame: take its mark down
      self._bump()

  def _bump(self) -> None:
    self.page._seq.value = (self.page.seq + 1) & 0xffffffff
    _futex_wake(self.page.seq_addr)

  def begin(self) -> None:
    if self.page.seq & 1:
      return
    t = now_ns()
    marks = self.page.body()[3]
    _BODY.pack_into(self.page.mm, BODY_OFF, os.getpid(), t, t + self.hold_ns, marks)
    self._bump()

  def end(self) -> None:
    if not self.page.seq & 1:
      return
    pid, begin, hold, marks = self.page.body()
    _BODY.pack_into(self.page.mm, BODY_OFF, pid, begin, hold, marks + 1)
    self._bump()
    self.stats["marks"] += 1

  def on_submit(self) -> None:
    if self.armed:
      self.begin()

  def on_idle(self) -> None:
    if self.armed:
      self.end()

  @contextlib.contextmanager
  def frame(self) -> Iterator[None]:
    self.armed = True
    try:
      yield
    finally:
      self.armed = False
      self.end()


class Follower:
  """dmonitoringmodeld's side: `frame()` around each of its frames, `wait_turn()` before each chunk it submits."""

  def __init__(self, page: Page, chunk_wait_ms: float = CHUNK_WAIT_MS, frame_wait_ms: float = FRAME_WAIT_MS, stale_ms: float = STALE_MS,
               poll_ms: float = POLL_MS):
    self.page = page
    self.chunk_ns, self.frame_ns, self.stale_ns, self.poll_ns = (int(x * 1e6) for x in (chunk_wait_ms, frame_wait_ms, stale_ms, poll_ms))
    self.frame_left_ns = self.frame_ns
    self.skip_seq: int | None = None   # a stale mark: not waited for again
    self.stats: Counter[str] = Counter()
    self.last = ""   # why the last wait ended: free, turn, dead, stale, chunk bound, frame bound (for logs and tests)

  @contextlib.contextmanager
  def frame(self) -> Iterator[None]:
    self.frame_left_ns = self.frame_ns
    yield

  def _stale(self, seq: int, t: int) -> str:
    pid, begin, hold, _ = self.page.body()
    if not _alive(pid):
      return "dead"
    if t >= hold or t - begin >= self.stale_ns or begin > t:
      return "stale"
    return ""

  def wait_turn(self) -> str:
    """Returns once the lead has no frame in flight or a bound is reached; why, as `last`. Never raises."""
    try:
      self.last = self._wait()
    except (OSError, ValueError) as e:   # a closed or broken page: go on without yielding, say so once
      if not self.stats["errors"]:
        log.warning("GPU turn page %s unusable (%s); not yielding", self.page.path, e)
      self.stats["errors"] += 1
      self.last = "error"
    self.stats[self.last] += 1
    return self.last

  def _wait(self) -> str:
    t0 = t = now_ns()
    why = "free"
    while (seq := self.page.seq) & 1 and seq != self.skip_seq:
      if self.frame_left_ns - (t - t0) <= 0:
        why = "frame bound"
        break
      if t - t0 >= self.chunk_ns:
        why = "chunk bound"
        break
      if stale := self._stale(seq, t):
        self.skip_seq, why = seq, stale
        break
      until = min(t0 + self.chunk_ns, t0 + self.frame_left_ns, t + self.poll_ns)
      _futex_wait(self.page.seq_addr, seq, until - t)
      t = now_ns()
      why = "turn"
    waited = t - t0
    self.frame_left_ns -= waited
    self.stats["waited_us"] += waited // 1000
    return why


class Off:
  """The switch turned off, or no page: frames go unmarked and chunks unheld."""

  def __init__(self) -> None:
    self.stats: Counter[str] = Counter()

  @contextlib.contextmanager
  def frame(self) -> Iterator[None]:
    yield


def for_role(role: str, path: str | None = None) -> Lead | Follower | Off:
  """The GPU turn of a model process: role "lead" (modeld), "follow" (dmonitoringmodeld) or "" (neither).
  A page that cannot be made or is not ours leaves the process running without it (one warning)."""
  if not role or not enabled():
    return Off()
  p = path or default_path()
  try:
    page = Page(p)
  except (OSError, ValueError) as e:
    log.warning("GPU turn page %s: %s; running without yielding", p, getattr(e, "strerror", None) or e)
    return Off()
  if role == "lead":
    return Lead(page)
  if role == "follow":
    return Follower(page)
  raise ValueError(f"GPU turn role {role!r} is not lead, follow or empty")


def serve_turn(role: str) -> Lead | Follower | Off:
  """for_role() for the serving process, before its device opens: a follower's wait is installed before every chunk its
  GPU submits, and it submits FOLLOWER_INFLIGHT chunks at a time unless MSM_INFLIGHT says otherwise."""
  turn = for_role(role)
  chunking.set_submit_gate(turn.wait_turn if isinstance(turn, Follower) else turn.on_submit if isinstance(turn, Lead) else None)
  chunking.set_idle_hook(turn.on_idle if isinstance(turn, Lead) else None)
  if isinstance(turn, Follower):
    os.environ.setdefault("MSM_INFLIGHT", str(FOLLOWER_INFLIGHT))
  if not isinstance(turn, Off):
    log.info("GPU turn: %s on %s", role, turn.page.path)
  return turn
