"""Every kernel of a loaded QCOM program timed on its own, by the GPU's own clock, and (on the emulated node) its executed work.

On a device the time of each kernel is what tinygrad's QCOM queue reads around it: CP_REG_TO_MEM of the always-on counter
(19.2 MHz) before and after the dispatch, in one submit that waits for it; the kernels run one by one, outside their graph,
each `repeat` times, and the fastest counts (the first run of a kernel warms its caches and instruction fetch).
On the emulated node (EMU) that counter is the host's clock, which times the interpreter, not an a630: there each kernel is
executed (level B) and its time is the cost model's for the work it executed (`a630_cost`, under `emu_constants`), so
the same code runs end to end and a fit of its output must find `emu_constants` again.
"""
from __future__ import annotations

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


def time_kernels(recorders: list[Recorder], device: str, repeat: int = 5, emu_constants: ac.Constants = ac.DEFAULT) -> list[KernelTime]:
  """Each kernel launch of the recorded JITs that were called since recording began, run alone `repeat` times."""
  from tinygrad import Device
  from tinygrad.engine.realize import ExecContext, pm_exec
  dev: Any = Device[device]
  node = getattr(dev.iface, "node", None)
  out: list[KernelTime] = []
  seen: list = []
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
        name = str(getattr(prg, "function_name", None) or getattr(prg, "name", "?"))
        times = []
        work = None
        for _ in range(1 if node is not None else repeat):
          seen.clear()
          ets = pm_exec.rewrite(call, ctx) or []
          if node is None:
            times.append(min(float(t) for t in ets if t is not None) * 1e6)
            continue
          dev.synchronize()
          if len(seen) != 1 or not node.counts:
            raise RuntimeError(f"kernel {name}: expected one executed dispatch, saw {len(seen)}")
          d, (_, c) = seen[0], node.counts[-1]
          groups, local = tuple(int(x) for x in d.groups), tuple(int(x) for x in d.local_size)
          work = ac.Work(name, c.alu, c.sfu, c.tex, c.mem_load + c.mem_store, c.fibers, groups[0] * groups[1] * groups[2],
                         local[0] * local[1] * local[2])
          times.append(ac.dispatch_us([work], emu_constants)[0])
        gs, ls = prg.launch_dims(rec.var_vals)
        out.append(KernelTime(len(out), name, tuple(int(x) for x in gs), tuple(int(x) for x in ls or ()), min(times), work))
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
