"""openpilot master's combined driving model (June 2026): driving_supercombo.onnx as one per-frame program
(compile/programs/supercombo_step.py) over 0.11's warp and image queues, action_t an input, this frame's hidden state fed back on
the device; no shipped kernel search."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from artifact.kinds import Kind
from compile.onnx_model import OnnxModelInfo
from compile.programs import one_model
from compile.programs.driving import with_action_t
from compile.programs.supercombo_step import SupercomboProgram
from selfdrive_glue.nv12 import NV12Info

# 8 runs: from the 5th on, a past feature the program fed back itself is among the model's inputs
STEP_PLAN = "PPWPPWPPPP"
# tinygrad CI's figures for this model on a comma device: Qualcomm's compiler, and IR3 (the open one vamOS has)
CI_MS = {"QCOM compiler": 26.0, "IR3": 41.0}


class Recipe:
  plan = STEP_PLAN
  has_search = False

  def __init__(self, kind: Kind):
    self.kind = kind

  def write_models(self, out: str | Path, size: str, seed: int, stand_in: bool = False) -> dict[str, Any]:
    """The pair of this seed fused into master's combined model (compile/refmodels/supercombo.py)."""
    from compile.refmodels.supercombo import write_supercombo_model
    return {"supercombo": write_supercombo_model(out, size, seed, stand_in=stand_in)}

  def contract_line(self, infos: dict[str, OnnxModelInfo]) -> str:
    info = infos["supercombo"]
    return (f"supercombo (openpilot master) out {info.output_width}, {len(info.output_slices)} slices, "
            + ("action head" if "action" in info.output_slices else "no action head: modeld takes the plan"))

  def search(self, device: str, compute: str, layout: bool, camera: tuple[int, int], infos: dict[str, OnnxModelInfo],
             search: str | None) -> tuple[dict[str, Any] | None, str | None]:
    return None, "none shipped for this contract (tinygrad's heuristic opts)"

  def build(self, infos: dict[str, OnnxModelInfo], nv: NV12Info, device: str, compute: str, layout: bool, openpilot: str) -> SupercomboProgram:
    return one_model.build(SupercomboProgram, infos["supercombo"], nv, device, compute, layout, "supercombo")

  def runners(self, prog: SupercomboProgram) -> dict[str, Any]:
    return {"supercombo": prog.model}

  def unjitted(self, prog: SupercomboProgram) -> dict[str, Any]:
    return {"step": prog.run_policy, "warp": prog.run_warp}

  def jits(self, prog: SupercomboProgram) -> dict[str, Any]:
    step, warp = prog.jits()
    return {"step": step, "warp": warp}

  def inputs(self, nv: NV12Info, device: str, seed: int) -> list[dict[str, Any]]:
    """The driving compile's seeded frames and host inputs, plus an action_t per step (lateral, longitudinal delays in s)."""
    return with_action_t(nv, device, seed, len(STEP_PLAN))

  def jit_line(self, runs: int) -> str:
    return (f"outputs and 4 queues bit-exact over {len(STEP_PLAN)} steps ({runs} runs: past features fed back on the device), rotating "
            "buffers, action_t varied")

  def reload_line(self) -> str:
    return f"step + warp JITs reloaded: outputs bit-exact over {len(STEP_PLAN)} steps"

  def ci_line(self, ms: float) -> str | None:
    return f"distinct kernels {ms:.2f} ms, one run each (the frame: bench/bench_a630.py); tinygrad CI on a comma device: " + ", ".join(
      f"< {v:g} ms ({k})" for k, v in CI_MS.items())

  def meta(self, prog: SupercomboProgram, use_layout: bool, layout_why: str, searched: dict[str, Any] | None,
           search_why: str | None) -> dict[str, Any]:
    return {
      "contract": "supercombo",
      "cpu_layout": {"on": use_layout, "why": layout_why, **prog.layout_rewrites},
      # h(t) is pushed into the feature queue on the device, not round-tripped through the host as master does
      "feature_feedback": "device",
      "validation": {"step_plan": STEP_PLAN},
    }
