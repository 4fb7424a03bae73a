"""Run a CPU kernel's THREAD parts on all cores at once.

tinygrad 0.14 splits big CPU kernels into `core_id` parts (its THREAD opt, NUM_CPU_THREADS of them), but its CPU runtime
calls the parts one after another on the calling thread (`CPUProgram.__call__`), so a 2-core machine computes on one.
Here the parts run concurrently: part 0 on the caller, the others on persistent worker threads. The parts write disjoint
slices of the output (that is what the THREAD opt guarantees), so the result is the same bytes as the serial loop; only
the wall time changes. ctypes drops the GIL for the duration of each foreign call, so Python threads are enough.

Installed through tinygrad's own seam: a Compiled device's `runtime_t` is the Program class it builds kernels with.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import time
from typing import Any

from artifact.cpu_pool_native import MAX_ARGS, MAX_PARTS

_pool: _Pool | None = None
# how a split kernel's parts run: "parallel", "serial", or "auto" (each kernel measures both ways on its first calls and
# keeps the faster; measured no better than parallel, run-to-run noise being larger than the gain: docs/performance-cpu.md §3);
# MODELD_CPU_PARTS, for A/B runs
_MODE = os.environ.get("MODELD_CPU_PARTS", "parallel")
if _MODE not in ("auto", "parallel", "serial"):
  raise ValueError(f"MODELD_CPU_PARTS={_MODE!r}: use auto, parallel or serial")


# worker i stays on its own core (the (i+1)-th the process may use): left to the scheduler, a woken worker can land on
# the core of the thread that woke it, which then runs both parts in turn (unpinned steps are slower and vary more:
# docs/performance-cpu.md §3); MODELD_CPU_PIN=0 leaves placement to the scheduler. The caller
# is never pinned.
_PIN = os.environ.get("MODELD_CPU_PIN", "1") != "0"


class _Pool:
  """n-1 daemon workers; `run(fxn, parts)` spreads a kernel's parts over the caller and the workers, and returns when all are done.

  The hand-off is artifact/cpu_pool_native.py's spinning one where it builds (MODELD_CPU_POOL=python: semaphores, as
  before); either way the parts and their order are the same."""

  def __init__(self, n: int, native: bool | None = None):
    """native: the C hand-off (False: semaphores; None: as MODELD_CPU_POOL says)."""
    self.n = n
    self._go = [threading.Semaphore(0) for _ in range(n - 1)]
    self._done = threading.Semaphore(0)
    self._work: list[Any] = [None] * (n - 1)
    self._errors: list[BaseException] = []
    self._lock = threading.Lock()   # one kernel at a time: two Python threads launching kernels would share the workers
    self.launches = 0               # kernels run split (tests and benchmarks read it)
    self._cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    self.native: Any
    self.native, self.native_why = _native(n) if native is not False else (None, "semaphores (asked for)")
    self.threads = [threading.Thread(target=self._worker, args=(i,), name=f"modeld-cpu-{i + 1}", daemon=True) for i in range(n - 1)]
    for t in self.threads:
      t.start()

  def _worker(self, i: int) -> None:
    _spread(self.n)
    if _PIN and len(self._cores) >= self.n:
      os.sched_setaffinity(0, {self._cores[i + 1]})
    if self.native is not None:   # the rest of this thread's life is in C, without the GIL
      lib, lanes, size = self.native
      lib.modeld_pool_worker(ctypes.addressof(lanes) + (i + 1) * size)
      return
    while True:
      self._go[i].acquire()
      fxn, mine = self._work[i]
      try:
        for args in mine:
          fxn(*args)
      except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
        self._errors.append(e)
      finally:
        self._done.release()

  def run_split(self, addr: int, fxn, parts: list[list[int]]) -> None:
    """Run the parts (each a list of integer arguments) of the kernel at `addr`, `fxn` its ctypes function: through the
    C hand-off where this pool has it, else through the semaphores. The workers of a C pool take no Python work, so a
    kernel its lanes cannot carry (over MAX_ARGS arguments, over MAX_PARTS parts a lane) runs its parts one after
    another on the caller: slower, the same bytes."""
    if self.native is None:
      self.run(fxn, [_c_args(p) for p in parts])
    elif not self.run_native(addr, parts):
      for p in parts:
        fxn(*_c_args(p))

  def run_native(self, addr: int, parts: list[list[int]]) -> bool:
    """Run the parts of the kernel at `addr` (each a list of integer arguments) through the C hand-off; False (nothing
    run) where it is not available or the kernel does not fit it."""
    if self.native is None or len(parts[0]) > MAX_ARGS or len(parts) > MAX_PARTS * self.n:
      return False
    lib, lanes, _ = self.native
    flat = (ctypes.c_uint64 * (MAX_ARGS * len(parts)))()
    for p, args in enumerate(parts):
      for a, v in enumerate(args):
        flat[p * MAX_ARGS + a] = v
    with self._lock:
      self.launches += 1
      lib.modeld_pool_run(lanes, self.n, addr, flat, len(parts))
    return True

  def run(self, fxn, parts: list[list[ctypes.c_uint64]]) -> None:
    # part k goes to lane k % n (lane 0 is the caller): an artifact captured with more parts than this machine has cores
    # still runs, in rounds
    if self.native is not None:
      raise RuntimeError("this pool's workers run the C hand-off: use run_native")
    lanes = [parts[i::self.n] for i in range(min(self.n, len(parts)))]
    with self._lock:
      self.launches += 1
      for i, mine in enumerate(lanes[1:]):
        self._work[i] = (fxn, mine)
        self._go[i].release()
      try:
        for args in lanes[0]:
          fxn(*args)
      finally:   # the workers' parts write into buffers the caller is about to hand on: never return before they finish
        for _ in lanes[1:]:
          self._done.acquire()
      if self._errors:
        raise self._errors.pop()


# how parts are handed to the workers: "native" (artifact/cpu_pool_native.py, where it builds) or "python" (semaphores)
_POOL = os.environ.get("MODELD_CPU_POOL", "native")
if _POOL not in ("native", "python"):
  raise ValueError(f"MODELD_CPU_POOL={_POOL!r}: use native or python")


def _native(n: int) -> tuple[Any, str]:
  """((library, lanes, lane size) or None, why) for a pool of n lanes."""
  if _POOL != "native":
    return None, "MODELD_CPU_POOL=python"
  try:
    from artifact import cpu_pool_native
    lib = cpu_pool_native.build()
  except (OSError, subprocess.CalledProcessError) as e:
    return None, f"the C hand-off did not build here ({e}); semaphores"
  size = int(lib.modeld_pool_lane_size())
  lanes = (ctypes.c_char * (size * n))()   # zeroed: every counter starts at 0
  return (lib, lanes, size), "C hand-off (spin, then futex)"


def _c_args(args: list[int]) -> list[ctypes.c_uint64]:
  """A part's arguments as ctypes passes them to a kernel: every one a 64-bit integer."""
  return [ctypes.c_uint64(x) for x in args]


