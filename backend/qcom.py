"""tinygrad 0.14.0's QCOM device with kernel interfaces: KGSL (upstream, untouched), MSM and EMU.

The MSM/EMU path reuses QCOM's program, queue, args and graph code. Only what differs at the kernel interface lives here:
allocation (GEM), submission (GEM_SUBMIT with a per-submit BO table, chunked graphs), waits (WAIT_FENCE), and the
places where 0.14.0 uses a GPU address as a CPU pointer. Those places (QCOMComputeQueue.exec, QCOMArgsState.__init__,
QCOMProgram.__init__) run upstream's own code with `to_mv`/`ctypes.memset` bound to a translation that maps an IOVA to its
CPU mapping through the interface's interval index (and refuses anything that is not a live GPU buffer), so the packets
they emit stay exactly upstream's.
"""
from __future__ import annotations

import array
import collections
import contextlib
import contextvars
import ctypes
import dataclasses
import functools
import os
import sys
import types
from typing import Any

from tinygrad.device import BufferSpec, Compiled, Compiler
from tinygrad.helpers import IMAGE, prod, round_up, suppress_finalizing, to_mv
from tinygrad.renderer import Renderer
from tinygrad.renderer.nir import IR3Renderer
from tinygrad.runtime import ops_qcom as up
from tinygrad.runtime.support.hcq import HCQBuffer, HCQCompiled, MMIOInterface
from tinygrad.uop.ops import UOp

from backend import a630_cost, chunking
from backend.msm import EMUIface, GemBuffer, Job, KGSLIface, MSMFault, MSMIface, MSMTimeout

_IFACE: contextvars.ContextVar[MSMIface] = contextvars.ContextVar("msm_iface")
CONST_WINDOW = 0x1000   # CP_LOAD_STATE6 reads 256 vec4 of constants whatever the kernel's kernargs size


def _to_cpu_mv(addr, size: int) -> memoryview:
  return to_mv(_IFACE.get().cpu_addr(int(addr), size), size)


_ctypes_translated = types.SimpleNamespace(memset=lambda addr, c, n: ctypes.memset(_IFACE.get().cpu_addr(int(addr), n), c, n))


def _rebind(fn, **names):
  """fn's own code object with some global names rebound (upstream's code runs unchanged; only its CPU-pointer helpers differ)."""
  new = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__, fn.__closure__)
  new.__kwdefaults__, new.__qualname__ = fn.__kwdefaults__, fn.__qualname__
  return new


@contextlib.contextmanager
def _cpu_pointers(iface: MSMIface):
  tok = _IFACE.set(iface)
  try:
    yield
  finally:
    _IFACE.reset(tok)


# an executing emulator runs a full-model step in tens of seconds (more on a loaded box), and the timeline signal moves only when
# the whole graph is done: tinygrad's 30 s default would call that a hang
EXEC_WAIT_TIMEOUT_MS = 30 * 60 * 1000


class MSMSignal(up.QCOMSignal):
  def wait(self, value: int, timeout: int | None = None):
    if timeout is None and self.owner is not None and getattr(getattr(self.owner.iface, "node", None), "execute", False):
      timeout = int(os.environ.get("HCQDEV_WAIT_TIMEOUT_MS", EXEC_WAIT_TIMEOUT_MS))
    return super().wait(value, timeout)

  def _sleep(self, time_spent_since_last_sleep_ms: int):
    if self.is_timeline and self.owner is not None:
      self.owner.iface.sleep()


class MSMArgsState(up.QCOMArgsState):
  def __init__(self, buf: HCQBuffer, prg, bufs, vals=()):
    with _cpu_pointers(prg.dev.iface):
      _ARGS_INIT(self, buf, prg, bufs, vals)



class _Chunk:
  """One GEM_SUBMIT of a bound queue: a dword range of its commands and what that range references."""

  def __init__(self, start: int, end: int, gems: list[GemBuffer], syms: list[int], sigs: list):
    self.offset, self.size, self.gems, self.syms, self.sigs = start * 4, (end - start) * 4, gems, syms, sigs
    self.handles = {g.handle for g in gems}
    self.packed = b"".join(g.packed for g in gems)


