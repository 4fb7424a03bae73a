"""Every kernel of a loaded QCOM program timed on its own, by the GPU's own clock, and (on the emulated node) its executed work.

On a device the time of each kernel is what tinygrad's QCOM queue reads around it: CP_REG_TO_MEM of the always-on counter
(19.2 MHz) before and after the dispatch, in one submit that waits for it; the kernels run one by one, outside their graph,
each `repeat` times, and the fastest counts (the first run of a kernel warms its caches and instruction fetch).
On the emulated node (EMU) that counter is the host's clock, which times the interpreter, not an a630: there each kernel is
executed (level B) and its time is the cost model's for the work it executed (`a630_cost`, under `emu_constants`), so
the same code runs end to end and a fit of its output must find `emu_constants` again.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backend import a630_cost as ac


@dataclass(frozen=True)
class KernelTime:
  index: int                     # position among the program's kernel launches, in order
  kernel: str
  global_size: tuple[int, ...]   # workgroups (tinygrad's global size)
  local_size: tuple[int, ...]
  measured_us: float
  work: ac.Work | None           # executed work (emulated node only)
  variant_of: int | None = None  # a register-tile variant of the launch at this index, run on its buffers
  opts: list | None = None       # the variant's tinygrad opts


class Recorder:
  """Keeps the inputs of a captured JIT's last call, so its kernels can be run again one by one over the same buffers."""

  def __init__(self, jit):
    from tinygrad.engine.jit import CapturedJit
    self.jit, self.inputs, self.var_vals, self.called = jit, (), {}, False
    cap = jit.captured
    rec = self

    class _Recording(CapturedJit):   # type: ignore[type-arg]
      def __call__(self, input_uops, var_vals):
        rec.inputs, rec.var_vals, rec.called = tuple(input_uops), dict(var_vals), True
        return super().__call__(input_uops, var_vals)
    cap.__class__ = _Recording


def regs_of(dispatch) -> int:
  """vec4 registers per fiber of a recorded dispatch, from the footprints its launch wrote into SP_CS_CNTL_0 (tinygrad sets
  them from IR3's max_reg + 1 and max_half_reg + 1; two half registers take the room of one full one)."""
  from tinygrad.runtime.autogen import mesa

  from backend.emu.pm4 import field
  v = dispatch.regs.get(mesa.REG_A6XX_SP_CS_CNTL_0, 0)
  full, half = field(v, "A6XX_SP_CS_CNTL_0_FULLREGFOOTPRINT"), field(v, "A6XX_SP_CS_CNTL_0_HALFREGFOOTPRINT")
  return full + (half + 1) // 2


def work_of(name: str, counts, dispatch) -> ac.Work:
  """The cost model's Work of one executed dispatch: the emulator's counts and the launch's shape and registers."""
  groups, local = tuple(int(x) for x in dispatch.groups), tuple(int(x) for x in dispatch.local_size)
  return ac.Work(name, counts.alu, counts.sfu, counts.tex, counts.mem_load + counts.mem_store, counts.fibers, groups[0] * groups[1] * groups[2],
                 local[0] * local[1] * local[2], regs=regs_of(dispatch))


def kernel_calls(captured, inputs: tuple) -> list[tuple[Any, tuple]]:
  """The program launches of a captured JIT in order, its graphs opened up (copies left out), each with the buffers its
  parameters refer to (a graph's inner launches number their parameters by the graph call's arguments)."""
  from tinygrad.engine.realize import resolve_params
  from tinygrad.uop.ops import Ops
  out = []
  for call in captured.linear.src:
    ast = call.src[0]
    if ast.op is Ops.CUSTOM_FUNCTION and ast.arg == "graph":
      inner_inputs = tuple(resolve_params(call, inputs))
      out += [(c, inner_inputs) for c in ast.src[0].src if c.op is Ops.CALL and c.src[0].op is Ops.PROGRAM]
    elif ast.op is Ops.PROGRAM:
      out.append((call, inputs))
  return out


def lib_key(lib: bytes) -> str:
  """What a register-tile variant is matched to an artifact's kernel by: its IR3 binary (the same bytes are the same kernel)."""
  return hashlib.sha256(bytes(lib)).hexdigest()[:16]


def params_sig(prg) -> list[str]:
  """The parameters a compiled PROGRAM binds, as its runtime reads them (tinygrad's to_elf signature: name, slot, dtype,
  shape of each buffer). Two tiles of one kernel can differ here: a buffer read through a texture in one is read with
  ldg in another, and the launch binds it accordingly, so a binary only stands in for one of the same signature."""
  from tinygrad.uop.ops import AddrSpace, Ops
  return [f"{u.arg.name}:{u.arg.slot}:{u.dtype}:{u._shape}" for u in prg.src[1].src if u.op is Ops.PARAM and u.addrspace != AddrSpace.ALU]


def _variant_call(call, launch: dict[str, Any]):
  """The kernel call with another compiled variant of the same kernel (same AST, so the same parameters): its IR3 binary,
  name and launch shape in place of the original's."""
  from dataclasses import replace
  prg = call.src[0]
  info = replace(prg.arg, name=launch["name"], global_size=tuple(launch["groups"]), local_size=tuple(launch["local"]))
  binary = prg.src[3].replace(arg=bytes.fromhex(launch["lib"]))
  return call.replace(src=(prg.replace(src=(*prg.src[:3], binary, *prg.src[4:]), arg=info), *call.src[1:]))


