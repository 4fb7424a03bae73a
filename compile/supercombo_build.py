"""`modeld-msm compile --model driving_supercombo.onnx`: master's combined driving model + camera size + device -> a verified
artifact of kind "supercombo" (compile/supercombo_program.py), with the driving compile's checks:
  1. the model through tinygrad matches onnxruntime on the raw ONNX (and on the road, in metres);
  2. the jitted step and warp-only programs equal the unjitted ones exactly over a plan long enough (8 runs) for this
     frame's hidden state to come back as a past feature, frames rotating through buffers, host inputs and action_t varied;
  3. the pickled JITs, loaded back, reproduce them exactly (QCOM: executed on the emulated a630, strict BO validation, the
     per-kernel a630 time estimate beside tinygrad CI's figures for this model).
modeld serves such an artifact (modeld_msm/model_state.py: one output, action_t fed from the delays) and replay replays it;
release, install and the demo do not take it yet (issue 27).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from tinygrad import Tensor

from artifact import format as art_mod
from artifact.jit_pickle import pickle_programs, unpickle_programs
from compile import one_model, preflight
from compile.build import (
  ORT_ATOL,
  ORT_RTOL,
  CompileReport,
  _Steps,
  check_out_dir,
  compile_options,
  open_capture,
  ort_check,
  replay_on_emu,
)
from compile.onnx_model import load_model_info
from compile.supercombo_program import SupercomboProgram
from modeld_msm.host_inputs import HostInputs
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import NV12Info, nv12_info

# 8 runs: from the 5th on, a past feature the program fed back itself is among the model's inputs
STEP_PLAN = "PPWPPWPPPP"
# tinygrad CI's figures for this model on a comma device (issue 27): Qualcomm's compiler, and IR3 (the open one vamOS has)
CI_MS = {"QCOM compiler": 26.0, "IR3": 41.0}


class _ComboSteps:
  """The driving compile's seeded frames and host inputs, plus an action_t per step (lateral, longitudinal delays in s)."""

  def __init__(self, nv: NV12Info, device: str, seed: int):
    self.base = _Steps(nv, device, seed)
    rng = np.random.default_rng(seed + 1)
    self.action_t = [np.array([[rng.uniform(0.1, 0.5), rng.uniform(0.3, 0.8)]], np.float32) for _ in STEP_PLAN]
    self.host = HostInputs.zeros()
    self.host_np = {k: getattr(self.host, k) for k in ("desire", "traffic_convention", "tfm", "big_tfm")}
    self.host_np["action_t"] = np.zeros((1, 2), np.float32)
    self.host_t = {**self.host.tensors(), "action_t": Tensor(self.host_np["action_t"], device="NPY")}

  def run(self, policy_fn, warp_fn, queues: dict[str, Tensor]) -> list[dict[str, np.ndarray]]:
    out = []
    for i, kind in enumerate(STEP_PLAN):
      frame, big_frame, desire, tc, tfm, big_tfm = self.base.args(i % len(self.base.host), self.host_np, self.host_t)
      self.host_np["action_t"][...] = self.action_t[i]
      args = (frame, big_frame, desire, tc, self.host_t["action_t"], tfm, big_tfm)
      rec: dict[str, np.ndarray] = {}
      if kind == "P":
        rec["out"] = policy_fn(*args).numpy().copy()
      else:
        warp_fn(*args)
      rec.update({name: q.numpy().copy() for name, q in queues.items()})
      out.append(rec)
    return out



def _same(ref: list[dict[str, np.ndarray]], got: list[dict[str, np.ndarray]], what: str) -> None:
  for i, (r, g) in enumerate(zip(ref, got)):
    for k in set(r) & set(g):
      if not np.array_equal(r[k], g[k]):
        raise UserError(f"internal error: {what} differ from the unjitted program at step {i} ({STEP_PLAN[i]}) in {k}; please report it")