# MSM_INDEPENDENT_NO_WFI=1: a graph's dispatch that shares no buffer hazard with the dispatches since the last wait for idle
# runs without its CP_WAIT_FOR_IDLE (docs/a630-time.md "Lever: wait-for-idle"); off by default until a device run confirms it
NO_WFI_ENV = "MSM_INDEPENDENT_NO_WFI"
_WFI_HDR = up.pkt7_hdr(up.mesa.CP_WAIT_FOR_IDLE, 0)
_NOP_HDR = up.pkt7_hdr(up.mesa.CP_NOP, 0)   # same length: positions recorded for later patches stay where they were
_RESET = None   # a wait for idle the queue always keeps (signal, timestamp, memory barrier): nothing is in flight after it


@dataclasses.dataclass(frozen=True)
class Access:
  """What one dispatch reads and writes: (address, size) of each buffer; a graph input's address is its variable."""
  kernel: str
  read: frozenset
  written: frozenset

  def conflicts(self, other: Access) -> bool:
    return _overlap(self.written, other.read | other.written) or _overlap(self.read, other.written)


def _overlap(a: frozenset, b: frozenset) -> bool:
  for x, xs in a:
    for y, ys in b:
      if isinstance(x, int) and isinstance(y, int):
        if x < y + ys and y < x + xs:
          return True
      elif not isinstance(x, int) and not isinstance(y, int):
        return True   # two graph inputs may be the same buffer at run time
      # a graph input against a buffer of the graph's own: tinygrad allocated the latter for this graph alone
  return False


def _graph_access(prg: Any, args_state: Any) -> Access | None:
  """The dispatch's reads and writes when HCQGraph is encoding it (its loop's `ast` names the kernel's outputs and inputs);
  None otherwise (a lone kernel call: its queue signals right after, with a wait for idle)."""
  f = sys._getframe(2)   # 0: here, 1: MSMComputeQueue.exec, 2: its caller
  ast, runtime = f.f_locals.get("ast"), f.f_locals.get("runtime")
  name, spills, stack = prg.name, prg.pvtmem_size_total, prg.dev._stack
  if runtime is not prg or ast is None or not hasattr(ast.arg, "outs"):
    return None
  bufs = args_state.bufs
  key = [(b.va_addr if isinstance(b.va_addr, UOp) else int(b.va_addr), int(b.size)) for b in bufs]
  outs = set(ast.arg.outs)
  written = {key[i] for i in outs}
  if spills:   # spilled registers live in the device's one stack: two such dispatches must not overlap
    written.add((int(stack.va_addr), int(stack.size)))
  return Access(name, frozenset(key[i] for i in range(len(key)) if i not in outs), frozenset(written))


