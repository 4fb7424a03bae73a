"""The MSM kernel interface: a mainline drm/msm render node under tinygrad's QCOM device.

Every allocation is a `GemBuffer` holding its three identities (GEM handle, CPU mapping, GPU IOVA), in both address
modes: kernel-managed (GET_IOVA; the submit's BO table maps and pins) and VM_BIND (6.17+: our own VA allocator over
VA_START/VA_SIZE, a MAP when the buffer is made, an UNMAP only once the last fence that can touch it retired; submits
carry no BO table). MODELD_MSM_VM=auto|bind|kernel picks the mode; auto takes VM_BIND where the kernel accepts it. Commands carry
IOVAs; the CPU writes through the mapping. Submits go through a small scheduler: at most `inflight` jobs are given to
the kernel at a time (the a630 has one ring and no preemption, so what sits in the ring delays the compositor), the
rest wait in a FIFO that waits on fences pump. A buffer is closed only when no pending or in-flight submit and no
bound (graph) queue references it.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import glob
import mmap
import os
import select
import struct
import sys
import time
from dataclasses import dataclass, field

from tinygrad.helpers import getenv
from tinygrad.runtime.autogen import libc
from tinygrad.runtime.support.hcq import FileIOInterface
from tinygrad.uop.ops import sym_infer

from backend import chunking
from backend import uapi as u
from backend.intervals import IntervalIndex
from backend.va import VaAllocator

PAGE = 0x1000
BO_RW = u.MSM_SUBMIT_BO_READ | u.MSM_SUBMIT_BO_WRITE
_BO = struct.Struct("<IIQ")   # drm_msm_gem_submit_bo, packed straight into the per-submit table
# device_fini's drain deadline: tinygrad's finalize synchronized every job first, so what is still in flight then is lost,
# and waiting the full MSM_WAIT_TIMEOUT_MS for it again would only delay the exit
FINI_DRAIN_MS = 2000
# fence ids cycle through 1..INT_MAX (a per-queue cyclic id allocator), so they are compared modulo 2**31: a 32-bit seqno
# comparison would call the id after the wrap (1) older than INT_MAX and treat an unfinished job as retired
FENCE_CYCLE = 1 << 31
# EINTR/EAGAIN from GEM_SUBMIT come before anything was queued (interruptible locks): tries before it counts as refused
SUBMIT_RETRIES = 100
# submits given to the kernel at a time per queue; the rest wait in our FIFO (never dropped). Two: the next chunk is already
# in the ring when one retires, so the GPU does not idle for a CPU wake-up per chunk, while a vsync waits behind at most two
# chunks (bench/bench_inflight.py gives the table; docs/msm-vm-bind.md the numbers)
DEFAULT_INFLIGHT = 2
VM_MODES = ("auto", "bind", "kernel")
_said: set[str] = set()


def vm_mode_from_env() -> str:
  mode = os.environ.get("MODELD_MSM_VM", "auto").strip().lower() or "auto"
  if mode not in VM_MODES:
    raise RuntimeError(f"MODELD_MSM_VM={mode!r} is not one of {', '.join(VM_MODES)}")
  return mode


def fence_after(a: int, b: int) -> bool:
  """Whether fence id a is newer than b on one submitqueue, across the wrap; 0 (never submitted) is older than every id."""
  if a == 0 or b == 0:
    return b == 0 and a != 0
  return 0 < (a - b) % FENCE_CYCLE < FENCE_CYCLE // 2


class MSMFault(RuntimeError):
  """The GPU faulted or hung on one of our jobs. The job's lost signal writes were completed, so the device stays usable."""


class MSMVmLost(MSMFault):
  """VM_BIND mode after a GPU hang: the kernel marked this file's VM unusable (every submit is EPIPE); reopen the device."""


class ImportRefused(RuntimeError):
  """The kernel would not take an fd as a dma-buf (PRIME_FD_TO_HANDLE): the caller copies the frame instead."""


class MSMTimeout(RuntimeError):
  """A fence did not retire by the deadline. Not sticky: a later wait may still see it retire."""


def _ioctl(fd, req: int, arg):
  return fd.ioctl(req, arg)


def monotonic_ns() -> int:
  return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass(eq=False)
