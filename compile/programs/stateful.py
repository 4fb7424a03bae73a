"""openpilot master's stateful driving model (since 2026-09): driving_supercombo.onnx with its history queues inside the
graph as state_X inputs fed back from next_X outputs, run as one per-frame program (compile/programs/stateful_step.py) with
the states on the device; no warp-only program; no shipped kernel search."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from artifact.kinds import Kind, frame_bytes
from compile.checks import StepInputs
from compile.onnx_model import OnnxModelInfo
from compile.programs import one_model
from compile.programs.driving import with_action_t
from compile.programs.stateful_step import StatefulProgram
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import NV12Info

# 9 full steps: from the 5th on, a frame the program pushed itself is read back from its image state (rows t-4 and t)
STEP_PLAN = "PPPPPPPPP"
# tinygrad CI's figures for master's driving model on a comma device (the combined model's: the same network)
CI_MS = {"QCOM compiler": 26.0, "IR3": 41.0}


class Recipe:
  plan = STEP_PLAN
  has_search = False

  def __init__(self, kind: Kind):
    self.kind = kind

  def write_models(self, out: str | Path, size: str, seed: int, stand_in: bool = False) -> dict[str, Any]:
    """The pair of this seed rewritten into master's stateful graph (compile/refmodels/stateful.py)."""
    from compile.refmodels.stateful import write_stateful_model
    return {"stateful": write_stateful_model(out, size, seed, stand_in=stand_in)}

  def contract_line(self, infos: dict[str, OnnxModelInfo]) -> str:
    info = infos["stateful"]
    states = StatefulProgram.state_line(info)
    return (f"stateful (openpilot master since 2026-09) out {info.output_width}, {len(info.output_slices)} slices, states {states}, "
            + ("action head" if "action" in info.output_slices else "no action head: modeld takes the plan"))

  def search(self, device: str, compute: str, layout: bool, camera: tuple[int, int], infos: dict[str, OnnxModelInfo],
             search: str | None) -> tuple[dict[str, Any] | None, str | None]:
    return None, "none shipped for this contract (tinygrad's heuristic opts)"

  def build(self, infos: dict[str, OnnxModelInfo], nv: NV12Info, device: str, compute: str, layout: bool, openpilot: str) -> StatefulProgram:
    prog = one_model.build(StatefulProgram, infos["stateful"], nv, device, compute, layout, "stateful")
    # the layout the program reads (from the graph) is the one the artifact records and the runtime fills (the kind's)
    (packed,) = self.kind.program("step").as_meta((nv.width, nv.height))["inputs"]
    if prog.layout != packed["members"]:
      got, want = (", ".join(f"{m['name']} {'x'.join(map(str, m['shape']))}" for m in ms) for ms in (prog.layout, packed["members"]))
      raise UserError(f"this model's host inputs pack as ({got}), the {self.kind.name} kind's buffer as ({want}); "
                      "a graph with other host inputs or another order is not this contract")
    return prog

  def runners(self, prog: StatefulProgram) -> dict[str, Any]:
    return {"stateful": prog.model}

  def unjitted(self, prog: StatefulProgram) -> dict[str, Any]:
    return {"step": prog.run_step}

  def jits(self, prog: StatefulProgram) -> dict[str, Any]:
    return {"step": prog.jits()}

  def inputs(self, nv: NV12Info, device: str, seed: int) -> list[dict[str, Any]]:
    """The driving compile's seeded frames and host inputs, plus an action_t per step, as the members of the packed buffer
    (written into it by name): both transforms in one (2,3,3), each frame's NV12 planes."""
    n = frame_bytes((nv.width, nv.height))
    steps = with_action_t(nv, device, seed, len(STEP_PLAN))
    return StepInputs(({**{k: v for k, v in s.items() if k not in ("frame", "big_frame", "big_tfm")}, "tfm": np.stack((s["tfm"], s["big_tfm"])),
                        "frame": s["frame"].numpy()[:n], "big_frame": s["big_frame"].numpy()[:n]} for s in steps), steps.buffers)

  def jit_line(self, runs: int) -> str:
    return (f"outputs and every state bit-exact over {len(STEP_PLAN)} steps, states fed back in place on the device, one packed upload "
            "per frame, action_t varied")

  def reload_line(self) -> str:
    return f"step JIT reloaded: outputs bit-exact over {len(STEP_PLAN)} steps"

  def ci_line(self, ms: float) -> str | None:
    return f"distinct kernels {ms:.2f} ms, one run each (the frame: bench/bench_a630.py); tinygrad CI on a comma device: " + ", ".join(
      f"< {v:g} ms ({k})" for k, v in CI_MS.items())

  def meta(self, prog: StatefulProgram, use_layout: bool, layout_why: str, searched: dict[str, Any] | None,
           search_why: str | None) -> dict[str, Any]:
    return {
      "cpu_layout": {"on": use_layout, "why": layout_why, **prog.layout_rewrites},
      # the graph's own states, as it declares them: on the device, next_X written into X by the captured program
      "states": {name: {"shape": list(shape), "dtype": dt} for name, (shape, dt) in prog.state_specs.items()},
      "validation": {"step_plan": STEP_PLAN},
    }