class MSMComputeQueue(up.QCOMComputeQueue):
  """QCOM's compute queue; records every buffer and signal its commands reference, by dword position, for the BO tables."""

  def __init__(self, dev):
    super().__init__(dev)
    self._no_wfi = os.environ.get(NO_WFI_ENV, "0") == "1"
    self._waits: list[tuple[int, Access | None]] = []   # (dword of a CP_WAIT_FOR_IDLE, the dispatch it precedes or _RESET)
    self.waits_dropped = 0
    self.iface: MSMIface = dev.iface
    self._refs: list[tuple[int, GemBuffer | int]] = []   # (dword position, GemBuffer or index of a symbolic address)
    self._sigs: list[tuple[int, int | UOp, int | UOp]] = []
    self._exec_ends: list[int] = []
    self._exec_names: list[str] = []
    self._chunks: list[_Chunk] = []
    self._last_job: Job | None = None
    self._var_vals: dict[str, int] = {}

  def _ref(self, buf: HCQBuffer):
    va = buf.va_addr
    self._refs.append((len(self._q), self._new_sym(va) if isinstance(va, UOp) else self.iface.gem_at(va)))

  def signal(self, signal, value=0):
    self._ref(signal.base_buf)
    self._sigs.append((len(self._q), signal.value_addr, value))
    self._waits.append((len(self._q), _RESET))
    return super().signal(signal, value)

  def timestamp(self, signal):
    self._ref(signal.base_buf)
    self._waits.append((len(self._q), _RESET))
    return super().timestamp(signal)

  def memory_barrier(self):
    self._waits.append((len(self._q), _RESET))
    return super().memory_barrier()

  def wait(self, signal, value=0):
    self._ref(signal.base_buf)
    return super().wait(signal, value)

  def exec(self, prg, args_state, global_size, local_size):
    for b in (args_state.buf, prg.lib_gpu, prg.dev._stack, *args_state.bufs, *([prg.dev.border_color_buf] if prg.samp_cnt else [])):
      self._ref(b)
    start = len(self._q)
    access = _graph_access(prg, args_state) if self._no_wfi else None
    with _cpu_pointers(self.iface):
      _EXEC(self, prg, args_state, global_size, local_size)
    if access is not None and (pos := self._wait_in(start)) is not None:
      self._waits.append((pos, access))
    self._exec_ends.append(len(self._q))
    self._exec_names.append(prg.name)
    return self

  def _wait_in(self, start: int) -> int | None:
    """The dword of the CP_WAIT_FOR_IDLE that upstream's exec emitted from `start` on (walking packet headers)."""
    i = start
    while i < len(self._q):
      h = self._q[i]
      if not isinstance(h, int):
        return None
      if h == _WFI_HDR:
        return i
      i += 1 + (h & 0x3fff if h >> 28 == 7 else h & 0x7f if h >> 28 == 4 else 1 << 30)
    return None

  def _drop_waits(self, cuts: list[int]) -> None:
    """Turns into NOPs the waits for idle before dispatches that conflict with nothing still in flight. A submit's first
    dispatch keeps its wait (what the kernel does between submits is not ours to rely on), as does any dispatch after a
    signal, timestamp or barrier (they wait for idle themselves)."""
    in_flight: list[Access] = []
    chunk = 0
    for pos, access in self._waits:
      first = False
      while chunk + 1 < len(cuts) and pos >= cuts[chunk + 1]:
        chunk, first = chunk + 1, True
      if access is None:
        in_flight = []
      elif first or any(access.conflicts(a) for a in in_flight):
        in_flight = [access]
      else:
        if in_flight:   # the wait after a reset (nothing in flight) costs nothing: keep the packet as upstream wrote it
          self._q[pos] = _NOP_HDR
          self.waits_dropped += 1
          self.iface.stats["waits_dropped"] += 1
        in_flight.append(access)

  # *** BO tables ***

  def submit(self, dev, var_vals: dict[str, int] | None = None):
    # patching a bound queue rewrites its commands and kernargs in place: never under a job that may still read them
    if self._last_job is not None and not (self._last_job.fence and self.iface.is_retired(self._last_job.fence)):
      self.iface.wait_job(self._last_job)
    self._var_vals = var_vals or {}
    return super().submit(dev, var_vals)

  def _plan(self, dev, n: int, chunk_kernels: int | None) -> list[_Chunk]:
    """chunk_kernels None: one submit for the whole stream."""
    cuts = [0, n] if chunk_kernels is None else chunking.cuts(self._exec_ends, self._exec_names, n, chunk_kernels)
    chunks = []
    for a, b in zip(cuts, cuts[1:]):
      gems: dict[int, GemBuffer] = {dev.dummy_gem.handle: dev.dummy_gem}   # the flush event's target, in every chunk
      syms: list[int] = []
      for pos, r in self._refs:
        if a <= pos < b or (b == n and pos >= n):
          if isinstance(r, int):
            if r not in syms:
              syms.append(r)
          else:
            gems.setdefault(r.handle, r)
      chunks.append(_Chunk(a, b, list(gems.values()), syms, [(addr, val) for pos, addr, val in self._sigs if a <= pos < b or (b == n and pos >= n)]))
    return chunks

  def _job(self, iface: MSMIface, cmd: GemBuffer, ch: _Chunk) -> Job:
    table, gems, nr = bytearray(cmd.packed) + ch.packed, [], 1 + len(ch.gems)
    seen = ch.handles
    for idx in ch.syms:
      g = iface.gem_at(int(self._prev_resolved_syms[idx] or 0))
      if g.handle not in seen and g is not cmd:
        seen = seen | {g.handle}
        table += g.packed
        gems.append(g)
        nr += 1
    # signal writes are resolved only if a recovery needs them (sym_infer is too slow for every submit)
    return Job(cmd, ch.offset, ch.size, table, nr, gems, ch.sigs, var_vals=self._var_vals)

  def bind(self, dev):
    if self._no_wfi and self._waits:
      self._drop_waits(chunking.cuts(self._exec_ends, self._exec_names, len(self._q), dev.iface.settings.chunk_kernels))   # as _plan cuts
    self.binded_device = dev
    self.hw_page = dev.allocator.alloc(len(self._q) * 4, BufferSpec(cpu_access=True, nolru=True))
    words = self.hw_page.cpu_view().view(size=len(self._q) * 4, fmt="I")
    words.mv[:] = array.array("I", self._q)
    n, self._q = len(self._q), words   # from now on patches write the device copy, through its CPU mapping
    self._cmd_gem = dev.iface.gem_at(self.hw_page.va_addr)
    self._chunks = self._plan(dev, n, dev.iface.settings.chunk_kernels)
    self._pinned = list({g.handle: g for ch in self._chunks for g in ch.gems}.values())
    for g in self._pinned:
      g.pins += 1

  def _submit(self, dev):
    iface: MSMIface = dev.iface
    if self.binded_device is dev:
      for ch in self._chunks:
        iface.enqueue(job := self._job(iface, self._cmd_gem, ch))
      self._last_job = job
      return
    n = len(self._q)
    off = dev.cmd_ring.alloc(n * 4)
    dev.cmd_buf.cpu_view().view(off, n * 4, fmt="I").mv[:] = array.array("I", self._q)
    job = self._job(iface, dev.cmd_gem, ch := self._plan(dev, n, None)[0])
    job.offset, job.gems = off, ch.gems + job.gems   # not pinned by anyone: the job's fence is what keeps them open
    dev.cmd_ring.used.append((off, off + n * 4, job))
    iface.enqueue(job)

  @suppress_finalizing
  def __del__(self):
    if self.binded_device is not None:
      iface = self.binded_device.iface
      if self._last_job is not None:
        iface.wait_job(self._last_job)
      for g in getattr(self, "_pinned", []):
        iface.unpin(g)
    super().__del__()