def _spread(n: int) -> None:
  """A worker born in a process pinned to fewer cores than there are parts (modeld pins itself to one core, like openpilot's
  realtime processes) moves itself to the other cores: on the caller's core it would only take turns with it."""
  try:
    mine = os.sched_getaffinity(0)
    if len(mine) < n and (others := set(range(os.cpu_count() or 1)) - mine):
      os.sched_setaffinity(0, others)   # pid 0 from a thread: this thread only
  except (AttributeError, OSError):   # no affinity API, or not allowed: run where we were put
    pass


def _program_class():
  from tinygrad.runtime.ops_cpu import CPUProgram

  class ThreadedCPUProgram(CPUProgram):
    # With MODELD_CPU_PARTS=auto each program tries both ways on its first calls and keeps the faster (a kernel bound by
    # memory bandwidth, shared by the cores, or too short for the hand-off gains nothing from a second core). Either way
    # the parts write the same bytes, so the choice changes time only.
    TRIALS = 4   # per way, after one call that only warms the caches

    def __call__(self, *bufs, global_size=(1, 1, 1), local_size=(1, 1, 1), vals=(), wait=False, timeout=None):
      if 'core_id' not in self.runtimevars or global_size[0] <= 1 or self.lvp or _pool is None:
        return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait, timeout=timeout)
      st = time.perf_counter()
      args: list[Any] = [int(b.va_addr) for b in bufs] + list(vals)   # the core_id slot holds None until set per part
      slot = self.runtimevars['core_id']
      parts = []
      for tid in range(global_size[0]):
        args[slot] = tid
        parts.append(list(args))
      trials: list[float] = self.__dict__.setdefault("_trials", [])
      parallel = self.__dict__.get("_parallel", _MODE == "parallel" if _MODE != "auto" else None)
      if parallel is None:   # after the warm-up call, odd calls in parallel, even calls one part after another
        parallel = len(trials) % 2 == 1
      if parallel:
        _pool.run_split(self.addr, self.fxn, parts)
      else:
        for p in parts:
          self.fxn(*_c_args(p))
      took = time.perf_counter() - st
      if _MODE == "auto" and "_parallel" not in self.__dict__:
        trials.append(took)
        if len(trials) == 2 * self.TRIALS + 1:
          self._parallel = min(trials[1::2]) <= min(trials[2::2])
      return took if wait else None

  return ThreadedCPUProgram


def mode() -> str:
  """How split kernels' parts run in this process (MODELD_CPU_PARTS): parallel, serial or auto."""
  return _MODE


def count() -> int:
  """How many parts tinygrad splits a big CPU kernel into here (its NUM_CPU_THREADS: the cores, unless set)."""
  from tinygrad.helpers import NUM_CPU_THREADS
  return max(1, int(NUM_CPU_THREADS.value))


def install(device: str = "CPU") -> int:
  """Make `device` (a tinygrad CPU device) run THREAD parts concurrently; returns the thread count. Idempotent.

  Call before the first kernel is compiled on it: programs already built keep the serial runtime."""
  global _pool
  from tinygrad import Device
  n = count()
  if _pool is None and n > 1:
    _pool = _Pool(n)
  dev = Device[device]
  cls = _program_class() if n > 1 else None
  if cls is not None and not getattr(dev.runtime_t, "_modeld_threaded", False):
    cls._modeld_threaded = True  # type: ignore[attr-defined]
    dev.runtime_t = cls
  return n
