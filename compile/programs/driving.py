"""0.11's driving model: driving_vision.onnx + driving_policy.onnx as one per-frame program (compile/programs/driving_step.py), a full step
and a warp-only step for dropped frames; the one kind with a shipped kernel search (compile/cpu/search.py)."""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from artifact.kinds import Kind
from artifact.load import frame_tensor
from compile import image_layout
from compile.checks import StepInputs
from compile.cpu import layout as cpu_layout
from compile.cpu import search as cpu_search
from compile.onnx_model import OnnxModelInfo
from compile.programs.driving_step import DrivingProgram
from compile.programs.one_model import runner_model
from selfdrive_glue.nv12 import NV12Info

# P = full step, W = warp-only (dropped frame)
STEP_PLAN = "PPWPWWPP"


def build_program(vinfo: OnnxModelInfo, pinfo: OnnxModelInfo, nv: NV12Info, device: str, compute: str, layout: bool | None = None):
  """The unjitted per-frame program in the given precision and layout: fp32 builds the runners from widened copies of
  the models, the CPU layout from rewritten ones plus its op table (compile/cpu/layout.py); onnxruntime still checks the
  originals. layout None: as compile_artifact chooses it for `device`. The rewrite counts are on the program as
  `layout_rewrites` (the CPU layout's) and `image_rewrites` (compile/image_layout.py's)."""
  if layout is None:
    layout, _ = cpu_layout.choose(device, os.environ.get("MODELD_CPU_LAYOUT", "auto"))
  image = image_layout.images()
  if compute != "fp32" and not layout and not image:
    return DrivingProgram(vinfo, pinfo, nv, device)
  with tempfile.TemporaryDirectory(prefix="modeld-msm-build-") as td:
    (vpath, vn), (ppath, pn) = (runner_model(i.path, compute, layout, Path(td), image) for i in (vinfo, pinfo))
    prog = DrivingProgram(replace(vinfo, path=vpath), replace(pinfo, path=ppath), nv, device, cpu_ops=layout)
  split = [image_layout.split_counts(counts, m) for m, counts in (("vision", vn), ("policy", pn))]
  prog.layout_rewrites = {k: n for cpu, _ in split for k, n in cpu.items()}
  prog.image_rewrites = {k: n for _, img in split for k, n in img.items()}   # type: ignore[attr-defined]
  return prog



def driving_inputs(nv: NV12Info, device: str, seed: int, steps: int) -> StepInputs:
  """Seeded inputs per step: frames rotate through 3 buffers per camera like a VisionIPC ring; host inputs vary (the
  sequence repeats after len(STEP_PLAN) steps)."""
  rng = np.random.default_rng(seed)
  frames = [rng.integers(0, 256, nv.size, dtype=np.uint8) for _ in range(6)]
  tensors = [frame_tensor(f, device) for f in frames]
  host = [_host(rng) for _ in STEP_PLAN]
  return StepInputs(({"frame": tensors[(2 * (i % len(host))) % 6], "big_frame": tensors[(2 * (i % len(host)) + 1) % 6], **host[i % len(host)]}
                     for i in range(steps)), frames)


def with_action_t(nv: NV12Info, device: str, seed: int, steps: int) -> StepInputs:
  """driving_inputs plus an action_t per step ([[lateral, longitudinal]] delays in s), for the kinds of master that read it."""
  base = driving_inputs(nv, device, seed, steps)
  rng = np.random.default_rng(seed + 1)
  action_t = [np.array([[rng.uniform(0.1, 0.5), rng.uniform(0.3, 0.8)]], np.float32) for _ in range(steps)]
  return StepInputs(({**b, "action_t": a} for b, a in zip(base, action_t)), base.buffers)


