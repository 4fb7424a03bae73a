"""Held-out accuracy of an exported (fp16) vision + policy pair, run by onnxruntime the way modeld feeds them."""
from __future__ import annotations

from typing import Any

import numpy as np

from compile.refmodels.driving import POLICY_SLICES, VISION_SLICES
from modeld_msm.actions import action_times, plan_curvature
from modeld_msm.core import DEFAULT_LAT_DELAY  # modeld's lateral delay until a liveDelay arrives (the demo sends none)
from modeld_msm.parse_outputs import parse_policy_outputs, parse_vision_outputs, slice_outputs
from offcar import accuracy
from offcar.train.data import Drives, feature_buffers
from selfdrive_glue.road_render import RoadScene
from selfdrive_glue.road_truth import curvature_right


def evaluate(vision_onnx: Any, policy_onnx: Any, drives: Drives) -> dict[str, float]:
  import onnxruntime as ort

  vs = ort.InferenceSession(vision_onnx.SerializeToString(), providers=["CPUExecutionProvider"])
  ps = ort.InferenceSession(policy_onnx.SerializeToString(), providers=["CPUExecutionProvider"])
  _, lat_t = action_times(0.0, DEFAULT_LAT_DELAY)
  hs = VISION_SLICES["hidden_state"]
  hidden = np.zeros((len(drives), hs.stop - hs.start), np.float32)
  vis: list[np.ndarray] = []
  for i in range(len(drives)):
    img, big = drives.vision_input(np.array([i]))
    v = vs.run(None, {"img": img, "big_img": big})[0][0].astype(np.float32)
    hidden[i] = v[hs]
    vis.append(v)
  scenes: dict[int, RoadScene] = {}
  errors, cp, ct, lead_err = [], [], [], []
  tc = np.array([[1, 0]], np.float16)
  for i in range(len(drives)):
    if drives.k[i] < 1:   # the first frame of a drive has no previous frame: modeld's first output is not judged either
      continue
    buf = feature_buffers(hidden, drives, np.array([i])).astype(np.float16)
    p = ps.run(None, {"features_buffer": buf, "desire_pulse": np.zeros((1, 25, 8), np.float16), "traffic_convention": tc})[0][0]
    out = {**parse_vision_outputs(slice_outputs(vis[i], VISION_SLICES)),
           **parse_policy_outputs(slice_outputs(p.astype(np.float32), POLICY_SLICES))}
    tr = drives.truths[i]
    errors.append(accuracy.lane_errors(out["lane_lines"][0, :, :, 0], tr))
    if tr.lead_prob[0] > 0:
      lead_err.append(abs(float(out["lead"][0, 0, 0, 0]) - float(tr.lead[0, 0, 0])))
    plan = out["plan"][0]
    cp.append(plan_curvature(plan, tr.v_ego, lat_t))
    seed = drives.seeds[int(drives.drive[i])]
    scene = scenes.setdefault(seed, RoadScene(seed, drives.camera))
    ct.append(curvature_right(scene, tr.t + lat_t))
  summary = accuracy.summarize(errors, cp, ct)
  # what knowing only the average road gives: each line at its mean position over these frames
  judged = [tr for i, tr in enumerate(drives.truths) if drives.k[i] >= 1]
  mean_lanes = np.mean([tr.lane_lines_y for tr in judged], axis=0)
  summary["baseline_lane_error_m_p50"] = accuracy.summarize([accuracy.lane_errors(mean_lanes, tr) for tr in judged], [], [])["lane_error_m_p50"]
  summary["lead_distance_error_m_p50"] = float(np.median(lead_err)) if lead_err else float("nan")
  return summary
