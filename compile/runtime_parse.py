"""The contract check's last step: a model's reference outputs, parsed and put into messages once by the car's own code.

The slice checks in onnx_model.py know the widths openpilot's parser reads for the slices they name; anything else the
parser reshapes (a plan slice 900 wide instead of 33 x 15 x 2) would pass them and first fail on the car's first frame.
So the compile runs the runtime's parser and message fillers (modeld_msm) over outputs the compiled program produced, and
a model whose outputs they cannot take is refused by name before an artifact is written.
"""
from __future__ import annotations

import numpy as np

from artifact.kinds import Kind
from modeld_msm.actions import Action, get_action
from modeld_msm.dm_outputs import fill_driver_state, parse_dm_outputs
from modeld_msm.fill_msg import PublishState, fill_model_msg, fill_pose_msg
from modeld_msm.parse_outputs import parse_policy_outputs, parse_vision_outputs, slice_outputs
from selfdrive_glue import messaging
from selfdrive_glue.errors import UserError


def _driving(out: dict[str, np.ndarray], action_head: bool) -> None:
  head = out.get("action") if action_head else None
  action = get_action(out["plan"][0], Action(), 0.15, 0.2, 20.0, head=head)
  model, drv, pose = messaging.new_message("modelV2"), messaging.new_message("drivingModelData"), messaging.new_message("cameraOdometry")
  fill_model_msg(model, drv, out, action, PublishState(), 1, 1, 1, 0.0, 0, 0.0, True)
  fill_pose_msg(pose, out, 1, 0, 0, True)
  for m in (model, drv, pose):
    m.to_bytes()


def check_runtime_parses(kind: Kind, model_name: str, outputs: dict[str, np.ndarray], slices: dict[str, dict[str, slice]]) -> str:
  """Parse one run's outputs ({program output: flat vector}, each cut by `slices` of its name) as the process serving
  `kind` would, and fill its messages; -> a note for the compile report. A UserError naming the model when the car's code
  cannot take them."""
  try:
    if kind.process == "dmonitoringmodeld":
      ((name, raw),) = outputs.items()
      fill_driver_state(messaging.new_message("driverStateV2"), parse_dm_outputs(raw, slices[name]), 1, 0.0, 0.0)
      what = "driverStateV2"
    else:
      sliced: dict[str, np.ndarray] = {}
      for name, raw in outputs.items():
        sliced.update(slice_outputs(raw, slices[name]))
      _driving(parse_policy_outputs(parse_vision_outputs(sliced)), kind.action_head)
      what = "modelV2, drivingModelData, cameraOdometry"
  except UserError as e:
    raise UserError(f"{model_name}: the car's parser refuses its outputs ({e}); this model does not follow the contract") from None
  except Exception as e:   # the parser's own failure on a shape it does not expect: what modeld would die of on its first frame
    raise UserError(f"{model_name}: the car's parser cannot read its outputs ({type(e).__name__}: {str(e)[:200]}); {kind.process} would stop "
                    "on its first frame: this model does not follow the contract (check its output_slices)") from None
  return f"a reference output parsed by the car's own code into {what}"
