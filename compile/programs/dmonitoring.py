"""The driver-monitoring model: dmonitoring_model.onnx behind the DM warp as one program (compile/programs/dmonitoring_step.py), no state
between frames, so every step is a full one; built with the flags of either openpilot release (it runs in both)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from artifact.kinds import Kind
from artifact.load import frame_tensor
from compile.checks import StepInputs
from compile.onnx_model import OnnxModelInfo
from compile.programs import one_model
from compile.programs.dm_warp import MASTER_BORDER
from compile.programs.dmonitoring_step import DMProgram
from selfdrive_glue.nv12 import NV12Info

STEPS = 6
# tinygrad CI's figure for the DM model on a comma device (docs/anchors.md), shown beside our estimate
CI_DM_MS = 11.0


class Recipe:
  plan = "P" * STEPS
  has_search = False

  def __init__(self, kind: Kind):
    self.kind = kind

  def write_models(self, out: str | Path, size: str, seed: int, stand_in: bool = False) -> dict[str, Any]:
    """The reference driver-monitoring model (compile/refmodels/dmonitoring.py)."""
    from compile.refmodels.dmonitoring import write_dm_model
    return {"dmonitoring": write_dm_model(out, size, seed, stand_in=stand_in)}

  def contract_line(self, infos: dict[str, OnnxModelInfo]) -> str:
    info = infos["dmonitoring"]
    return (f"dmonitoring out {info.output_width}, {len(info.output_slices)} slices"
            + ("" if "sleep_prob_lhd" in info.output_slices else " (no sleep_prob: the 0.11.0 layout)"))

  def search(self, device: str, compute: str, layout: bool, camera: tuple[int, int], infos: dict[str, OnnxModelInfo],
             search: str | None) -> tuple[dict[str, Any] | None, str | None]:
    return None, None

  def build(self, infos: dict[str, OnnxModelInfo], nv: NV12Info, device: str, compute: str, layout: bool, openpilot: str) -> DMProgram:
    # the DM warp of the release it is for: 0.11 clamps to the frame's edge, master fills with 16
    border = MASTER_BORDER if openpilot == "master" else None
    return one_model.build(DMProgram, infos["dmonitoring"], nv, device, compute, layout, "dmonitoring", border=border)

  def runners(self, prog: DMProgram) -> dict[str, Any]:
    return {"dmonitoring": prog.model}

  def unjitted(self, prog: DMProgram) -> dict[str, Any]:
    return {"step": prog.run}

  def jits(self, prog: DMProgram) -> dict[str, Any]:
    return {"step": prog.jit()}

  def inputs(self, nv: NV12Info, device: str, seed: int) -> list[dict[str, Any]]:
    """Frames rotating through 3 buffers, calib varying."""
    rng = np.random.default_rng(seed)
    frames = [rng.integers(0, 256, nv.size, dtype=np.uint8) for _ in range(3)]
    tensors = [frame_tensor(f, device) for f in frames]
    calib = [rng.normal(0, 0.05, (1, 3)).astype(np.float32) for _ in range(STEPS)]
    return StepInputs(({"frame": tensors[i % 3], "calib": calib[i]} for i in range(STEPS)), frames)

  def jit_line(self, runs: int) -> str:
    return f"warp + model outputs bit-exact over {STEPS} frames, rotating buffers, calib varied"

  def reload_line(self) -> str:
    return f"DM JIT reloaded: outputs bit-exact over {STEPS} frames"

  def ci_line(self, ms: float) -> str | None:
    return f"distinct kernels {ms:.2f} ms, one run each (the frame: bench/bench_a630.py); tinygrad CI's DM on a comma device: < {CI_DM_MS:g} ms"

  def meta(self, prog: DMProgram, use_layout: bool, layout_why: str, searched: dict[str, Any] | None, search_why: str | None) -> dict[str, Any]:
    return {"cpu_layout": {"on": use_layout, "why": layout_why, **prog.layout_rewrites}, "validation": {"steps": STEPS},
            "dm_warp": {"outside_the_frame": "edge" if prog.border is None else f"fill {prog.border}",
                        "in_the_model_kernel": prog.fold_warp, "matrix": prog.matrix.tolist(), "matrix_as": prog.warp_form()}}
