"""`modeld-msm compile --dmonitoring`: dmonitoring_model.onnx + camera size + device -> a verified DM artifact directory.

The same checks as the driving compile (compile/build.py), on the DM program (compile/dm_program.py):
  1. the model through tinygrad matches onnxruntime on the raw ONNX (fp16-aware tolerance; the difference is also given in
     degrees of face orientation);
  2. the jitted program (warp + model) equals the unjitted one exactly over seeded frames rotating through buffers like
     VisionIPC, with calib and the warp matrix changing between frames;
  3. the pickled JIT, loaded back, reproduces them exactly (QCOM: executed on the emulated a630 through the MSM submit
     path with strict BO validation; its executed work gives the per-kernel a630 time estimate).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from artifact import format as art_mod
from artifact.jit_pickle import pickle_programs, unpickle_programs
from artifact.load import frame_tensor
from compile import one_model, preflight
from compile.build import ORT_ATOL, ORT_RTOL, CompileReport, check_out_dir, compile_options, open_capture, ort_check, replay_on_emu
from compile.dm_program import DMProgram
from compile.onnx_model import load_model_info
from modeld_msm.host_inputs import dm_host_inputs
from selfdrive_glue.camera import dm_warp_matrix
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import NV12Info, nv12_info

STEPS = 6
# tinygrad CI's figure for the DM model on a comma device (docs/anchors.md), shown beside our estimate
CI_DM_MS = 11.0


class _Steps:
  """Seeded DM inputs: frames rotating through 3 buffers, the camera's warp matrix jittered, calib varying."""

  def __init__(self, nv: NV12Info, device: str, seed: int):
    rng = np.random.default_rng(seed)
    self.frames = [rng.integers(0, 256, nv.size, dtype=np.uint8) for _ in range(3)]
    self.tensors = [frame_tensor(f, device) for f in self.frames]
    base = dm_warp_matrix(nv.width)
    self.m_inv = [base + np.array([[0, 0, rng.normal(0, 8)], [0, 0, rng.normal(0, 8)], [0, 0, 0]], np.float32) for _ in range(STEPS)]
    self.calib = [rng.normal(0, 0.05, (1, 3)).astype(np.float32) for _ in range(STEPS)]

  def run(self, fn, host_np: dict[str, np.ndarray], host_t: dict[str, Any]) -> list[np.ndarray]:
    out = []
    for i in range(STEPS):
      host_np["m_inv"][...], host_np["calib"][...] = self.m_inv[i], self.calib[i]
      out.append(fn(self.tensors[i % 3], host_t["m_inv"], host_t["calib"]).numpy().copy())
    return out



def compile_dm_artifact(model: str | Path, camera: tuple[int, int], device: str, out_dir: str | Path, log=print,
                        precision: str = "auto", layout: str | None = None, openpilot: str = "0.11") -> CompileReport:
  """openpilot: whose QCOM flags (compile.build.QCOM_FLAGS_OF): dmonitoringmodeld runs in 0.11 and in master alike."""
  compute, why, use_layout, layout_why = compile_options(device, precision, layout)
  out_dir = Path(out_dir)
  report = CompileReport(out_dir)
  t0 = time.perf_counter()
  info = load_model_info(model, "dmonitoring")
  sess = preflight.ort_session(info)
  report.checks.append(("model contract", "ok", f"dmonitoring out {info.output_width}, {len(info.output_slices)} slices"
                        + ("" if "sleep_prob_lhd" in info.output_slices else " (no sleep_prob: the 0.11.0 layout)")))
  report.checks.append(("precision", "ok", f"{compute}: {why}; cpu layout {'on' if use_layout else 'off'} ({layout_why})"))
  check_out_dir(out_dir, (Path(model),))
  cap = open_capture(device, log, openpilot)
  from tinygrad.helpers import Context
  nv = nv12_info(*camera)
  with Context(**cap.flags):
    log(f"[compile] loading the driver-monitoring model for {camera[0]}x{camera[1]} on {cap.capture_target} in {compute}")
    preflight.tinygrad_parse(info)
    prog = one_model.build(DMProgram, info, nv, cap.dev_name, compute, use_layout, "dmonitoring")
    report.timings["load"] = time.perf_counter() - t0
    cap.start_execution()
    t = time.perf_counter()
    log("[compile] 1/3 tinygrad vs onnxruntime on the raw model")
    ort_check(info, prog.model, np.random.default_rng(42), report, sess)
    report.timings["onnxruntime check"] = time.perf_counter() - t

    t = time.perf_counter()
    log(f"[compile] 2/3 capturing the JIT (warp + model) and checking it against the unjitted program ({STEPS} frames)")
    host_np, host_t = dm_host_inputs()
    steps = _Steps(nv, cap.dev_name, 42)
    ref = steps.run(prog.run, host_np, host_t)
    jit = prog.jit()
    got = steps.run(jit, host_np, host_t)
    for i, (r, g) in enumerate(zip(ref, got)):
      if not np.array_equal(r, g):
        raise UserError(f"internal error: the jitted DM program differs from the unjitted one at frame {i}; please report it")
      if not np.isfinite(r).all():
        raise UserError(f"the driver-monitoring model produces non-finite outputs at frame {i}; check the model file")
    if np.array_equal(ref[0], ref[1]):
      raise UserError("internal error: the DM program ignores its inputs; please report it")
    report.checks.append(("jit == unjitted", "ok", f"warp + model outputs bit-exact over {STEPS} frames, rotating buffers, calib and warp varied"))
    report.timings["jit check"] = time.perf_counter() - t

    t = time.perf_counter()
    log("[compile] 3/3 pickling and checking the reloaded program")
    (blob,) = pickle_programs(jit)

  def replay() -> list[np.ndarray]:
    (loaded,) = unpickle_programs(blob, names=(art_mod.DM_PKL,))
    return steps.run(loaded, host_np, host_t)
  kernel_us: dict[str, float] = {}
  if device != "QCOM":
    back = replay()
    report.checks.append(("pickle reload", "ok", f"DM JIT reloaded: outputs bit-exact over {STEPS} frames"))
  else:
    back, kernel_us = replay_on_emu(cap.dev_name, replay, STEPS, report)
    ms = sum(kernel_us.values()) / 1e3
    report.checks.append(("a630 vs tinygrad CI", "ok", f"distinct kernels {ms:.2f} ms, one run each (the frame: bench/bench_a630.py); "
                          f"tinygrad CI's DM on a comma device: < {CI_DM_MS:g} ms"))
  if not all(np.array_equal(r, g) for r, g in zip(ref, back)):
    raise UserError("internal error: the reloaded DM program differs from the unjitted one; please report it")
  report.timings["pickle check"] = time.perf_counter() - t

  meta = cap.meta(camera, nv, (info,), compute, why, kernel_us, "dmonitoring")
  meta.update({
    "cpu_layout": {"on": use_layout, "why": layout_why, **prog.layout_rewrites},
    "cpu_threads": cap.threads,
    "validation": {"checks": report.checks, "ort_rtol": ORT_RTOL, "ort_atol": ORT_ATOL, "steps": STEPS},
  })
  art_mod.write_artifact(out_dir, {art_mod.DM_PKL: blob}, meta)
  report.timings["total"] = time.perf_counter() - t0
  log(f"[compile] wrote {out_dir} ({len(blob) / 1e6:.1f} MB)")
  return report