def time_kernels(recorders: list[Recorder], device: str, repeat: int = 5, emu_constants: ac.Constants = ac.DEFAULT,
                 variants: dict[str, list[dict[str, Any]]] | None = None) -> list[KernelTime]:
  """Each kernel launch of the recorded JITs that were called since recording began, run alone `repeat` times. `variants`
  (lib_key of a compiled kernel -> the launches of its register-tile variants, compile/tuning/qcom_tiles.py): where a
  launch is one of them, the others with its parameter signature run on the same buffers right after it, once per
  kernel, as rows of their own (one of another signature would bind a buffer the wrong way: a GPU fault)."""
  from tinygrad import Device
  from tinygrad.engine.realize import ExecContext, pm_exec
  dev: Any = Device[device]
  node = getattr(dev.iface, "node", None)
  out: list[KernelTime] = []
  seen: list = []
  done: set[str] = set()

  def timed(call, ctx, name: str, var_vals, variant_of: int | None = None, opts=None) -> None:
    times, work = [], None
    for _ in range(1 if node is not None else repeat):
      seen.clear()
      ets = pm_exec.rewrite(call, ctx) or []
      if node is None:
        times.append(min(float(t) for t in ets if t is not None) * 1e6)
        continue
      dev.synchronize()
      if len(seen) != 1 or not node.counts:
        raise RuntimeError(f"kernel {name}: expected one executed dispatch, saw {len(seen)}")
      work = work_of(name, node.counts[-1][1], seen[0])
      times.append(ac.dispatch_us([work], emu_constants)[0])
    gs, ls = call.src[0].arg.launch_dims(var_vals)
    out.append(KernelTime(len(out), name, tuple(int(x) for x in gs), tuple(int(x) for x in ls or ()), min(times), work, variant_of, opts))

  if node is not None:
    node.on_dispatch = seen.append
    node.set_execute(True)
  try:
    for rec in recorders:
      if not rec.called:
        continue   # not part of a frame (openpilot's warp-only call on a dropped frame)
      for call, inputs in kernel_calls(rec.jit.captured, rec.inputs):
        ctx = ExecContext(rec.var_vals, inputs, update_stats=False, jit=True, wait=True)
        prg = call.src[0].arg
        timed(call, ctx, str(getattr(prg, "function_name", None) or getattr(prg, "name", "?")), rec.var_vals)
        key = lib_key(call.src[0].src[3].arg)
        if variants and key in variants and key not in done:
          done.add(key)
          at = len(out) - 1
          for launch in variants[key]:
            if launch["lib_key"] != key and launch.get("sig") == params_sig(call.src[0]):
              timed(_variant_call(call, launch), ctx, launch["name"], rec.var_vals, at, launch.get("opts"))
  finally:
    if node is not None:
      node.on_dispatch = None
      node.set_execute(False)
  return out


def fit_kernels(times: list[KernelTime], params: list[str] | None = None, prior: float = 0.01) -> tuple[ac.Constants, list[tuple[str, float, float]]]:
  """The unsourced constants fitted to per-kernel times (those with executed work), and each kernel's residual
  (kernel, measured us, fitted us)."""
  pts = [ac.Point(t.kernel, t.measured_us, (t.work,)) for t in times if t.work is not None and t.measured_us > 0]
  if not pts:
    raise ValueError("no kernel has both a time and its executed work")
  fitted = ac.fit(pts, params or list(ac.UNSOURCED), prior=prior)
  return fitted, [(p.source, p.measured_us, ac.frame_us(list(p.work), fitted)) for p in pts]


def executed(dev: Any, fn: Callable[[], Any]) -> tuple[Any, list[tuple[str, Any, Any]]]:
  """fn() on the emulated node with execution on (level B), the device synchronized after it: (what fn returned, every
  dispatch it executed in ring order as (kernel, executed counts, the dispatch as recorded))."""
  node = dev.iface.node
  seen: list = []
  ran: collections.deque = collections.deque()
  kept, was = node.counts, node.execute
  node.counts, node.on_dispatch = ran, seen.append
  node.set_execute(True)
  try:
    out = fn()
    dev.synchronize()
  finally:
    node.counts, node.on_dispatch = kept, None
    node.set_execute(was)
  if len(ran) != len(seen) or not seen:
    raise RuntimeError(f"executed {len(ran)} of {len(seen)} dispatches")
  return out, [(name, c, d) for (name, c), d in zip(ran, seen)]


def time_frames(frame: Callable[[int], Any], device: str, n: int, emu_constants: ac.Constants = ac.DEFAULT) -> tuple[list[float], list[bytes]]:
  """Frames 0..n-1 as the process serves them (`frame(i)` uploads input i, runs the program's graphs in their chunked
  submits and reads the outputs back), after one untimed frame 0 that binds the graphs. -> (each frame's ms, each
  frame's outputs as bytes). On a device a frame's time is the host's wall clock around it, what modeld reports as its
  model time. On the emulated node the frames are executed and a frame's time is the cost model's for the dispatches
  it ran (under `emu_constants`), which the kernels timed alone must add up to."""
  from tinygrad import Device
  dev: Any = Device[device]
  if getattr(dev.iface, "node", None) is not None:
    executed(dev, functools.partial(frame, 0))
    outs, ms = [], []
    for i in range(n):
      out, ran = executed(dev, functools.partial(frame, i))
      ms.append(sum(ac.dispatch_us([work_of(name, c, d) for name, c, d in ran], emu_constants)) / 1e3)
      outs.append(out.tobytes())   # the raw outputs, a numpy array
    return ms, outs
  frame(0)
  ms, outs = [], []
  for i in range(n):
    t = time.perf_counter()
    out = frame(i)
    dev.synchronize()
    ms.append((time.perf_counter() - t) * 1e3)
    outs.append(out.tobytes())
  return ms, outs
