"""An emulated msm render node (level A): the MSM interface opens it like /dev/dri/renderD128.

GEM objects are memfds (every CPU mapping aliases), IOVAs come from a separate window reserved PROT_NONE, every submit is
validated like the kernel does, and the PM4 runs on an emulated single ring when a wait or query asks for progress
(deterministic, no thread; it also covers HCQGraph writing its kick value after the submit).
"""
from __future__ import annotations

import collections
import ctypes
import errno
import gc
import itertools
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tinygrad.runtime.autogen import libc
from tinygrad.runtime.support.hcq import FileIOInterface

from backend import uapi as u
from backend.emu import dmabuf, pm4
from backend.emu.executor import Dispatch, ExecState, Executor, Frame, GpuFault, PageFault, always_on_counter
from backend.emu.iova import PAGE, IovaWindow
from backend.emu.ir3.execute import Counts, run_dispatch
from backend.emu.vm import UserVM
from backend.intervals import IntervalIndex

_FAILED = 0xffffffffffffffff
_UNEMULATED_SUBMIT_FLAGS = (u.MSM_SUBMIT_FENCE_FD_IN | u.MSM_SUBMIT_FENCE_FD_OUT | u.MSM_SUBMIT_SYNCOBJ_IN | u.MSM_SUBMIT_SYNCOBJ_OUT
                            | u.MSM_SUBMIT_FENCE_SN_IN)
_CACHE_MODES = (u.MSM_BO_WC, u.MSM_BO_CACHED, u.MSM_BO_CACHED_COHERENT, u.MSM_BO_UNCACHED)
# GEM_INFO queries whose `len` means something; for every other one the kernel wants len == 0
_INFO_WITH_LEN = (u.MSM_INFO_SET_NAME, u.MSM_INFO_GET_NAME)
# fence ids come from a per-queue cyclic allocator over 1..INT_MAX (msm-kernel-rules.md), not from a 32-bit counter
FENCE_ID_MAX = 0x7fffffff
# the CP's IB size field: the kernel writes the dword count unchecked and the hardware keeps the low 20 bits
_IB_DWORDS_MASK = (1 << 20) - 1
# page faults the kernel policy prints to stderr (its dmesg): the first few, then one in so many, as the kernel rate-limits them
_DMESG_FIRST, _DMESG_EVERY = 5, 1000


def _fence_newer(a: int, b: int) -> bool:
  """Whether id a was allocated after id b on one queue, across the allocator's wrap (ids stay within half a cycle)."""
  return 0 < (a - b) % (FENCE_ID_MAX + 1) < (FENCE_ID_MAX + 1) // 2


def _err(code: int, detail: str) -> OSError:
  return OSError(code, f"{os.strerror(code)}: {detail}")


def _round_page(n: int) -> int:
  return (n + PAGE - 1) & ~(PAGE - 1)


@dataclass(eq=False)
class GemObject:
  handle: int
  size: int
  flags: int
  memfd: int
  mmap_offset: int
  host: int                  # the emulator's own mapping (what the "GPU" reads and writes)
  iova: int = 0
  open: bool = True
  pins: int = 0              # pending jobs that list it
  maps: int = 0              # VM_BIND mapping pieces that map it (each holds a reference, like a drm_gpuvm_bo)
  imported: tuple[int, int] | None = None   # (st_dev, st_ino) of the dma-buf it was imported from: the exporter's memory


@dataclass(eq=False)
class SubmitQueue:
  id: int
  prio: int
  flags: int = 0
  last_fence: int = 0
  retired: int = 0
  faults: int = 0
  live: set[int] = field(default_factory=set)   # submitted, not yet retired: the kernel's fence idr

  def next_fence(self) -> int:
    self.last_fence = self.last_fence % FENCE_ID_MAX + 1
    return self.last_fence


@dataclass(eq=False)
class Job:
  queue: SubmitQueue
  fence: int
  bos: list[GemObject]
  state: ExecState
  listed: frozenset = frozenset()
  ready_ns: int = 0          # CLOCK_MONOTONIC ns before which the job cannot retire (delay_jobs: a slow GPU job); 0: no delay
  writes: frozenset = frozenset()   # handles listed with MSM_SUBMIT_BO_WRITE: the job's fence is their write fence


@dataclass(frozen=True)
class SubmitRecord:
  queue: int
  fence: int
  handles: tuple[int, ...]
  bo_flags: tuple[int, ...]
  cmds: tuple[tuple[int, int, int], ...]    # (handle, offset, size in bytes)


@dataclass
class Injected:
  code: int
  count: int = 1


@dataclass
class Stats:
  submits: int = 0
  dispatches: int = 0
  faults: list[str] = field(default_factory=list)     # every fault the node saw, reported or not (the newest `keep`)
  reported: list[str] = field(default_factory=list)   # those counted in the queue's FAULTS (hangs; page faults too when strict)
  page_faults: int = 0                                # page faults let through under the kernel policy, all of them
  order_hazards: list[str] = field(default_factory=list)   # level B: dispatches racing an unfinished one (the newest `keep`)
  keep: int = 1000


