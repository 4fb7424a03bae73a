"""The driver-monitoring model's outputs: parsed by name from its output_slices, and written into driverStateV2.

Per driver side (lhd: the left seat's driver, rhd: the right's) the model gives 12 face descriptors (6 means: pitch, yaw,
roll in the camera frame, x and y position relative to the image centre, size; then the same 6 as log-stds, read as
exp(min(x, 11))) and sigmoid heads; wheel_on_right is one sigmoid for both. Slices this model lacks (sleep_prob before
0.11.1) leave their field at its default.
"""
from __future__ import annotations

import numpy as np

from modeld_msm.parse_outputs import safe_exp, sigmoid

SIDES = (("lhd", "leftDriverData"), ("rhd", "rightDriverData"))
# model head -> DriverData field, the sigmoid probabilities
PROB_FIELDS = (("face_prob", "faceProb"), ("left_eye_prob", "leftEyeProb"), ("right_eye_prob", "rightEyeProb"),
               ("left_blink_prob", "leftBlinkProb"), ("right_blink_prob", "rightBlinkProb"), ("sunglasses_prob", "sunglassesProb"),
               ("using_phone_prob", "phoneProb"), ("sleep_prob", "sleepProb"))


def parse_side(raw: np.ndarray, slices: dict[str, slice], side: str) -> dict[str, np.ndarray | float]:
  descs = raw[slices[f"face_descs_{side}"]]
  mean, std = descs[:6], safe_exp(descs[6:12])
  out: dict[str, np.ndarray | float] = {"faceOrientation": mean[0:3], "faceOrientationStd": std[0:3], "facePosition": mean[3:5],
                                        "facePositionStd": std[3:5]}
  for head, field in PROB_FIELDS:
    if (sl := slices.get(f"{head}_{side}")) is not None:
      out[field] = float(sigmoid(raw[sl])[0])
  return out


def parse_dm_outputs(raw: np.ndarray, slices: dict[str, slice]) -> dict:
  """-> {'wheelOnRightProb': p, 'leftDriverData': {...}, 'rightDriverData': {...}} in driverStateV2's own names."""
  raw = np.asarray(raw, np.float32).reshape(-1)
  return {"wheelOnRightProb": float(sigmoid(raw[slices["wheel_on_right"]])[0]),
          **{field: parse_side(raw, slices, side) for side, field in SIDES}}


def fill_driver_state(msg, parsed: dict, frame_id: int, execution_s: float, gpu_s: float, raw: np.ndarray | None = None) -> None:
  """Fill an Event builder initialised with driverStateV2, as openpilot's dmonitoringmodeld does (every field it fills)."""
  ds = msg.driverStateV2
  ds.frameId = frame_id
  ds.modelExecutionTime = execution_s
  ds.gpuExecutionTime = gpu_s
  ds.wheelOnRightProb = parsed["wheelOnRightProb"]
  if raw is not None:
    ds.rawPredictions = np.asarray(raw, np.float32).tobytes()
  for _, field in SIDES:
    d, p = getattr(ds, field), parsed[field]
    for name, value in p.items():
      setattr(d, name, [float(x) for x in value] if isinstance(value, np.ndarray) else value)