class GemBuffer:
  """One GEM object: handle, CPU mapping and GPU address together."""
  handle: int
  size: int          # bytes mapped (page-rounded)
  iova: int
  cpu: int
  last_fence: int = 0   # newest submit that listed it
  pins: int = 0         # bound queues whose commands reference it
  freed: bool = False   # the owner let go; closed once pins == 0 and last_fence retired
  closed: bool = False
  packed: bytes = b""   # its drm_msm_gem_submit_bo entry
  bound: bool = False   # VM_BIND mode: iova is our own range, mapped by a VM_BIND MAP (unmapped at close)
  imported: tuple[int, int] | None = None   # (st_dev, st_ino) of the dma-buf it came from; cpu is then our read-only view
  refs: int = 0         # imports: holders (import_dmabuf calls not yet matched by a free)


@dataclass(eq=False)
class Job:
  """One GEM_SUBMIT: a command range and its BO table, plus what to complete from the CPU if the GPU loses it."""
  cmd: GemBuffer
  offset: int
  size: int
  table: bytearray
  nr_bos: int
  gems: list
  signals: list = field(default_factory=list)   # (address, value) the job writes, ints or symbols of var_vals, for recovery
  fence: int = 0
  var_vals: dict = field(default_factory=dict)

  @property
  def handles(self) -> list[int]:
    return [h for _, h, _ in struct.iter_unpack("<IIQ", bytes(self.table))]


@dataclass(frozen=True)
class Settings:
  priority: int
  chunk_kernels: int
  inflight: int
  wait_slice_ms: int
  wait_timeout_ms: int

  @staticmethod
  def from_env(priorities: int) -> Settings:
    # read per device (not tinygrad's cached getenv): each opened device may be given its own settings
    def env(k: str, default: int) -> int:
      return int(os.environ.get(k, default))
    prio = env("MSM_PRIORITY", priorities - 1)   # lowest by default: a lower number is a higher priority
    if not 0 <= prio < priorities:
      raise RuntimeError(f"MSM_PRIORITY={prio} is out of range: this GPU has priorities 0..{priorities - 1}")
    s = Settings(prio, env("MSM_CHUNK_KERNELS", 16), env("MSM_INFLIGHT", DEFAULT_INFLIGHT), env("MSM_WAIT_SLICE_MS", 10),
                 env("MSM_WAIT_TIMEOUT_MS", env("HCQDEV_WAIT_TIMEOUT_MS", 30000)))
    if s.chunk_kernels < 0 or s.inflight < 1:
      raise RuntimeError("MSM_CHUNK_KERNELS must be >= 0 (0: no chunking) and MSM_INFLIGHT >= 1")
    return s


def get_param(fd, param: int) -> int:
  return _ioctl(fd, u.DRM_IOCTL_MSM_GET_PARAM, p := u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=param)) or p.value


def drm_version(fd) -> tuple[str, tuple[int, int, int]]:
  v = u.drm_version()
  _ioctl(fd, u.DRM_IOCTL_VERSION, v)
  name = ctypes.create_string_buffer(v.name_len + 1)
  v2 = u.drm_version(name_len=v.name_len, name=ctypes.addressof(name))
  _ioctl(fd, u.DRM_IOCTL_VERSION, v2)
  return name.value.decode(errors="replace"), (v2.version_major, v2.version_minor, v2.version_patchlevel)