def _host(rng: np.random.Generator) -> dict[str, np.ndarray]:
  tfm = np.array([[2.9, 0.0, 219.0], [0.0, 2.9, 465.0], [0.0, 0.0, 1.0]], np.float32)
  tfm[:2] += rng.normal(0, [[0.05, 0.05, 30.0]], (2, 3)).astype(np.float32)
  big = np.array([[1.25, 0.0, 645.0], [0.0, 1.25, 415.0], [0.0, 0.0, 1.0]], np.float32)
  big[:2] += rng.normal(0, [[0.02, 0.02, 20.0]], (2, 3)).astype(np.float32)
  desire = (rng.random(8) > 0.7).astype(np.float32)
  tc = np.zeros((1, 2), np.float32)
  tc[0, int(rng.integers(0, 2))] = 1
  return {"desire": desire, "traffic_convention": tc, "tfm": tfm, "big_tfm": big}


class Recipe:
  plan = STEP_PLAN
  has_search = True   # a shipped kernel search (compile/cpu/search.py) exists for it

  def __init__(self, kind: Kind):
    self.kind = kind

  def write_models(self, out: str | Path, size: str, seed: int, stand_in: bool = False) -> dict[str, Any]:
    """Reference models of this kind (compile/refmodels/driving.py): {contract: what was written}."""
    from compile.refmodels.driving import write_models
    return write_models(out, size, seed, stand_in=stand_in)

  def contract_line(self, infos: dict[str, OnnxModelInfo]) -> str:
    v, p = infos["vision"], infos["policy"]
    return f"vision out {v.output_width}, policy out {p.output_width}, {len(v.output_slices)}+{len(p.output_slices)} slices"

  def search(self, device: str, compute: str, layout: bool, camera: tuple[int, int], infos: dict[str, OnnxModelInfo],
             search: str | None) -> tuple[dict[str, Any] | None, str | None]:
    key = cpu_search.match_key(device=device, precision=compute, layout=layout, camera=camera,
                               model_sha256={"vision": infos["vision"].sha256, "policy": infos["policy"].sha256})
    return cpu_search.choose(search or os.environ.get("MODELD_CPU_SEARCH", "auto"), key)

  def build(self, infos: dict[str, OnnxModelInfo], nv: NV12Info, device: str, compute: str, layout: bool, openpilot: str) -> DrivingProgram:
    return build_program(infos["vision"], infos["policy"], nv, device, compute, layout=layout)

  def runners(self, prog: DrivingProgram) -> dict[str, Any]:
    return {"vision": prog.vision, "policy": prog.policy}

  def unjitted(self, prog: DrivingProgram) -> dict[str, Any]:
    return {"step": prog.run_policy, "warp": prog.run_warp}

  def jits(self, prog: DrivingProgram) -> dict[str, Any]:
    policy, warp = prog.jits()
    return {"step": policy, "warp": warp}

  def inputs(self, nv: NV12Info, device: str, seed: int) -> list[dict[str, Any]]:
    return driving_inputs(nv, device, seed, len(STEP_PLAN))

  def jit_line(self, runs: int) -> str:
    return f"outputs and 4 queues bit-exact over {len(STEP_PLAN)} steps, rotating buffers"

  def reload_line(self) -> str:
    return f"policy + warp JITs reloaded: outputs bit-exact over {len(STEP_PLAN)} steps"

  def ci_line(self, ms: float) -> str | None:
    return None

  def meta(self, prog: DrivingProgram, use_layout: bool, layout_why: str, searched: dict[str, Any] | None, search_why: str | None) -> dict[str, Any]:
    return {
      # compute-preserving rewrites the runners were built with (compile/cpu/layout.py); checked against onnxruntime like the rest
      "cpu_layout": {"on": use_layout, "why": layout_why, **prog.layout_rewrites,
                     "dense_conv_materialised": use_layout, "elu_own_kernel": use_layout,
                     # convolutions run on compile/cpu/pointwise.py's kernel (MODELD_CPU_POINTWISE=0: none)
                     "pointwise_kernel": {m: len(getattr(getattr(prog, m), "cpu_pointwise", {})) for m in ("vision", "policy")}},
      "search": {"used": searched is not None, "why": search_why, "beam": searched["beam"] if searched else None,
                 "kernels": len(searched["entries"]) if searched else 0,
                 # kernels the tuner re-searched and changed (compile/tuning/tune.py)
                 "tuned": cpu_search.tuned_count(searched) if searched else 0},
      "validation": {"step_plan": STEP_PLAN},
    }
