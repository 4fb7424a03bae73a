"""The checks a compile runs before anything is written: each model through tinygrad against onnxruntime on the raw
ONNX, and a sequence of steps run through the unjitted program, the JITs and the reloaded pickles, bit for bit."""
from __future__ import annotations

from typing import Any

import numpy as np

from compile import preflight
from compile.capture import emu_node
from compile.metres import describe, metres_apart
from compile.onnx_model import OnnxModelInfo
from compile.report import CompileReport
from selfdrive_glue.errors import UserError

# fp16 graphs: each op rounds to 11 significant bits and the two runtimes order reductions differently, so compare with
# a tolerance scaled to fp16 precision: |a - b| <= ATOL + RTOL * |ref| elementwise
ORT_RTOL, ORT_ATOL = 2e-2, 2e-2

def ort_check(info: OnnxModelInfo, runner, rng: np.random.Generator, report: CompileReport, sess=None) -> None:
  from tinygrad import Tensor
  sess = sess or preflight.ort_session(info)
  worst = 0.0
  apart: dict[str, float] = {}
  for _ in range(2):
    feeds = {}
    for name, shape in info.input_shapes.items():
      dt = np.dtype(info.input_dtypes[name])
      feeds[name] = rng.integers(0, 256, shape, dtype=np.uint8) if dt == np.uint8 else rng.standard_normal(shape).astype(dt)
    ref = sess.run(None, feeds)[0].astype(np.float32)
    # inputs enter as the program feeds them (fp32 host data cast on the device): tinygrad 0.14's IR3 path fails to verify
    # the policy graph fed fp16 tensors built from numpy directly (a WHERE mixing half and float)
    # (an fp32-widened runner takes the same values in fp32, exactly)
    want = {k: v.dtype for k, v in runner.graph_inputs.items()}
    inputs = {k: Tensor(v.astype(np.float32)).cast(want[k]) if v.dtype == np.float16 else Tensor(v) for k, v in feeds.items()}
    got = next(iter(runner(inputs).values())).float().numpy()
    if not np.isfinite(got).all():
      raise UserError(f"{info.kind} model produces non-finite outputs under tinygrad; check the model file")
    excess = np.abs(got - ref) - (ORT_ATOL + ORT_RTOL * np.abs(ref))
    worst = max(worst, float(np.abs(got - ref).max()))
    for k, v in metres_apart(got, ref, info.output_slices).items():
      apart[k] = max(apart.get(k, 0.0), v)
    if (excess > 0).any():
      i = int(np.argmax(excess))
      where = _locate(lambda feed=inputs: next(iter(runner(feed).values())).float().numpy())
      raise UserError(f"{info.kind} model: tinygrad and onnxruntime disagree at output {i}: {got.flat[i]:.5g} vs {ref.flat[i]:.5g} "
                      f"(tolerance {ORT_ATOL} + {ORT_RTOL}*|ref|)" + (f"; {where}" if where else ""))
  where = "in the driver's face" if "face_orientation_deg" in apart else "on the road"
  metres = f"; {where}: {describe(apart)}" if apart else ""
  report.checks.append((f"{info.kind} vs onnxruntime", "ok", f"max |diff| {worst:.3g} (tol {ORT_ATOL}+{ORT_RTOL}*|ref|){metres}"))


def _locate(run) -> str | None:
  """On the executing emulator: the first kernel whose output differs from the same kernel on the CPU."""
  from tinygrad import Device
  if not getattr(node := emu_node(Device.DEFAULT), "execute", False):
    return None
  from backend.emu.ir3.locate import first_divergent_kernel
  return first_divergent_kernel(run, node)


class StepInputs(list):
  """Per step {input name: value}; keeps the numpy frames alive that CPU frame tensors alias."""

  def __init__(self, steps, buffers: list[np.ndarray]):
    super().__init__(steps)
    self.buffers = buffers


def run_plan(plan: str, inputs: list[dict[str, Any]], programs: dict[str, Any], host: dict[str, np.ndarray], host_t: dict[str, Any],
             queues: dict[str, Any]) -> list[dict[str, np.ndarray]]:
  """Run a step plan (P: the full step, W: the warp-only step of a dropped frame) over seeded inputs: each step's host values
  are written into `host` in place (the arrays the host tensors `host_t` alias), its frames passed as they are. `programs`
  are NamedPrograms by role. -> per step, every named output of a P step and the contents of every queue after the step."""
  out = []
  for i, kind in enumerate(plan):
    named: dict[str, Any] = dict(host_t)
    for k, v in inputs[i].items():
      if k in host:
        host[k][...] = v
      else:
        named[k] = v
    rec: dict[str, np.ndarray] = {}
    if kind == "P":
      rec.update({k: t.numpy().copy() for k, t in programs["step"](named).items()})
    else:
      programs["warp"](named)
    rec.update({name: q.numpy().copy() for name, q in queues.items()})
    out.append(rec)
  return out


def same_steps(plan: str, ref: list[dict[str, np.ndarray]], got: list[dict[str, np.ndarray]], what: str) -> None:
  """Every value both records of a step hold is bit-identical, else an internal error naming the step and the value."""
  for i, (r, g) in enumerate(zip(ref, got)):
    for k in (k for k in r if k in g):
      if not np.array_equal(r[k], g[k]):
        raise UserError(f"internal error: {what} differ from the unjitted program at step {i} ({plan[i]}) in {k}; please report it")


def outputs_of(plan: str, recs: list[dict[str, np.ndarray]], outputs: list[str]) -> list[list[np.ndarray]]:
  """The named outputs of each full step."""
  return [[r[o] for o in outputs] for kind, r in zip(plan, recs) if kind == "P"]