class CmdRing:
  """Command space for unbound queues. A range is handed out again only after the job that used it retired."""

  def __init__(self, iface: MSMIface, size: int):
    self.iface, self.size, self.head = iface, size, 0
    self.used: collections.deque[tuple[int, int, Job]] = collections.deque()

  def alloc(self, n: int) -> int:
    n = round_up(n, 64)
    if n > self.size:
      raise RuntimeError(f"a {n}-byte command stream does not fit the {self.size}-byte command buffer")
    if self.head + n > self.size:
      self.head = 0
    start, end = self.head, self.head + n
    while self.used and self.used[0][2].fence and self.iface.is_retired(self.used[0][2].fence):
      self.used.popleft()
    last = max((i for i, (s, e, _) in enumerate(self.used) if s < end and start < e), default=None)
    if last is not None:
      self.iface.wait_job(self.used[last][2])
      for _ in range(last + 1):
        self.used.popleft()
    self.head = end
    return start


class MSMProgram(up.QCOMProgram):
  def __init__(self, dev, obj):
    with _cpu_pointers(dev.iface):
      _PROGRAM_INIT(self, dev, obj)
    if (node := getattr(dev.iface, "node", None)) is not None:
      node.kernel_names[int(self.lib_gpu.va_addr)] = self.name   # so the emulator's faults name the kernel

  def __call__(self, *bufs, global_size=(1, 1, 1), local_size=(1, 1, 1), vals=(), wait=False, timeout=None):
    # tinygrad picks each kernel's local size by timing candidate launches on scratch buffers. On the emulated node those
    # times are the interpreter's, not the a630's (so the choice was noise, and a full-model capture spent 20+ minutes
    # executing them): answer with the a630 model's time instead, without executing. Deterministic, so captures repeat.
    # (backend/local_size.py normally chooses first, among more candidates; this answers any search that still runs.)
    if wait and getattr(self.dev.iface, "node", None) is not None and _called_by_local_size_search():
      # what the launch itself would refuse: too many fibers, or a local size that does not divide the global one
      if self.max_threads < prod(local_size) or max(local_size) > 1024 or any(g != int(g) for g in global_size):
        raise RuntimeError(f"launch {global_size=} {local_size=} cannot run")
      return modelled_launch_s(global_size, local_size)
    return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait, timeout=timeout)