def find_render_node(paths: list[str] | None = None, before_params=None) -> tuple[FileIOInterface, str]:
  """Opens the first render node driven by msm with an Adreno 630 (chip 6.3.0.x). before_params(fd) runs on each msm
  node before its first GET_PARAM: any GET_PARAM makes the file's VM, after which EN_VM_BIND is refused."""
  seen = []
  for path in paths if paths is not None else sorted(glob.glob("/dev/dri/renderD*")):
    try:
      fd = FileIOInterface(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
      seen.append(f"{path}: {e.strerror}")
      continue
    try:
      name, ver = drm_version(fd)
      if name != "msm":
        seen.append(f"{path}: driver {name}")
        continue
      if before_params is not None:
        before_params(fd)
      gpu, chip = get_param(fd, u.MSM_PARAM_GPU_ID), get_param(fd, u.MSM_PARAM_CHIP_ID)
      if gpu != 630 or chip >> 8 != u.ADRENO_630_CHIP_ID >> 8:
        seen.append(f"{path}: msm {ver} gpu {gpu} chip {chip:#x} (need Adreno 630)")
        continue
      return fd, path
    except OSError as e:
      seen.append(f"{path}: {e}")
  raise RuntimeError("no msm render node with an Adreno 630: " + ("; ".join(seen) if seen else "no /dev/dri/renderD* nodes"))


class MSMIface:
  """Kernel interface of QCOM over drm/msm. `dev` is the QCOMDevice it serves."""

  renderer_names = ("IR3",)

  def __init__(self, dev, device_id: int = 0):
    self.dev, self.device_id = dev, device_id
    self.vm_asked = vm_mode_from_env()
    self.vm_bind, self.vm_reason = False, "not chosen yet"
    self.fd, self.path = self._open()
    self.peer_group = f"QCOM:{id(self):x}"   # signal pages are this node's GEM objects: never shared with another device
    self.driver_version = drm_version(self.fd)[1]
    self.chip_id = get_param(self.fd, u.MSM_PARAM_CHIP_ID)
    self.gpu_id = (self.chip_id >> 24, (self.chip_id >> 16) & 0xff, (self.chip_id >> 8) & 0xff)
    self.priorities = get_param(self.fd, u.MSM_PARAM_PRIORITIES)
    self.va_range = self._va_range()
    self.settings = Settings.from_env(self.priorities)
    self.va: VaAllocator | None = None
    self.bind_queue = 0
    if self.vm_bind:
      if self.va_range is None:
        raise RuntimeError(f"{self.path}: VM_BIND is on but the kernel reports no VA_START/VA_SIZE")
      self.va = VaAllocator(*self.va_range)
      # VM_BIND ops go through a queue of their own kind (prio 0 is the only one it takes)
      _ioctl(self.fd, u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, bq := u.drm_msm_submitqueue(flags=u.MSM_SUBMITQUEUE_VM_BIND, prio=0))
      self.bind_queue = bq.id
    _ioctl(self.fd, u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, q := u.drm_msm_submitqueue(flags=0, prio=self.settings.priority))
    self.queue_id = q.id
    self.index: IntervalIndex[GemBuffer] = IntervalIndex()
    self.imports: dict[tuple[int, int], GemBuffer] = {}
    self.pending: collections.deque[Job] = collections.deque()
    self.inflight: collections.deque[Job] = collections.deque()
    self.retired = self.last_fence = self.faults_seen = 0
    self._recovering = False
    self.just_retired: list[Job] = []   # retired since the last fault check: the candidates for a lost signal write
    self.zombies: list[GemBuffer] = []
    self.submit_flags = u.MSM_PIPE_3D0 | (0 if getenv("MSM_IMPLICIT_SYNC", 0) else u.MSM_SUBMIT_NO_IMPLICIT)
    self._cmd = u.drm_msm_gem_submit_cmd(type=u.MSM_SUBMIT_CMD_BUF)
    self._no_table = (ctypes.c_char * 1)()
    self._submit = u.drm_msm_gem_submit(flags=self.submit_flags, queueid=self.queue_id, nr_cmds=1, cmds=ctypes.addressof(self._cmd))
    self.stats: collections.Counter[str] = collections.Counter()
    self.closed = False
    self.recent: collections.deque[Job] = collections.deque(maxlen=64)   # the last jobs given to the kernel, for tests and doctor

  def _open(self):
    return find_render_node(before_params=self._choose_vm)

  def _choose_vm(self, fd, say: bool = True) -> None:
    """Asks for VM_BIND (unless MODELD_MSM_VM=kernel) before anything makes the file's VM; auto falls back to the
    kernel-managed mode when the kernel refuses (EINVAL before 6.17 or without per-process page tables)."""
    if self.vm_asked == "kernel":
      self.vm_bind, self.vm_reason = False, "asked for"
      return
    try:
      _ioctl(fd, u.DRM_IOCTL_MSM_SET_PARAM, u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_EN_VM_BIND, value=1))
    except OSError as e:
      if self.vm_asked == "bind":
        raise RuntimeError(f"MODELD_MSM_VM=bind, but the kernel refused SET_PARAM(EN_VM_BIND): {e.strerror} "
                           f"(it needs msm 1.13 / Linux 6.17+ with per-process page tables); use MODELD_MSM_VM=auto") from e
      self.vm_bind, self.vm_reason = False, f"the kernel refused EN_VM_BIND: {e.strerror}"
      if say and self.vm_reason not in _said:   # once per process and reason, not once per device opened
        _said.add(self.vm_reason)
        print(f"msm: {self.vm_reason}; using kernel-managed GPU addresses", file=sys.stderr)
      return
    self.vm_bind, self.vm_reason = True, "EN_VM_BIND accepted"

  @property
  def vm_mode(self) -> str:
    return "bind" if self.vm_bind else "kernel"

  def _va_range(self) -> tuple[int, int] | None:
    try:
      return get_param(self.fd, u.MSM_PARAM_VA_START), get_param(self.fd, u.MSM_PARAM_VA_SIZE)
    except OSError:
      return None   # no per-process page tables: the kernel does not say

  # *** memory ***

  def alloc(self, size: int, flags: int = u.MSM_BO_WC) -> GemBuffer:
    # WC (not CACHED): CPU_PREP/FINI do no cache maintenance on msm
    size = (size + PAGE - 1) & ~(PAGE - 1)
    try:
      _ioctl(self.fd, u.DRM_IOCTL_MSM_GEM_NEW, new := u.drm_msm_gem_new(size=size, flags=flags))
    except OSError as e:
      raise MemoryError(f"msm GEM_NEW of {size} bytes failed: {e}") from e
    cpu = iova = 0
    try:
      _ioctl(self.fd, u.DRM_IOCTL_MSM_GEM_INFO, off := u.drm_msm_gem_info(handle=new.handle, info=u.MSM_INFO_GET_OFFSET))
      cpu = self.fd.mmap(0, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, off.value)
      iova = self._map_new(new.handle, size)
    except (OSError, MemoryError) as e:
      if cpu:
        FileIOInterface.munmap(cpu, size)
      _ioctl(self.fd, u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=new.handle))
      raise MemoryError(f"msm BO setup (GEM_INFO/mmap/{'VM_BIND' if self.vm_bind else 'GET_IOVA'}) of {size} bytes failed: {e}") from e
    gem = GemBuffer(new.handle, size, iova, cpu, packed=_BO.pack(BO_RW, new.handle, iova), bound=self.vm_bind)
    self.index.add(gem.iova, size, gem)
    self.stats["alloc"] += 1
    return gem

  def import_dmabuf(self, fd: int) -> GemBuffer:
    """A dma-buf (a camera frame) as a GemBuffer: imported once per buffer (VisionIPC reuses its ring, and the kernel hands
    the same object back for the same dma-buf anyway), given a GPU address like any allocation, listed read-only in
    kernel-mode tables, and a read-only CPU view of our own. ImportRefused when the kernel will not take the fd.
    Each call is a hold on the buffer, matched by one free()."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    if (gem := self.imports.get(key)) is not None and not gem.closed:
      if gem.freed:   # let go but still waiting on a fence: the kernel would hand back this same object, so take it back
        gem.freed = False
        self.zombies = [g for g in self.zombies if g is not gem]
      gem.refs += 1
      return gem
    try:
      _ioctl(self.fd, u.DRM_IOCTL_PRIME_FD_TO_HANDLE, p := u.drm_prime_handle(fd=fd))
    except OSError as e:
      raise ImportRefused(f"PRIME_FD_TO_HANDLE refused the frame's fd: {e.strerror or e}") from e
    size = (st.st_size + PAGE - 1) & ~(PAGE - 1)
    cpu = libc.mmap(0, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    try:
      if cpu in (0, 0xffffffffffffffff):
        raise MemoryError(f"read-only mapping of the {size}-byte dma-buf failed")
      iova = self._map_new(p.handle, size)
    except BaseException:
      if cpu not in (0, 0xffffffffffffffff):
        FileIOInterface.munmap(cpu, size)
      _ioctl(self.fd, u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=p.handle))
      raise
    gem = GemBuffer(p.handle, size, iova, cpu, packed=_BO.pack(u.MSM_SUBMIT_BO_READ, p.handle, iova), bound=self.vm_bind, imported=key,
                    refs=1)
    self.index.add(iova, size, gem)
    self.imports[key] = gem
    self.stats["import"] += 1
    return gem

  def _map_new(self, handle: int, size: int) -> int:
    """The BO's GPU address: the kernel's (GET_IOVA), or a range of ours mapped with VM_BIND (freed again if the MAP fails)."""
    if not self.vm_bind:
      _ioctl(self.fd, u.DRM_IOCTL_MSM_GEM_INFO, iova := u.drm_msm_gem_info(handle=handle, info=u.MSM_INFO_GET_IOVA))
      return iova.value
    assert self.va is not None
    addr = self.va.alloc(size)
    try:
      self._bind(u.MSM_VM_BIND_OP_MAP, addr, size, handle)
    except BaseException:
      self.va.free(addr)
      raise
    self.stats["vm_map"] += 1
    return addr

  def _bind(self, op: int, iova: int, size: int, handle: int = 0) -> None:
    """One VM_BIND op, waited for: the bind job runs on the kernel's VM_BIND scheduler, and a GEM_SUBMIT does not wait for
    it, so a MAP must have landed before any job uses the range (and an UNMAP before the range is handed out again)."""
    arg = u.drm_msm_vm_bind(flags=u.MSM_VM_BIND_FENCE_FD_OUT, nr_ops=1, queue_id=self.bind_queue, fence_fd=-1)
    arg.op = u.drm_msm_vm_bind_op(op=op, handle=handle, obj_offset=0, iova=iova, range=size)
    for tries in range(1, SUBMIT_RETRIES + 1):
      try:
        _ioctl(self.fd, u.DRM_IOCTL_MSM_VM_BIND, arg)
        break
      except OSError as e:
        if e.errno == errno.EPIPE:
          raise MSMVmLost(f"msm VM_BIND on {self.path}: the VM is unusable after a GPU hang (EPIPE); reopen the device") from e
        if e.errno not in (errno.EINTR, errno.EAGAIN) or tries == SUBMIT_RETRIES:
          raise
    if arg.fence_fd >= 0:
      try:
        p = select.poll()
        p.register(arg.fence_fd, select.POLLIN)
        if not p.poll(self.settings.wait_timeout_ms):
          raise MSMTimeout(f"msm VM_BIND {'MAP' if op == u.MSM_VM_BIND_OP_MAP else 'UNMAP'} of {iova:#x}+{size:#x} not done after "
                           f"{self.settings.wait_timeout_ms} ms")
      finally:
        os.close(arg.fence_fd)

  def free(self, gem: GemBuffer) -> None:
    """Retire, then free: closes now if nothing can touch it any more, else when its last fence retires or its last graph dies."""
    if gem.freed:
      return
    if gem.imported is not None:
      gem.refs -= 1
      if gem.refs > 0:   # another holder (a second tensor over the same camera buffer) still uses it
        return
    gem.freed = True
    if not self.is_retired(gem.last_fence):
      self.poll_fence(gem.last_fence)
    if not self._close_if_idle(gem):
      self.zombies.append(gem)

  def unpin(self, gem: GemBuffer) -> None:
    gem.pins -= 1
    if gem.freed and gem.pins == 0:
      self._reap()

  def _close_if_idle(self, gem: GemBuffer) -> bool:
    if gem.closed:
      return True
    if gem.pins or not self.is_retired(gem.last_fence) or any(gem in j.gems for j in self.pending):
      return False
    FileIOInterface.munmap(gem.cpu, gem.size)
    self.index.remove(gem.iova)
    if gem.bound:
      # the last fence that could touch the range has retired (checked above): now it may go, and only then be reused
      assert self.va is not None
      try:
        self._bind(u.MSM_VM_BIND_OP_UNMAP, gem.iova, gem.size)
        self.va.free(gem.iova)
      except MSMVmLost:
        self.va.free(gem.iova)   # the whole VM is gone with the file; nothing maps the range any more
      self.stats["vm_unmap"] += 1
    _ioctl(self.fd, u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=gem.handle))
    if gem.imported is not None and self.imports.get(gem.imported) is gem:
      del self.imports[gem.imported]
    gem.closed = True
    self.stats["close"] += 1
    return True

  def _reap(self) -> None:
    if self.zombies:
      self.zombies = [g for g in self.zombies if not self._close_if_idle(g)]

  def cpu_addr(self, iova: int, size: int) -> int:
    """The CPU address of a GPU address range, or an error: a GPU address is never used as a CPU pointer."""
    hit = self.index.find(iova)
    if hit is None or iova + size > hit[0] + hit[1]:
      raise RuntimeError(f"{iova:#x}+{size:#x} is not inside a live GEM buffer of {self.path}: refusing to use a GPU address as a CPU pointer")
    return hit[2].cpu + (iova - hit[0])

  def gem_at(self, iova: int) -> GemBuffer:
    if (hit := self.index.find(iova)) is None:
      raise RuntimeError(f"GPU address {iova:#x} is not inside a live GEM buffer of {self.path}")
    return hit[2]

  # *** submission ***

  def job(self, cmd: GemBuffer, offset: int, size: int, gems: list[GemBuffer], signals: list | None = None) -> Job:
    """A job whose table lists cmd first, then every gem once (the caller dedups)."""
    table = bytearray(cmd.packed)
    for g in gems:
      table += g.packed
    return Job(cmd, offset, size, table, 1 + len(gems), gems, signals or [])

  def enqueue(self, job: Job) -> None:
    if job.size > u.MSM_IB_MAX_BYTES:
      # the kernel passes the dword count to the CP unchecked and the CP keeps 20 bits of it: a larger IB would silently run short
      raise ValueError(f"a {job.size}-byte command range does not fit one IB (at most {u.MSM_IB_MAX_BYTES} bytes, 2**20-1 dwords): split it")
    self.pending.append(job)
    self.stats["max_pending"] = max(self.stats["max_pending"], len(self.pending))
    self.pump()

  def pump(self) -> None:
    """Gives pending jobs to the kernel while fewer than `inflight` are there."""
    while self.pending and len(self.inflight) < self.settings.inflight:
      chunking.before_submit()   # between chunks: another process's turn on the GPU may hold this one back (bounded)
      job = self.pending.popleft()
      self._cmd.size = job.size
      if self.vm_bind:
        # no BO table: the kernel validates the whole VM, and the command range is named by its GPU address
        self._cmd.submit_offset, self._cmd.iova = 0, job.cmd.iova + job.offset
        self._submit.nr_bos, self._submit.bos = 0, ctypes.addressof(self._no_table)
      else:
        self._cmd.submit_offset = job.offset
        buf = (ctypes.c_char * len(job.table)).from_buffer(job.table)
        self._submit.nr_bos, self._submit.bos = job.nr_bos, ctypes.addressof(buf)
      try:
        self._submit_ioctl()
      except OSError as e:
        self.stats["submit_errors"] += 1
        self._recover([job], older_than_inflight=False)
        if e.errno == errno.EIO:
          raise MSMFault(f"GPU hang: msm GEM_SUBMIT returned EIO on {self.path} (recovered; the job did not run)") from e
        if e.errno == errno.EPIPE:
          raise MSMVmLost(f"msm GEM_SUBMIT on {self.path}: the VM_BIND VM is unusable after a GPU hang (EPIPE); "
                          f"the device must be reopened (restart the process)") from e
        table = "no BO table (VM_BIND)" if self.vm_bind else f"{job.nr_bos} BOs"
        raise MSMFault(f"msm GEM_SUBMIT rejected a job with {table}: {e}") from e
      job.fence = self.last_fence = self._submit.fence
      job.cmd.last_fence = job.fence
      for g in job.gems:
        g.last_fence = job.fence
      self.inflight.append(job)
      self.recent.append(job)
      self.stats["max_inflight"] = max(self.stats["max_inflight"], len(self.inflight))
      self.stats["submits"] += 1
      self.stats["bos"] += 0 if self.vm_bind else job.nr_bos

  def _submit_ioctl(self) -> None:
    for tries in range(1, SUBMIT_RETRIES + 1):
      try:
        _ioctl(self.fd, u.DRM_IOCTL_MSM_GEM_SUBMIT, self._submit)
        return
      except OSError as e:
        if e.errno not in (errno.EINTR, errno.EAGAIN) or tries == SUBMIT_RETRIES:
          raise
        self.stats["submit_retries"] += 1

  def is_retired(self, fence: int) -> bool:
    """Whether this queue's fence id (0: never submitted) has retired, as far as this process has seen; wrap-aware."""
    return not fence_after(fence, self.retired)

  def wait_fence(self, fence: int, timeout_ms: int | None = None) -> None:
    """Until the fence retired; then a GPU fault reported by the kernel since the last check raises MSMFault."""
    if self.is_retired(fence):
      return
    self._check_open()
    self._wait(fence, timeout_ms)
    self._check_faults()

  def _wait(self, fence: int, timeout_ms: int | None = None) -> None:
    """WAIT_FENCE in slices with absolute CLOCK_MONOTONIC deadlines; EINTR and per-slice timeouts retry until the overall deadline."""
    end = monotonic_ns() + (timeout_ms if timeout_ms is not None else self.settings.wait_timeout_ms) * 1_000_000
    w = u.drm_msm_wait_fence(fence=fence, queueid=self.queue_id)
    while True:
      now = monotonic_ns()
      dl = min(end, now + self.settings.wait_slice_ms * 1_000_000)
      w.timeout.tv_sec, w.timeout.tv_nsec = divmod(dl, 1_000_000_000)
      try:
        _ioctl(self.fd, u.DRM_IOCTL_MSM_WAIT_FENCE, w)
        break
      except OSError as e:
        if e.errno not in (errno.ETIMEDOUT, errno.EINTR, errno.EAGAIN):
          raise RuntimeError(f"msm WAIT_FENCE({fence}) failed: {e}") from e
        self.stats["wait_retries"] += 1
        if not self._recovering and self._fault_count() > self.faults_seen:
          # a killed job never writes its signals, so what waits behind it may never retire: report and recover now
          for j in list(self.inflight):
            if not self.poll_fence(j.fence):
              break
          self._check_faults()
        if monotonic_ns() >= end:
          raise MSMTimeout(f"msm fence {fence} on submitqueue {self.queue_id} not retired after "
                             f"{timeout_ms if timeout_ms is not None else self.settings.wait_timeout_ms} ms (last WAIT_FENCE: {e.strerror})") from e
    self._retired_upto(fence)

  def poll_fence(self, fence: int) -> bool:
    """Whether the fence retired, without blocking (a WAIT_FENCE whose deadline is now)."""
    if self.is_retired(fence):
      return True
    if not any(j.fence == fence for j in self.inflight):
      return False
    w = u.drm_msm_wait_fence(fence=fence, queueid=self.queue_id)
    w.timeout.tv_sec, w.timeout.tv_nsec = divmod(monotonic_ns(), 1_000_000_000)
    try:
      _ioctl(self.fd, u.DRM_IOCTL_MSM_WAIT_FENCE, w)
    except OSError:
      return False
    self._retired_upto(fence)
    return True

  def _retired_upto(self, fence: int) -> None:
    if fence_after(fence, self.retired):
      self.retired = fence
    while self.inflight and not fence_after(self.inflight[0].fence, fence):
      self.just_retired.append(self.inflight.popleft())
    self._reap()
    if not self.inflight and not self.pending:
      chunking.on_idle()   # this process's GPU work is done for now (modeld_msm/gpu_turn.py takes its mark down)

  def _fault_count(self) -> int:
    q = u.drm_msm_submitqueue_query(data=ctypes.addressof(n := ctypes.c_uint32()), id=self.queue_id, param=u.MSM_SUBMITQUEUE_PARAM_FAULTS, len=4)
    _ioctl(self.fd, u.DRM_IOCTL_MSM_SUBMITQUEUE_QUERY, q)
    return n.value

  def _check_faults(self) -> None:
    if (count := self._fault_count()) <= self.faults_seen:
      self.just_retired.clear()
      return
    new, detail, lost = count - self.faults_seen, self.fault_detail(), self.just_retired
    self.just_retired = []
    self._recover(lost, older_than_inflight=True)
    raise MSMFault(f"GPU fault on msm submitqueue {self.queue_id}: {new} new fault(s), {count} in total; {detail}")

  def fault_detail(self) -> str:
    return "see the kernel log (dmesg: msm iova fault / hangcheck) for the faulting address"

  def _recover(self, lost: list[Job], older_than_inflight: bool) -> None:
    """After a fault or a refused submit, complete from the CPU the signal writes the lost jobs would have made, in job order
    (signals only grow, so writing max(old, new) never moves one back): retired-but-faulted jobs are older than what is in flight,
    whose waits may depend on them, so they go first; a refused job is newer, so it waits until everything in flight retired."""
    if older_than_inflight:
      self._complete(lost)
    drained = list(self.inflight)
    self._recovering = True
    try:
      if drained:
        self._wait(drained[-1].fence)
    except RuntimeError:
      pass   # still stuck: the next wait reports it
    finally:
      self._recovering = False
    self._complete(drained if older_than_inflight else drained + lost)
    self.just_retired.clear()
    self.faults_seen = self._fault_count()   # faults of jobs drained here belong to this report

  def _complete(self, jobs: list[Job]) -> None:
    for job in jobs:
      for addr, value in job.signals:
        iova, v = (x if isinstance(x, int) else int(sym_infer(x, job.var_vals)) for x in (addr, value))
        sig = ctypes.c_uint64.from_address(self.cpu_addr(iova, 8))
        sig.value = max(sig.value, v)

  def sleep(self) -> None:
    """Called while the CPU waits on the timeline: wait for the oldest in-flight job when others are queued behind it, then pump."""
    self._check_open()
    if not self.inflight:
      self.pump()
    if self.inflight:
      self.wait_fence(self.inflight[0].fence if self.pending else self.inflight[-1].fence)
    self.pump()

  def wait_job(self, job: Job) -> None:
    """Until this job has retired (pumping the FIFO as needed)."""
    self._check_open()
    while not job.fence:
      if not self.inflight:
        self.pump()
      self.wait_fence(self.inflight[0].fence)
      self.pump()
    self.wait_fence(job.fence)

  def drain(self, timeout_ms: int | None = None) -> None:
    """Until every pending and in-flight job retired, within one overall deadline (not one per fence): MSMTimeout past it."""
    total = timeout_ms if timeout_ms is not None else self.settings.wait_timeout_ms
    end = monotonic_ns() + total * 1_000_000
    while self.pending or self.inflight:
      if self.inflight:
        left_ms = (end - monotonic_ns()) // 1_000_000
        if left_ms <= 0:
          raise MSMTimeout(f"drain of {self.path}: {len(self.inflight)} job(s) in flight (oldest fence {self.inflight[0].fence}) and "
                           f"{len(self.pending)} pending after {total} ms")
        self.wait_fence(self.inflight[-1].fence, left_ms)
      self.pump()

  def _check_open(self) -> None:
    if self.closed:
      raise RuntimeError(f"msm submitqueue of {self.path} is closed (device finalized); nothing more can be waited for")

  def device_fini(self, timeout_ms: int = FINI_DRAIN_MS) -> None:
    """Drain (briefly: tinygrad's finalize has synchronized the real work already), then close the submitqueue whatever
    happened. A failed drain is raised, not swallowed: its jobs are abandoned, and every later wait on them (queue
    finalizers, signal waits) fails at once instead of waiting out the deadline again, so a lost fence cannot hang the exit."""
    err: RuntimeError | None = None
    if not getattr(self, "closed", True):
      try:
        self.drain(timeout_ms)
      except RuntimeError as e:
        err = e
    abandoned = len(self.pending) + len(self.inflight)
    self.pending.clear()
    self.inflight.clear()
    self.closed = True
    # the VM_BIND queue stays open: buffers freed after this (tinygrad's finalizers) still unmap their ranges through it
    if getattr(self, "queue_id", 0):
      try:
        _ioctl(self.fd, u.DRM_IOCTL_MSM_SUBMITQUEUE_CLOSE, ctypes.c_uint32(self.queue_id))
      except OSError:
        pass   # the fd's close drops the queue anyway
      self.queue_id = 0
    if err is not None:
      raise RuntimeError(f"msm device teardown of {self.path}: {abandoned} job(s) abandoned: {err}") from err