class _JobMemory:
  """GPU memory as one job sees it: unmapped addresses fault; in strict mode so does any BO not listed in the job's submit."""

  def __init__(self, node: RenderNode, job: Job):
    self.node, self.job = node, job

  def _find(self, iova: int, size: int, what: str) -> tuple[GemObject, int]:
    if self.node.vm_bind:
      return self._find_bound(iova, size, what)
    hit = self.node._by_iova.find(iova)
    if hit is None:
      old = self.node._closed.find(iova)
      raise PageFault(f"{what} at {iova:#x} hits " + (f"freed BO (was handle {old[2]})" if old else "no mapped BO") + " (SMMU fault)")
    start, _, gem = hit
    if iova + size > start + gem.size:
      raise PageFault(f"{what} at {iova:#x}+{size:#x} runs past the end of BO handle {gem.handle}")
    if self.node.strict and gem not in self.job.listed:
      raise PageFault(f"strict: {what} at {iova:#x} lies in BO handle {gem.handle}, which is not listed in this submit")
    return gem, iova - start

  def _find_bound(self, iova: int, size: int, what: str) -> tuple[GemObject, int]:
    """VM_BIND: the job sees every page the VM maps (the kernel validates the whole VM at submit, not a BO table), and
    nothing else; the offset returned is into the BO, through the mapping's obj_offset."""
    hit = self.node.user_vm.find(iova)
    if hit is None:
      raise PageFault(f"{what} at {iova:#x} hits no VM_BIND mapping (SMMU translation fault)")
    start, n, m = hit
    if iova + size > start + n:
      raise PageFault(f"{what} at {iova:#x}+{size:#x} runs past the end of the mapping at {start:#x}+{n:#x}")
    return m.gem, m.obj_offset + (iova - start)

  def check(self, iova: int, size: int, what: str) -> None:
    self._find(iova, size, what)

  def region(self, iova: int, what: str) -> tuple[int, int, int]:
    if self.node.vm_bind:
      hit = self.node.user_vm.find(iova)
      if hit is None:
        raise PageFault(f"{what} at {iova:#x} hits no VM_BIND mapping (SMMU translation fault)")
      start, n, m = hit
      return start, n, m.gem.host + m.obj_offset
    gem, off = self._find(iova, 1, what)
    return iova - off, gem.size, gem.host

  def view(self, iova: int, size: int, what: str) -> memoryview:
    gem, off = self._find(iova, size, what)
    return memoryview((ctypes.c_ubyte * size).from_address(gem.host + off)).cast("B")

  def pointers(self, data: bytes, what: str) -> None:
    """Strict: a qword in the constants that points into a live BO must name a listed one; one into a freed BO is a fault.
    VM_BIND has no BO table to be listed in, and an unmapped address faults when it is used, so nothing to scan for."""
    if self.node.vm_bind:
      return
    for (v,) in struct.iter_unpack("<Q", data[:len(data) & ~7]):
      if not (self.node.window.start <= v < self.node.window.start + self.node.window.size):
        continue
      if (hit := self.node._by_iova.find(v)) is not None:
        if hit[2] not in self.job.listed:
          raise PageFault(f"strict: pointer {v:#x} in the {what} lies in BO handle {hit[2].handle}, which is not listed in this submit")
      elif (old := self.node._closed.find(v)) is not None:
        raise PageFault(f"strict: pointer {v:#x} in the {what} lies in freed BO (was handle {old[2]})")