def modelled_launch_s(global_size, local_size) -> float:
  """A launch's relative a630 cost by its shape (`global_size` in workgroups, as tinygrad launches): the cost model's
  `shape_cost`, the one backend/local_size.py ranks candidates by. Only the ranking matters."""
  return a630_cost.shape_cost(int(prod(global_size)), int(prod(local_size))) * 1e-9


_REALIZE_FILE = os.path.join("tinygrad", "engine", "realize.py")


def _called_by_local_size_search(depth: int = 6) -> bool:
  """Whether this launch comes from tinygrad's local-size search (its `try_exec`, a few runtime wrappers up)."""
  f: types.FrameType | None = sys._getframe(2)   # 0: here, 1: MSMProgram.__call__
  for _ in range(depth):
    if f is None:
      return False
    # by file: tinygrad's pattern matcher re-executes matched functions, so their globals lose the module name
    if f.f_code.co_name == "try_exec" and f.f_code.co_filename.endswith(_REALIZE_FILE):
      return True
    f = f.f_back
  return False


class MSMAllocator(up.QCOMAllocator):
  def _alloc(self, size: int, opts: BufferSpec) -> HCQBuffer:
    if opts.external_ptr:
      raise RuntimeError("msm has no userptr: host pointers cannot be mapped; allocate a QCOM buffer and copy instead")
    # kernargs live in cpu_access buffers and the constant load always reads a 4 KiB window: keep that window inside the BO
    return self.dev._gpu_alloc(size, tail=CONST_WINDOW if opts.cpu_access else 0)


_EXEC = _rebind(up.QCOMComputeQueue.exec, to_mv=_to_cpu_mv)
_ARGS_INIT = _rebind(up.QCOMArgsState.__init__, to_mv=_to_cpu_mv, ctypes=_ctypes_translated)
_PROGRAM_INIT = _rebind(up.QCOMProgram.__init__, to_mv=_to_cpu_mv, QCOMArgsState=MSMArgsState)


NO_IR3_COMPILER = ("Mesa's IR3 compiler (the tinymesa wheel, x86_64 only) is not installed: this Python can load and run programs "
                   "compiled off the car, not compile new ones; compile the artifact on an x86_64 machine (`modeld-msm compile --device QCOM`)")


class _NoIR3Compiler(Compiler):
  def compile(self, src: str) -> bytes:
    raise RuntimeError(NO_IR3_COMPILER)


class _IR3Loader(IR3Renderer):
  """IR3 where Mesa's compiler is absent (the car: tinymesa has no aarch64 wheel). tinygrad's renderer builds the compiler
  when it is made, through the Mesa library, and QCOMProgram makes it only to ask whether programs are IR3; it unpacks their
  headers with tinygrad's own ctypes structs. So this stand-in answers that question and refuses to render or compile.
  Used only where the Mesa library did not load (tinygrad loads it when ops_qcom is imported, and says nothing if absent)."""

  def __init__(self, target):
    Renderer.__init__(self, target)
    self.compiler = _NoIR3Compiler()

  def __del__(self):
    pass   # no Mesa type singletons were taken

  def render(self, uops):
    raise RuntimeError(NO_IR3_COMPILER)