class EMUIface(MSMIface):
  """MSM over the emulated render node. Only when asked for by name (DEV=EMU+QCOM): a GPU-less box must not silently emulate."""

  def __init__(self, dev, device_id: int = 0):
    from tinygrad.helpers import DEV
    if DEV.target("QCOM").interface != "EMU":
      raise RuntimeError("the EMU interface is used only when asked for: DEV=EMU+QCOM:IR3")
    super().__init__(dev, device_id)

  def _open(self):
    from backend.emu import RenderNode
    # level B (IR3 execution) is read from the environment per device, not through tinygrad's cached getenv
    node = RenderNode(strict=bool(getenv("EMU_STRICT", 1)), execute=os.environ.get("EMU_EXEC", "0") not in ("", "0"))
    self._choose_vm(node, say=False)   # the emulated node stands for an older kernel unless EMU_VM_BIND=1: doctor says which
    return node, node.path

  @property
  def node(self):
    return self.fd

  def fault_detail(self) -> str:
    return self.fd.stats.reported[-1] if self.fd.stats.reported else super().fault_detail()


class KGSLIface:
  """Marks the upstream KGSL path: tinygrad 0.14.0's own QCOMDevice runs it unchanged."""

  renderer_names = ("CL", "IR3")

  def __init__(self, dev, device_id: int = 0):
    if not os.path.exists("/dev/kgsl-3d0"):
      raise RuntimeError("no /dev/kgsl-3d0 (not a KGSL kernel)")