class RenderNode(FileIOInterface):
  """The file object the MSM interface talks to. Test hooks: inject(), inject_gpu_fault(), live_handles, submits, dispatches, stats.

  execute=True is level B: every dispatch's IR3 code runs (backend/emu/ir3) against the job's memory; `counts` keeps
  the dynamic work of recent dispatches and `kernel_names` (shader IOVA -> name, filled by the QCOM program) names them."""

  def __init__(self, strict: bool = True, va_start: int = 0x1_0000_0000, va_size: int = 1 << 32, version: tuple[int, int, int] = (1, 12, 0),
               chip_id: int = u.ADRENO_630_CHIP_ID, priorities: int = 3, history: int = 256, execute: bool = False, first_fence: int = 1,
               per_process_pgtables: bool = True, fault_policy: str | None = None, mem_limit: int | None = None,
               vm_bind_supported: bool | None = None):
    """first_fence: the id each queue's fence allocator hands out first (tests start it near the wrap). per_process_pgtables=False
    is a kernel/IOMMU without them: VA_START/VA_SIZE are EINVAL and SET_IOVA is EOPNOTSUPP.
    fault_policy "kernel" (default) does what msm does: a page fault that does not hang the GPU is logged (stats.faults) and
    the job retires as if fine, with no FAULTS count; "strict" counts it like a hang, for tests that must see it
    (default from env EMU_STRICT_FAULTS=1). Injected faults, faults on the CP's own fetches (commands, IBs, wait addresses) and
    faults the emulator cannot run past (bad packets, unimplemented instructions) are hangs either way.
    mem_limit: bytes of BO memory this node may hold (default from env EMU_MEM_LIMIT_MB; None: no limit); GEM_NEW past it is
    ENOMEM, as the kernel's shmem accounting refuses a BO when memory is short. Settable at run time (`mem_limit`).
    vm_bind_supported: the node is a 6.17+ kernel (msm 1.13) that accepts SET_PARAM(EN_VM_BIND) before the file's VM exists
    (default from env EMU_VM_BIND=1; otherwise an older kernel that refuses the param, as 6.16 and before do)."""
    fault_policy = fault_policy or ("strict" if os.environ.get("EMU_STRICT_FAULTS", "0") not in ("", "0") else "kernel")
    if fault_policy not in ("kernel", "strict"):
      raise ValueError(f"fault_policy must be 'kernel' or 'strict', not {fault_policy!r}")
    self.fault_policy = fault_policy
    if mem_limit is None and (env := os.environ.get("EMU_MEM_LIMIT_MB", "")):
      try:
        mem_limit = int(float(env) * (1 << 20))
      except ValueError:
        raise ValueError(f"EMU_MEM_LIMIT_MB must be a number of MiB, not {env!r}") from None
    if mem_limit is not None and mem_limit < 0:
      raise ValueError(f"mem_limit must be >= 0 bytes, not {mem_limit}")
    self.mem_limit: int | None = mem_limit
    self.mem_used = 0   # bytes of BO backing held: open BOs and closed ones still pinned by unretired jobs
    self._job_delays: collections.deque[float] = collections.deque()   # delay_jobs(): seconds for each next submitted job
    self.path, self.strict, self.version, self.chip_id, self.priorities = "emu:/dev/dri/renderD128", strict, version, chip_id, priorities
    self.first_fence, self.per_process_pgtables = first_fence, per_process_pgtables
    if vm_bind_supported is None:
      vm_bind_supported = os.environ.get("EMU_VM_BIND", "0") not in ("", "0")
    self.vm_bind_supported = vm_bind_supported
    if vm_bind_supported and version < (1, 13, 0):
      self.version = (1, 13, 0)   # VM_BIND came with msm 1.13
    # the file's VM: made lazily by the first ioctl that needs it (any GET_PARAM among them); EN_VM_BIND only before that
    self.vm_created = self.vm_bind = self.vm_unusable = False
    self.user_vm = UserVM()
    self.has_prr = False   # a630's SMMU has no PRR, so MAP_NULL is refused
    self._ring_ctx = False   # whether the ring last ran this file's context (decides whether CTX_RESTORE_BUF commands run)
    # allocations start 3 GiB into a 4 GiB window so no pair of small integers in a constant buffer looks like a pointer
    self.window = IovaWindow(va_start, va_size, floor=(3 << 30) if va_size == 1 << 32 else 0)
    self._gems: dict[int, GemObject] = {}
    self._imports: dict[tuple[int, int], GemObject] = {}   # drm_prime's per-file cache: one object per imported dma-buf
    self._by_offset: dict[int, GemObject] = {}
    self._by_iova: IntervalIndex[GemObject] = IntervalIndex()
    self._closed: IntervalIndex[int] = IntervalIndex()   # IOVA ranges of released BOs, for "freed BO" diagnostics
    self._closed_order: collections.deque[int] = collections.deque()
    self._handles = itertools.count(1)
    self._next_offset = 0x100000000
    self._queues: dict[int, SubmitQueue] = {0: self._new_queue(0, 1)}   # queue 0 exists at open, at the middle priority
    self._queue_ids = itertools.count(1)
    self._ring: collections.deque[Job] = collections.deque()
    self._running = False
    self._injected: dict[str, Injected] = {}
    self._gpu_faults: list[str] = []
    self.executor = Executor(self._record_dispatch)
    self.executor.on_order_hazard = self._order_hazard
    self.set_execute(execute)
    self.kernel_names: dict[int, str] = {}
    self.executor.kernel_names = self.kernel_names
    self.tamper: Callable[[Dispatch], Dispatch] | None = None   # test hook: rewrites a dispatch (shader, descriptors) before it runs
    self.counts: collections.deque = collections.deque(maxlen=history)   # (kernel, ir3.execute.Counts) per executed dispatch
    self.exec_total = Counts()   # summed over every executed dispatch
    self.submits: collections.deque[SubmitRecord] = collections.deque(maxlen=history)
    self.dispatches: collections.deque[Dispatch] = collections.deque(maxlen=history)
    self.stats = Stats()
    self.on_dispatch: Callable[[Dispatch], None] | None = None   # where a later IR3 interpreter plugs in
    self._handlers: dict[int, Callable] = {
                      u.DRM_IOCTL_VERSION: self._version, u.DRM_IOCTL_MSM_GET_PARAM: self._get_param, u.DRM_IOCTL_MSM_GEM_NEW: self._gem_new,
                      u.DRM_IOCTL_MSM_GEM_INFO: self._gem_info, u.DRM_IOCTL_GEM_CLOSE: self._gem_close, u.DRM_IOCTL_MSM_GEM_SUBMIT: self._submit,
                      u.DRM_IOCTL_MSM_WAIT_FENCE: self._wait_fence, u.DRM_IOCTL_MSM_GEM_CPU_PREP: self._cpu_prep,
                      u.DRM_IOCTL_MSM_GEM_CPU_FINI: lambda a: None, u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW: self._queue_new,
                      u.DRM_IOCTL_MSM_SUBMITQUEUE_CLOSE: self._queue_close, u.DRM_IOCTL_MSM_SUBMITQUEUE_QUERY: self._queue_query,
                      u.DRM_IOCTL_MSM_GEM_MADVISE: self._madvise, u.DRM_IOCTL_PRIME_HANDLE_TO_FD: self._prime_to_fd,
                      u.DRM_IOCTL_PRIME_FD_TO_HANDLE: self._prime_to_handle, u.DRM_IOCTL_MSM_SET_PARAM: self._set_param,
                      u.DRM_IOCTL_MSM_VM_BIND: self._vm_bind}

  def __del__(self):
    self.close()

  def close(self) -> None:
    if not hasattr(self, "_gems"):
      return   # __init__ refused its arguments before allocating anything (called again from __del__)
    mapped = self.user_vm.clear()   # BOs whose handle was closed live on only through their mappings: release those too
    for gem in list(self._gems.values()) + [g for j in self._ring for g in j.bos] + mapped:
      gem.open, gem.pins, gem.maps = False, 0, 0
      self._release(gem)
    self._gems.clear()
    self._ring.clear()
    if hasattr(self, "window"):
      self.window.close()

  # *** test hooks ***

  def inject(self, ioctl: str, code: int, count: int = 1) -> None:
    """The next `count` calls of ioctl (e.g. "GEM_NEW", "GEM_SUBMIT", "WAIT_FENCE") fail with errno `code`."""
    self._injected[ioctl] = Injected(code, count)

  def delay_jobs(self, seconds: float, count: int = 1) -> None:
    """The next `count` submitted jobs take `seconds` of GPU time before they can retire (a really slow job: a WAIT_FENCE with
    an earlier deadline times out for real). Their work runs when the time is up, in ring order, so jobs behind wait too."""
    if seconds < 0 or count < 1:
      raise ValueError(f"delay_jobs needs seconds >= 0 and count >= 1, not {seconds}, {count}")
    self._job_delays.extend([seconds] * count)

  def inject_gpu_fault(self, what: str = "injected SMMU fault") -> None:
    """The next job to run faults at once, none of its writes done (counted by SUBMITQUEUE_QUERY(FAULTS))."""
    self._gpu_faults.append(what)

  @property
  def live_handles(self) -> int:
    return len(self._gems)

  @property
  def pending_jobs(self) -> int:
    return len(self._ring)

  def gem(self, handle: int) -> GemObject:
    return self._gems[handle]

  # *** file interface ***

  def ioctl(self, request: int, arg):
    name = u.IOCTL_NAMES.get(request)
    if name is None or request not in self._handlers:
      raise _err(errno.ENOTTY, f"ioctl {request:#x} is not emulated")
    short = name.removeprefix("MSM_")
    if (inj := self._injected.get(short)) is not None and inj.count > 0:
      inj.count -= 1
      raise _err(inj.code, f"injected on {short}")
    if not (request >> 30) & u._IOC_READ:
      arg = type(arg).from_buffer_copy(arg)   # a write-only ioctl: the kernel copies nothing back, whatever its handler sets
    self._handlers[request](arg)
    return 0

  def mmap(self, start, sz, prot, flags, offset):
    if (gem := self._by_offset.get(offset)) is None or not gem.open:
      raise _err(errno.EINVAL, f"mmap offset {offset:#x} names no BO")
    if sz > _round_page(gem.size):
      raise _err(errno.EINVAL, f"mmap of {sz:#x} bytes exceeds BO handle {gem.handle} ({gem.size:#x})")
    addr = libc.mmap(start, sz, prot, flags, gem.memfd, 0)
    if addr == _FAILED:
      raise _err(ctypes.get_errno(), f"mmap of BO handle {gem.handle}")
    return addr

  # *** execution ***

  def _record_dispatch(self, d: Dispatch) -> None:
    self.stats.dispatches += 1
    self.dispatches.append(d)
    if self.on_dispatch is not None:
      self.on_dispatch(d)

  def set_execute(self, on: bool) -> None:
    """Level B on (execute the IR3 code of every dispatch) or off (level A: record only). Takes effect at the next dispatch."""
    self.execute = on
    self.executor.shader_exec = self._execute_dispatch if on else None

  def _execute_dispatch(self, d: Dispatch, mem) -> Counts:
    name = self.kernel_names.get(d.shader_iova, "")
    if self.tamper is not None:
      d = self.tamper(d)
    c = run_dispatch(d, mem, kernel=name)
    self.counts.append((name, c))
    self.exec_total.add(c)
    return c

  def _order_hazard(self, what: str) -> None:
    self.stats.order_hazards.append(what)
    del self.stats.order_hazards[:-self.stats.keep]

  def progress(self) -> None:
    """Runs the ring in order until it is empty or its head job parks on an unmet wait.

    The cyclic garbage collector is held off meanwhile: at level B a job runs long enough in Python for a collection to
    start, and a tinygrad buffer finalized inside it would wait on this very ring (re-entering it from inside a job)."""
    if self._running:
      return
    gc_on = gc.isenabled()
    gc.disable()
    self._running = True
    try:
      self._progress()
    finally:
      self._running = False
      if gc_on:
        gc.enable()

  def _progress(self) -> None:
    while self._ring:
      job = self._ring[0]
      if job.ready_ns and time.clock_gettime_ns(time.CLOCK_MONOTONIC) < job.ready_ns:
        return   # the GPU is still busy with it (delay_jobs)
      mem = _JobMemory(self, job)
      self.executor.pointer_check = mem.pointers if self.strict else None
      # kernel policy: msm's fault_worker logs a page fault and the GPU resumes (the executor abandons only the faulting
      # packet); only recover_worker, after a hang, bumps the count userspace reads. Strict: the fault ends the job, counted.
      self.executor.on_page_fault = (lambda e, job=job: self._log_page_fault(job, e)) if self.fault_policy == "kernel" else None
      fault = self._gpu_faults.pop(0) if self._gpu_faults else None   # an injected fault kills the job before it writes anything
      if fault is None:
        try:
          if not self.executor.run(job.state, mem):
            return
        except (GpuFault, pm4.PM4Error) as e:
          fault = str(e)
      if fault is not None:
        job.queue.faults += 1
        if self.vm_bind:
          self.vm_unusable = True   # recover_worker poisons a userspace-managed VM: every later SUBMIT/VM_BIND is EPIPE
        self.stats.faults.append(f"queue {job.queue.id} fence {job.fence}: {fault}")
        self.stats.reported.append(self.stats.faults[-1])
      self._ring.popleft()
      job.queue.retired = job.fence
      job.queue.live.discard(job.fence)
      for gem in job.bos:
        gem.pins -= 1
        if not gem.open and gem.pins == 0 and gem.maps == 0:
          self._release(gem)

  def _log_page_fault(self, job: Job, e: GpuFault) -> None:
    """The kernel's side of a page fault without a hang: a line in its log (dmesg, rate-limited there too), nothing in the UAPI."""
    self.stats.faults.append(f"queue {job.queue.id} fence {job.fence}: page fault, no hang (not reported): {e}")
    self.stats.page_faults += 1
    if len(self.stats.faults) > self.stats.keep:   # a fault every frame must not grow the log for hours
      del self.stats.faults[0]
    if self.stats.page_faults <= _DMESG_FIRST or self.stats.page_faults % _DMESG_EVERY == 0:
      print(f"[emu dmesg] *** gpu fault (#{self.stats.page_faults}, not counted in FAULTS): {str(e).splitlines()[0]}", file=sys.stderr)

  def _release(self, gem: GemObject) -> None:
    if gem.host:
      libc.munmap(gem.host, _round_page(gem.size))
      os.close(gem.memfd)
      gem.host = 0
      if gem.imported is None:
        self.mem_used -= gem.size
      else:
        self._imports.pop(gem.imported, None)
    if gem.iova:
      self._by_iova.remove(gem.iova)
      self.window.release(gem.iova, gem.size)
      self._closed.add(gem.iova, _round_page(gem.size), gem.handle)
      self._closed_order.append(gem.iova)
      if len(self._closed_order) > 4096:
        self._closed.remove(self._closed_order.popleft())
      gem.iova = 0
    self._by_offset.pop(gem.mmap_offset, None)

  def _assign_iova(self, gem: GemObject, iova: int = 0) -> None:
    if iova:
      self.window.take(iova, _round_page(gem.size))
    else:
      iova = self.window.alloc(gem.size)
    for addr in [a for a, _, _ in self._closed.items() if iova <= a < iova + gem.size]:
      self._closed.remove(addr)
    gem.iova = iova
    self._by_iova.add(iova, _round_page(gem.size), gem)

  def _lookup(self, handle: int, code: int = errno.EINVAL) -> GemObject:
    """A handle of this file: a submit's table and GEM_CLOSE refuse a bad one with EINVAL, object lookups (GEM_INFO, CPU_PREP) with ENOENT."""
    if (gem := self._gems.get(handle)) is None:
      raise _err(code, f"invalid GEM handle {handle}")
    return gem

  def _new_queue(self, qid: int, prio: int, flags: int = 0) -> SubmitQueue:
    return SubmitQueue(qid, prio, flags, last_fence=self.first_fence - 1 if self.first_fence > 1 else 0)

  # *** ioctls ***

  def _version(self, a: u.drm_version) -> None:
    a.version_major, a.version_minor, a.version_patchlevel = self.version
    for fld, text in (("name", b"msm"), ("date", b"20130625"), ("desc", b"MSM Snapdragon DRM (emulated)")):
      if (n := getattr(a, f"{fld}_len")) and getattr(a, fld):
        ctypes.memmove(getattr(a, fld), text, min(n, len(text)))
      setattr(a, f"{fld}_len", len(text))

  def _get_param(self, a: u.drm_msm_param) -> None:
    if a.pipe != u.MSM_PIPE_3D0 or a.pad:
      raise _err(errno.EINVAL, f"pipe {a.pipe:#x} pad {a.pad:#x}")
    self.vm_created = True   # adreno_get_param looks the context's VM up (making it) before it reads the param
    if a.len:
      raise _err(errno.EINVAL, f"len {a.len} on a value param")   # only the write-only string params (COMM, CMDLINE) take a length
    if a.param in (u.MSM_PARAM_VA_START, u.MSM_PARAM_VA_SIZE) and not self.per_process_pgtables:
      raise _err(errno.EINVAL, "no per-process page tables")
    values = {u.MSM_PARAM_GPU_ID: 630, u.MSM_PARAM_CHIP_ID: self.chip_id, u.MSM_PARAM_GMEM_SIZE: 1 << 20, u.MSM_PARAM_MAX_FREQ: 710_000_000,
              u.MSM_PARAM_TIMESTAMP: always_on_counter(), u.MSM_PARAM_GMEM_BASE: 0x100000, u.MSM_PARAM_PRIORITIES: self.priorities,
              u.MSM_PARAM_FAULTS: sum(q.faults for q in self._queues.values()), u.MSM_PARAM_SUSPENDS: 0,
              u.MSM_PARAM_VA_START: self.window.start, u.MSM_PARAM_VA_SIZE: self.window.size}
    if a.param not in values:
      raise _err(errno.EINVAL, f"param {a.param:#x}")
    a.value = values[a.param]

  def _gem_new(self, a: u.drm_msm_gem_new) -> None:
    if a.flags & ~u.MSM_BO_FLAGS or a.size == 0:
      raise _err(errno.EINVAL, f"GEM_NEW flags {a.flags:#x} size {a.size:#x}")
    if (a.flags & u.MSM_BO_CACHE_MASK) not in _CACHE_MODES:
      raise _err(errno.EINVAL, f"GEM_NEW flags {a.flags:#x} name {'no' if not a.flags & u.MSM_BO_CACHE_MASK else 'more than one'} cache mode")
    size = _round_page(a.size)
    if self.mem_limit is not None and self.mem_used + size > self.mem_limit:
      # checked before anything is made, so a refused GEM_NEW leaves no memfd, mapping or handle behind
      raise _err(errno.ENOMEM, f"GEM_NEW of {size:#x} bytes: {self.mem_used / 2**20:.2f} of the node's {self.mem_limit / 2**20:.2f} MiB "
                               f"in use (EMU_MEM_LIMIT_MB)")
    fd = os.memfd_create("msm-bo", os.MFD_CLOEXEC)
    try:
      os.ftruncate(fd, size)
      host = libc.mmap(0, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
      if host == _FAILED:
        raise _err(errno.ENOMEM, "backing mapping")
    except BaseException:
      os.close(fd)
      raise
    gem = GemObject(next(self._handles), size, a.flags, fd, self._next_offset, host)
    self.mem_used += size
    self._next_offset += size + PAGE
    self._gems[gem.handle], self._by_offset[gem.mmap_offset] = gem, gem
    a.handle = gem.handle

  def _gem_info(self, a: u.drm_msm_gem_info) -> None:
    if a.pad:
      raise _err(errno.EINVAL, f"GEM_INFO pad {a.pad:#x}")
    if a.len and a.info not in _INFO_WITH_LEN:
      raise _err(errno.EINVAL, f"GEM_INFO {a.info} takes no len (got {a.len})")
    gem = self._lookup(a.handle, errno.ENOENT)
    if a.info in (u.MSM_INFO_GET_IOVA, u.MSM_INFO_SET_IOVA):
      self.vm_created = True
      if self.vm_bind:
        raise _err(errno.EINVAL, "VM_BIND is enabled: userspace owns the GPU addresses")
    if a.info == u.MSM_INFO_GET_OFFSET:
      a.value = gem.mmap_offset
    elif a.info == u.MSM_INFO_GET_IOVA:
      if not gem.iova:
        self._assign_iova(gem)
      a.value = gem.iova
    elif a.info == u.MSM_INFO_SET_IOVA:
      if not self.per_process_pgtables:
        raise _err(errno.EOPNOTSUPP, "SET_IOVA needs per-process page tables")
      if a.value == 0:
        if gem.pins:
          raise _err(errno.EBUSY, f"BO handle {gem.handle} is in use")
        if gem.iova:
          self._by_iova.remove(gem.iova); self.window.release(gem.iova, gem.size)  # noqa: E702
        gem.iova = 0
      elif gem.iova and gem.iova != a.value:
        raise _err(errno.EBUSY, f"BO handle {gem.handle} already has iova {gem.iova:#x}")
      elif not gem.iova:
        try:
          self._assign_iova(gem, a.value)
        except ValueError as e:
          raise _err(errno.ENOSPC, str(e)) from None
    elif a.info == u.MSM_INFO_GET_FLAGS:
      a.value = gem.flags
    else:
      raise _err(errno.EINVAL, f"GEM_INFO {a.info}")

  def _gem_close(self, a: u.drm_gem_close) -> None:
    gem = self._lookup(a.handle)
    del self._gems[a.handle]
    gem.open = False
    if gem.pins == 0 and gem.maps == 0:
      self._release(gem)   # otherwise the pending submits (or VM_BIND mappings) keep the backing until they let go

  def _submit(self, a: u.drm_msm_gem_submit) -> None:
    # checks in the kernel's order, so a submit with two faults gets the errno the kernel would give first
    if a.flags & ~(u.MSM_SUBMIT_FLAGS | u.MSM_PIPE_MASK) or (a.flags & u.MSM_PIPE_MASK) != u.MSM_PIPE_3D0:
      raise _err(errno.EINVAL, f"submit flags {a.flags:#x}")
    if a.pad:
      raise _err(errno.EINVAL, f"submit pad {a.pad:#x}")
    if a.flags & u.MSM_SUBMIT_SUDO:
      raise _err(errno.EINVAL, "SUDO needs CAP_SYS_RAWIO (and CONFIG_DRM_MSM_GPU_SUDO)")
    if a.flags & _UNEMULATED_SUBMIT_FLAGS:
      raise _err(errno.EINVAL, "fence fds, syncobjs and userspace seqnos are not emulated")
    self.vm_created = True
    if self.vm_unusable:
      raise _err(errno.EPIPE, "context is unusable (a GPU hang poisoned its VM_BIND VM)")
    if (q := self._queues.get(a.queueid)) is None:
      raise _err(errno.ENOENT, f"submitqueue {a.queueid}")
    if q.flags & u.MSM_SUBMITQUEUE_VM_BIND:
      raise _err(errno.EINVAL, f"submitqueue {q.id} is a VM_BIND queue: invalid queue type for GEM_SUBMIT")
    bos = (u.drm_msm_gem_submit_bo * a.nr_bos).from_address(a.bos) if a.nr_bos else []
    cmds = (u.drm_msm_gem_submit_cmd * a.nr_cmds).from_address(a.cmds) if a.nr_cmds else []
    gems: list[GemObject] = []
    for i, bo in enumerate(bos):
      if bo.flags & ~u.MSM_SUBMIT_BO_FLAGS or not bo.flags & (u.MSM_SUBMIT_BO_READ | u.MSM_SUBMIT_BO_WRITE):
        raise _err(errno.EINVAL, f"bos[{i}] flags {bo.flags:#x} (each entry needs READ or WRITE)")
      gems.append(self._lookup(bo.handle))
    for i, c in enumerate(cmds):
      if c.type not in (u.MSM_SUBMIT_CMD_BUF, u.MSM_SUBMIT_CMD_IB_TARGET_BUF, u.MSM_SUBMIT_CMD_CTX_RESTORE_BUF):
        raise _err(errno.EINVAL, f"cmds[{i}] type {c.type}")
      if c.size % 4:
        raise _err(errno.EINVAL, f"cmds[{i}] size {c.size:#x} is not whole dwords")
      if self.vm_bind and c.nr_relocs:
        raise _err(errno.EINVAL, f"cmds[{i}]: nr_relocs must be zero with VM_BIND")
      if self.vm_bind and (c.submit_idx or c.submit_offset):
        raise _err(errno.EINVAL, f"cmds[{i}]: submit_idx/offset must be zero with VM_BIND (the command is named by cmd.iova)")
    seen: set[int] = set()
    for i, bo in enumerate(bos):   # the kernel meets a duplicate when it locks the objects, in the ww-mutex code
      if bo.handle in seen:
        raise _err(errno.EALREADY, f"bos[{i}] handle {bo.handle} already on submit list")
      seen.add(bo.handle)
    frames = []
    for i, c in enumerate(cmds):
      if self.vm_bind:
        # nothing checks the range against a BO: the CP fetches it through the VM, and an unmapped one faults there
        if c.size and (c.type == u.MSM_SUBMIT_CMD_BUF or (c.type == u.MSM_SUBMIT_CMD_CTX_RESTORE_BUF and not self._ring_ctx)):
          frames.append(Frame(c.iova, (c.size // 4) & _IB_DWORDS_MASK))
        continue
      if c.submit_idx >= len(gems):
        raise _err(errno.EINVAL, f"cmds[{i}] submit_idx {c.submit_idx} >= nr_bos {len(gems)}")
      gem = gems[c.submit_idx]
      dw_off, dw_size = c.submit_offset // 4, c.size // 4   # the kernel truncates an unaligned offset rather than refusing it
      if dw_size == 0 or dw_off + dw_size > gem.size // 4:
        raise _err(errno.EINVAL, f"cmds[{i}] offset {c.submit_offset:#x} size {c.size:#x} outside BO handle {gem.handle} ({gem.size:#x})")
      if c.nr_relocs:
        raise _err(errno.EINVAL, f"cmds[{i}] has relocs, which this driver generation rejects")
      if not gem.iova:
        self._assign_iova(gem)
      # IB_TARGET_BUF is only a target of other IBs; CTX_RESTORE_BUF runs only when the ring switches to this context
      if c.type == u.MSM_SUBMIT_CMD_BUF or (c.type == u.MSM_SUBMIT_CMD_CTX_RESTORE_BUF and not self._ring_ctx):
        frames.append(Frame(gem.iova + dw_off * 4, dw_size & _IB_DWORDS_MASK))
    for gem in gems:
      if not gem.iova and not self.vm_bind:
        self._assign_iova(gem)   # pinning maps the BO
      gem.pins += 1
    self._ring_ctx = True
    fence = q.next_fence()
    q.live.add(fence)
    a.fence = fence
    self.stats.submits += 1
    self.submits.append(SubmitRecord(q.id, fence, tuple(b.handle for b in bos), tuple(b.flags for b in bos),
                                     tuple((0 if self.vm_bind else gems[c.submit_idx].handle, c.iova if self.vm_bind else c.submit_offset,
                                            c.size) for c in cmds)))
    ready = (time.clock_gettime_ns(time.CLOCK_MONOTONIC) + int(self._job_delays.popleft() * 1e9)) if self._job_delays else 0
    writes = frozenset(bo.handle for bo in bos if bo.flags & u.MSM_SUBMIT_BO_WRITE)
    self._ring.append(Job(q, fence, gems, ExecState(frames[::-1]), frozenset(gems), ready, writes))

  def _wait_fence(self, a: u.drm_msm_wait_fence) -> None:
    if a.flags & ~u.MSM_WAIT_FENCE_FLAGS:
      raise _err(errno.EINVAL, f"WAIT_FENCE flags {a.flags:#x}")
    if (q := self._queues.get(a.queueid)) is None:
      raise _err(errno.ENOENT, f"submitqueue {a.queueid}")
    if _fence_newer(a.fence, q.last_fence):
      raise _err(errno.EINVAL, f"fence {a.fence} is newer than the queue's last ({q.last_fence})")
    deadline = a.timeout.tv_sec * 1_000_000_000 + a.timeout.tv_nsec
    while True:
      self.progress()
      if a.fence not in q.live:   # retired (or never handed out): the kernel's idr no longer has it, so 0 at once
        return
      if time.clock_gettime_ns(time.CLOCK_MONOTONIC) >= deadline:
        raise _err(errno.ETIMEDOUT, f"fence {a.fence} on queue {q.id}")
      time.sleep(min(0.0005, max(0, deadline - time.clock_gettime_ns(time.CLOCK_MONOTONIC)) / 1e9))

  def _cpu_prep(self, a: u.drm_msm_gem_cpu_prep) -> None:
    if a.op & ~u.MSM_PREP_FLAGS:
      raise _err(errno.EINVAL, f"CPU_PREP op {a.op:#x}")
    gem = self._lookup(a.handle, errno.ENOENT)
    deadline = a.timeout.tv_sec * 1_000_000_000 + a.timeout.tv_nsec
    # as msm_gem_cpu_prep's dma_resv_usage_rw(write): a CPU read waits for the GPU's writers only (the jobs that listed the
    # BO with MSM_SUBMIT_BO_WRITE), a CPU write for every job that lists it
    write = bool(a.op & u.MSM_PREP_WRITE)
    while True:
      self.progress()
      if not any(gem in job.listed and (write or gem.handle in job.writes) for job in self._ring):
        return
      if a.op & u.MSM_PREP_NOSYNC:
        raise _err(errno.EBUSY, f"BO handle {gem.handle} is busy")
      if time.clock_gettime_ns(time.CLOCK_MONOTONIC) >= deadline:
        raise _err(errno.ETIMEDOUT, f"BO handle {gem.handle}")
      time.sleep(0.0005)

  def _queue_new(self, a: u.drm_msm_submitqueue) -> None:
    if a.flags & u.MSM_SUBMITQUEUE_VM_BIND:
      if not self.vm_bind:
        raise _err(errno.EINVAL, "a VM_BIND queue needs a context that enabled VM_BIND")
      if a.prio:
        raise _err(errno.EINVAL, f"a VM_BIND queue takes prio 0, not {a.prio}")
      if a.flags & ~u.MSM_SUBMITQUEUE_VM_BIND:
        raise _err(errno.EINVAL, f"submitqueue flags {a.flags:#x}")
      self.vm_created = True
      q = self._new_queue(next(self._queue_ids), 0, a.flags)
      self._queues[q.id] = q
      a.id = q.id
      return
    if a.flags & u.MSM_SUBMITQUEUE_ALLOW_PREEMPT:
      raise _err(errno.EINVAL, "preemption needs more than one ring (a630 has one)")
    if a.flags & ~u.MSM_SUBMITQUEUE_ALLOW_PREEMPT:
      raise _err(errno.EINVAL, f"submitqueue flags {a.flags:#x}")
    if a.prio >= self.priorities:
      raise _err(errno.EINVAL, f"priority {a.prio} >= {self.priorities}")
    q = self._new_queue(next(self._queue_ids), a.prio, a.flags)
    self._queues[q.id] = q
    a.id = q.id

  def _queue_close(self, a: ctypes.c_uint32) -> None:
    qid = a.value
    if qid == 0 or qid not in self._queues:
      raise _err(errno.ENOENT, f"submitqueue {qid}")
    del self._queues[qid]   # its pending jobs still run and retire, like the kernel's refcounted queue

  def _queue_query(self, a: u.drm_msm_submitqueue_query) -> None:
    if (q := self._queues.get(a.id)) is None:
      raise _err(errno.ENOENT, f"submitqueue {a.id}")
    if a.param != u.MSM_SUBMITQUEUE_PARAM_FAULTS:
      raise _err(errno.EINVAL, f"query param {a.param}")
    self.progress()
    if a.len:   # len 0 asks for the size, which this write-only ioctl cannot return
      if not a.data:
        raise _err(errno.EFAULT, "query data pointer is NULL")
      ctypes.memmove(a.data, struct.pack("<I", q.faults), min(a.len, 4))

  def _set_param(self, a: u.drm_msm_param) -> None:
    if a.pipe != u.MSM_PIPE_3D0 or a.pad or a.len:
      raise _err(errno.EINVAL, f"SET_PARAM pipe {a.pipe:#x} pad {a.pad:#x} len {a.len}")
    if a.param != u.MSM_PARAM_EN_VM_BIND or not self.vm_bind_supported:
      raise _err(errno.EINVAL, f"invalid param {a.param:#x}")   # SYSPROF/COMM/CMDLINE are not emulated; pre-6.17 has no EN_VM_BIND
    if not self.per_process_pgtables:
      raise _err(errno.EINVAL, "VM_BIND requires per-process pgtables")
    if self.vm_created:
      raise _err(errno.EBUSY, "VM already created: EN_VM_BIND must come before the first ioctl that makes it")
    self.vm_bind = bool(a.value)

  def _vm_bind(self, a: u.drm_msm_vm_bind) -> None:
    self.vm_created = True
    if self.vm_unusable:
      raise _err(errno.EPIPE, "context is unusable")
    if not self.vm_bind:
      raise _err(errno.EINVAL, "context does not support vmbind")
    if a.flags & ~u.MSM_VM_BIND_FLAGS:
      raise _err(errno.EINVAL, f"VM_BIND flags {a.flags:#x}")
    if (q := self._queues.get(a.queue_id)) is None:
      raise _err(errno.ENOENT, f"submitqueue {a.queue_id}")
    if not q.flags & u.MSM_SUBMITQUEUE_VM_BIND:
      raise _err(errno.EINVAL, f"submitqueue {q.id} is not a VM_BIND queue: invalid queue type")
    if a.flags & u.MSM_VM_BIND_FENCE_FD_IN or a.in_syncobjs or a.out_syncobjs:
      raise _err(errno.EINVAL, "VM_BIND in-fences and syncobjs are not emulated")
    opsz = ctypes.sizeof(u.drm_msm_vm_bind_op)
    ops = [a.op] if a.nr_ops == 1 else [u.drm_msm_vm_bind_op.from_address(a.ops + i * opsz) for i in range(a.nr_ops)]
    checked = [self._bind_op(i, op) for i, op in enumerate(ops)]   # every op is validated before the VM changes at all
    dropped = []
    for op, gem in checked:
      if op.op == u.MSM_VM_BIND_OP_UNMAP:
        dropped += self.user_vm.unmap(op.iova, op.range)
      else:
        dropped += self.user_vm.map(op.iova, op.range, gem, op.obj_offset)
    for gem in dropped:
      if not gem.open and gem.pins == 0 and gem.maps == 0:
        self._release(gem)
    if a.flags & u.MSM_VM_BIND_FENCE_FD_OUT:
      # the bind ran already (the emulator applies it in the ioctl), so its sync_file is signalled: an eventfd holding 1
      # polls readable like a signalled sync_file, and the caller closes it like one
      a.fence_fd = os.eventfd(1, os.EFD_CLOEXEC)

  def _bind_op(self, i: int, op: u.drm_msm_vm_bind_op) -> tuple[u.drm_msm_vm_bind_op, GemObject | None]:
    """lookup_op's checks (each failing one overwrites the error, all EINVAL), then the handle and the BO bounds."""
    what = f"ops[{i}]"
    problems = []
    if op.flags & ~u.MSM_VM_BIND_OP_FLAGS:
      problems.append(f"invalid flags {op.flags:#x}")
    for name in ("iova", "obj_offset", "range"):
      if getattr(op, name) % PAGE:
        problems.append(f"{name} {getattr(op, name):#x} is not page aligned")
    lo, hi = self.window.start, self.window.start + self.window.size
    if op.iova + op.range > (1 << 64) - 1 or not (lo <= op.iova and op.iova + op.range <= hi):
      problems.append(f"range {op.iova:#x}+{op.range:#x} is outside the VM [{lo:#x}, {hi:#x})")
    if op.op == u.MSM_VM_BIND_OP_MAP and not op.handle:
      problems.append("MAP needs a handle")
    elif op.op != u.MSM_VM_BIND_OP_MAP and op.handle:
      problems.append("handle must be zero for UNMAP and MAP_NULL")
    if op.op not in (u.MSM_VM_BIND_OP_MAP, u.MSM_VM_BIND_OP_MAP_NULL, u.MSM_VM_BIND_OP_UNMAP):
      problems.append(f"invalid op {op.op}")
    if op.op == u.MSM_VM_BIND_OP_MAP_NULL and not self.has_prr:
      problems.append("MAP_NULL needs PRR, which this GPU's SMMU lacks")
    if problems:
      raise _err(errno.EINVAL, f"VM_BIND {what}: " + "; ".join(problems))
    if not op.handle:
      return op, None
    if (gem := self._gems.get(op.handle)) is None:
      raise _err(errno.EINVAL, f"VM_BIND {what}: invalid handle {op.handle}")
    if op.range + op.obj_offset > gem.size:
      raise _err(errno.EINVAL, f"VM_BIND {what}: range {op.range:#x} + offset {op.obj_offset:#x} > BO handle {gem.handle} size {gem.size:#x}")
    return op, gem

  def _madvise(self, a: u.drm_msm_gem_madvise) -> None:
    self._lookup(a.handle)
    a.retained = 1

  def _prime_to_fd(self, a: u.drm_prime_handle) -> None:
    a.fd = os.dup(self._lookup(a.handle).memfd)

  def _prime_to_handle(self, a: u.drm_prime_handle) -> None:
    """dma_buf_get first: a closed fd is EBADF, a file that is not a dma-buf (a plain memfd, a shm file) EINVAL. One of
    our own exports gives its object back; a foreign dma-buf is imported once per file and its handle reused after."""
    try:
      st = os.fstat(a.fd)
    except OSError:
      raise _err(errno.EBADF, f"fd {a.fd} is not open") from None
    for gem in self._gems.values():
      if gem.imported is None and os.fstat(gem.memfd).st_ino == st.st_ino:
        a.handle = gem.handle
        return
    key = (st.st_dev, st.st_ino)
    if (known := self._imports.get(key)) is not None and known.open:
      a.handle = known.handle
      return
    if not dmabuf.is_dmabuf(a.fd):
      raise _err(errno.EINVAL, f"fd {a.fd} is not a dma-buf (dma_buf_get refuses any other file)")
    size = _round_page(st.st_size)
    fd = os.dup(a.fd)
    host = libc.mmap(0, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if host == _FAILED:
      os.close(fd)
      raise _err(errno.ENOMEM, "mapping the imported dma-buf")
    gem = GemObject(next(self._handles), size, u.MSM_BO_WC, fd, self._next_offset, host, imported=key)
    self._next_offset += size + PAGE
    self._gems[gem.handle], self._by_offset[gem.mmap_offset], self._imports[key] = gem, gem, gem
    a.handle = gem.handle