_IR3Loader.__name__ = "IR3Renderer"   # tinygrad picks renderers by class name (DEV=...:IR3)


def ir3_compiler_present() -> bool:
  """Mesa's IR3 compiler library loaded (tinygrad tries when ops_qcom is imported): new kernels can be compiled here."""
  return up.mesa.dll.nm in up.mesa.dll._loaded_


def ir3_renderer() -> type[IR3Renderer]:
  return IR3Renderer if ir3_compiler_present() else _IR3Loader


class QCOMDevice(up.QCOMDevice):
  """`Device["QCOM"]`: picks a kernel interface the tinygrad way (DEV=KGSL+QCOM, DEV=MSM+QCOM, DEV=EMU+QCOM:IR3; else the first that opens).
  KGSL returns tinygrad's own QCOMDevice, untouched."""

  ifaces = [KGSLIface, MSMIface, EMUIface]
  iface: MSMIface
  _iface_chosen: MSMIface

  def __new__(cls, device: str = ""):
    self = object.__new__(cls)
    iface = Compiled._select_iface(self, device)
    if isinstance(iface, KGSLIface):
      return up.QCOMDevice(device)
    self._iface_chosen = iface
    return self

  def __init__(self, device: str = ""):
    self.iface: MSMIface = self.__dict__.pop("_iface_chosen")
    self.iface.dev, self.fd, self.gpu_id, self.last_cmd = self, self.iface.fd, self.iface.gpu_id, 0
    if self.gpu_id[:2] >= (7, 3):
      raise RuntimeError(f"Unsupported GPU: chip_id={self.iface.chip_id:#x}")
    self.dummy_buf = self._gpu_alloc(0x1000)
    self.dummy_addr, self.dummy_gem = int(self.dummy_buf.va_addr), self.dummy_buf.meta
    self.cmd_buf = self._gpu_alloc(16 << 20)
    self.cmd_gem, self.cmd_ring = self.cmd_buf.meta, CmdRing(self.iface, 16 << 20)
    self.border_color_buf = self._gpu_alloc(0x1000, fill_zeroes=True)
    queue_t = functools.partial(MSMComputeQueue, self)
    HCQCompiled.__init__(self, device, MSMAllocator(self, batch_cnt=0), [ir3_renderer()], MSMProgram, MSMSignal, queue_t,
                         arch=("a%d%d%d" + (",IMAGE_PITCH_ALIGNMENT=64" if IMAGE else "")) % self.gpu_id)

  def _gpu_alloc(self, size: int, flags: int = 0, uncached=False, fill_zeroes=False, tail: int = 0) -> HCQBuffer:
    gem = self.iface.alloc(size + tail)
    if fill_zeroes:
      ctypes.memset(gem.cpu, 0, size)
    return HCQBuffer(gem.iova, size, meta=gem, view=MMIOInterface(gem.cpu, size, fmt="B"), owner=self)

  def _gpu_map(self, ptr: int, size: int) -> HCQBuffer:
    raise RuntimeError("msm has no userptr: host pointers cannot be mapped")

  def _gpu_free(self, mem: HCQBuffer):
    self.iface.free(mem.meta)

  def _ensure_stack_size(self, sz):
    # graphs bound earlier still point at the old stack: it goes through free(), which waits for their pins and fences
    if not hasattr(self, "_stack"):
      self._stack = self._gpu_alloc(sz)
    elif self._stack.size < sz:
      old, self._stack = self._stack, self._gpu_alloc(sz)
      self._gpu_free(old)

  def synchronize(self, timeout: int | None = None):
    try:
      super().synchronize(timeout)
    except (MSMFault, MSMTimeout):
      self.error_state = None   # reported once: the interface completed the lost signal writes (or the fence may still retire)
      raise

  def _at_profile_finalize(self):
    HCQCompiled._at_profile_finalize(self)