def compile_supercombo_artifact(model: str | Path, camera: tuple[int, int], device: str, out_dir: str | Path, log=print,
                                precision: str = "auto", layout: str | None = None) -> CompileReport:
  compute, why, use_layout, layout_why = compile_options(device, precision, layout)
  out_dir = Path(out_dir)
  report = CompileReport(out_dir)
  t0 = time.perf_counter()
  info = load_model_info(model, "supercombo")
  sess = preflight.ort_session(info)
  report.checks.append(("model contract", "ok", f"supercombo (openpilot master) out {info.output_width}, {len(info.output_slices)} slices, "
                        + ("action head" if "action" in info.output_slices else "no action head: modeld takes the plan")))
  report.checks.append(("precision", "ok", f"{compute}: {why}; cpu layout {'on' if use_layout else 'off'} ({layout_why}); "
                        "kernel search: none shipped for this contract (tinygrad's heuristic opts)"))
  check_out_dir(out_dir, (Path(model),))
  cap = open_capture(device, log, openpilot="master")   # the combined model is master's: its IMAGE=1 build
  from tinygrad.helpers import Context
  nv = nv12_info(*camera)
  with Context(**cap.flags):
    log(f"[compile] loading master's combined driving model for {camera[0]}x{camera[1]} on {cap.capture_target} in {compute}")
    preflight.tinygrad_parse(info)
    prog = one_model.build(SupercomboProgram, info, nv, cap.dev_name, compute, use_layout, "supercombo")
    report.timings["load"] = time.perf_counter() - t0
    cap.start_execution()
    t = time.perf_counter()
    log("[compile] 1/3 tinygrad vs onnxruntime on the raw model")
    ort_check(info, prog.model, np.random.default_rng(42), report, sess)
    report.timings["onnxruntime check"] = time.perf_counter() - t

    t = time.perf_counter()
    log(f"[compile] 2/3 capturing the JITs and checking them against the unjitted program ({len(STEP_PLAN)} steps: {STEP_PLAN})")
    steps = _ComboSteps(nv, cap.dev_name, 42)
    ref = steps.run(prog.run_policy, prog.run_warp, prog.queues())
    prog.reset_queues()
    policy_jit, warp_jit = prog.jits()
    _same(ref, steps.run(policy_jit, warp_jit, prog.queues()), "the jitted programs")
    runs = [r["out"] for r in ref if "out" in r]
    if not all(np.isfinite(o).all() for o in runs):
      raise UserError("the combined model produces non-finite outputs; check the model file")
    if np.array_equal(runs[0], runs[1]):
      raise UserError("internal error: the combined program ignores its inputs; please report it")
    report.checks.append(("jit == unjitted", "ok", f"outputs and 4 queues bit-exact over {len(STEP_PLAN)} steps ({len(runs)} runs: past "
                          "features fed back on the device), rotating buffers, action_t varied"))
    report.timings["jit check"] = time.perf_counter() - t

    t = time.perf_counter()
    log("[compile] 3/3 pickling and checking the reloaded program")
    prog.reset_queues()
    policy_pkl, warp_pkl = pickle_programs(policy_jit, warp_jit)

  def replay() -> list[dict[str, np.ndarray]]:
    policy, warp = unpickle_programs(policy_pkl, warp_pkl, names=(art_mod.POLICY_PKL, art_mod.WARP_PKL))
    return steps.run(policy, warp, {})
  kernel_us: dict[str, float] = {}
  if device != "QCOM":
    _same(ref, replay(), "the reloaded programs")
    report.checks.append(("pickle reload", "ok", f"step + warp JITs reloaded: outputs bit-exact over {len(STEP_PLAN)} steps"))
  else:
    back, kernel_us = replay_on_emu(cap.dev_name, replay, len(STEP_PLAN), report)
    _same(ref, back, "the reloaded QCOM programs, executed on the emulated a630,")
    ms = sum(kernel_us.values()) / 1e3
    report.checks.append(("a630 vs tinygrad CI", "ok", f"distinct kernels {ms:.2f} ms, one run each (the frame: bench/bench_a630.py); "
                          "tinygrad CI on a comma device: "
                          + ", ".join(f"< {v:g} ms ({k})" for k, v in CI_MS.items())))
  report.timings["pickle check"] = time.perf_counter() - t

  meta: dict[str, Any] = cap.meta(camera, nv, (info,), compute, why, kernel_us, "supercombo")
  meta.update({
    "contract": "supercombo",
    "cpu_layout": {"on": use_layout, "why": layout_why, **prog.layout_rewrites},
    "cpu_threads": cap.threads,
    # h(t) is pushed into the feature queue on the device, not round-tripped through the host as master does
    "feature_feedback": "device",
    "validation": {"checks": report.checks, "ort_rtol": ORT_RTOL, "ort_atol": ORT_ATOL, "step_plan": STEP_PLAN},
  })
  art_mod.write_artifact(out_dir, {art_mod.POLICY_PKL: policy_pkl, art_mod.WARP_PKL: warp_pkl}, meta)
  report.timings["total"] = time.perf_counter() - t0
  log(f"[compile] wrote {out_dir} ({(len(policy_pkl) + len(warp_pkl)) / 1e6:.1f} MB)")
  return report
