"""The trained stand-in model, held to the road the renderer drew, through the code `serve` runs (ModelState on a CPU
artifact): it meets its accuracy bar, and geometry bugs planted between the camera buffer and the parsed outputs push
the error past the bar while the runtime comparison (the artifact against onnxruntime on the same warped inputs) still
passes — the comparison alone cannot see them."""
from __future__ import annotations

import numpy as np
import pytest

from compile.refmodels.driving import STAND_IN_DIR, VISION_SLICES, stand_in_model
from modeld_msm.actions import action_times, plan_curvature
from offcar import accuracy
from selfdrive_glue.camera import device_camera_config, get_warp_matrix, sensor_and_device
from selfdrive_glue.road_render import RoadScene
from selfdrive_glue.road_truth import truth

CAMERA = "1928x1208"
SEED = 10_000_007   # a held-out scene (training seeds are 0..159), with a visible calibration yaw
FRAMES = 24         # 1.2 s at 20 Hz; outputs from frame 4 on (the first with a real previous image) are judged


@pytest.fixture(scope="module")
def stand_in_artifact(tmp_path_factory):
  from compile.build import compile_artifact
  out = tmp_path_factory.mktemp("stand_in") / "artifact"
  models = {"vision": STAND_IN_DIR / "driving_vision.onnx", "policy": STAND_IN_DIR / "driving_policy.onnx"}
  report = compile_artifact("driving", models, (1928, 1208), "CPU", out,
                            log=lambda *_: None)
  (out.parent / "compile.log").write_text(report.table())
  return out


def _transforms(scene: RoadScene, rpy_sign: float, focal_scale: float) -> tuple[np.ndarray, np.ndarray]:
  sensor, device = sensor_and_device(CAMERA)
  dc = device_camera_config(device, sensor)
  k_road, k_wide = (np.array(c.intrinsics, np.float64) for c in (dc.fcam, dc.ecam))
  for k in (k_road, k_wide):
    k[0, 0] *= focal_scale
    k[1, 1] *= focal_scale
  rpy = np.array(scene.calib_rpy) * rpy_sign
  return get_warp_matrix(rpy, k_road, False).astype(np.float32), get_warp_matrix(rpy, k_wide, True).astype(np.float32)


def _drive(artifact, rpy_sign: float = 1.0, focal_scale: float = 1.0, slice_shift: int = 0) -> tuple[dict, float]:
  """-> (accuracy summary, worst |artifact - onnxruntime| of the last frame's vision output relative to its scale)."""
  import onnxruntime as ort

  from compile.programs.warp import warp_nv12_numpy
  from modeld_msm.model_state import ModelState
  scene = RoadScene(SEED, CAMERA)
  ms = ModelState(artifact, device="CPU")
  if slice_shift:   # the planted parsing bug: the lane-line head read `slice_shift` columns off (1: y and z swapped)
    s = ms.slices["vision"]["lane_lines"]
    ms.slices = {**ms.slices, "vision": {**ms.slices["vision"], "lane_lines": slice(s.start + slice_shift, s.stop + slice_shift)}}
  tfm, big_tfm = _transforms(scene, rpy_sign, focal_scale)
  _, lat_t = action_times(0.0, 0.2)
  road, wide = scene.render(0.0), scene.render(0.0, "wide")
  errors, cp, ct, warped, raw = [], [], [], [], None
  for i in range(FRAMES):
    t = i * 0.05
    scene.render_into(road, t, "road")
    scene.render_into(wide, t, "wide")
    out, raw = ms.run(road, wide, tfm, big_tfm, np.zeros(8, np.float32), np.array([[1, 0]], np.float32), prepare_only=False)
    warped.append((warp_nv12_numpy(road, tfm, scene.info), warp_nv12_numpy(wide, big_tfm, scene.info)))
    if i < 4:
      continue
    tr = truth(scene, t, lat_t)
    errors.append(accuracy.lane_errors(out["lane_lines"][0, :, :, 0], tr))
    plan = out["plan"][0]
    cp.append(plan_curvature(plan, tr.v_ego, lat_t))
    ct.append(tr.desired_curvature)
  # the runtime comparison: onnxruntime on the same two warped frames (t-4 and t) gives the artifact's vision output
  (r0, w0), (r1, w1) = warped[-5], warped[-1]
  sess = ort.InferenceSession(stand_in_model("vision").SerializeToString(), providers=["CPUExecutionProvider"])
  ref = sess.run(None, {"img": np.concatenate([r0, r1])[None], "big_img": np.concatenate([w0, w1])[None]})[0][0].astype(np.float32)
  assert raw is not None
  diff = float(np.max(np.abs(raw[:len(ref)] - ref) / (0.05 + 0.05 * np.abs(ref))))
  return accuracy.summarize(errors, cp, ct), diff


@pytest.mark.slow
def test_stand_in_meets_its_bar_on_a_held_out_drive(stand_in_artifact):
  # the compile report says how far tinygrad is from onnxruntime on the road, not only as max |diff|
  log = (stand_in_artifact.parent / "compile.log").read_text()
  assert "vision vs onnxruntime" in log and "on the road: lane lines at 20 m" in log and "plan positions" in log
  s, diff = _drive(stand_in_artifact)
  assert diff < 1, "the artifact and onnxruntime disagree on the same inputs"
  assert s["lane_error_m_p50"] < BUG_BAR_M, s   # clean is on the good side of the bar the planted bugs must cross
  assert s["frames"] == FRAMES - 4


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["intrinsics +5%", "calibration sign flipped", "output slices shifted"])
def test_planted_geometry_bug_is_seen_by_accuracy_not_by_the_runtime_comparison(stand_in_artifact, bug):
  kw = {"intrinsics +5%": {"focal_scale": 1.05}, "calibration sign flipped": {"rpy_sign": -1.0},
        "output slices shifted": {"slice_shift": 1}}[bug]
  s, diff = _drive(stand_in_artifact, **kw)
  assert diff < 1, f"{bug}: the runtime comparison should still pass (both runtimes see the same wrong inputs)"
  assert s["lane_error_m_p50"] > BUG_BAR_M, f"{bug}: lane error {s['lane_error_m_p50']:.3f} m did not cross {BUG_BAR_M} m"


# twice the stand-in's held-out median error (~0.01 m). A focal-length error mostly rescales distance on a flat road (the
# lines are drawn as if a few % nearer or farther, at nearly the same lateral position), so its lateral signature is the
# smallest of the three (~0.035 m at +5 %); a flipped calibration or a shifted slice is metres off
BUG_BAR_M = 0.02


def test_stand_in_is_shipped_with_its_recipe_and_measured_accuracy():
  import json
  info = json.loads((STAND_IN_DIR / "recipe.json").read_text())
  assert info["metrics"]["lane_error_m_p50"] <= accuracy.LANE_ERROR_LIMIT_M
  assert info["metrics"]["curvature_corr"] >= accuracy.CURVATURE_CORR_LIMIT
  assert info["metrics"]["frames"] == info["recipe"]["eval_drives"] * (info["recipe"]["frames_per_drive"] - 1)
  v = stand_in_model("vision")
  assert {p.key: p.value for p in v.metadata_props}["model_checkpoint"] == f"modeld-msm-stand-in-tiny-seed{info['recipe']['seed']}"
  assert [i.name for i in v.graph.input] == ["img", "big_img"] and VISION_SLICES["hidden_state"].stop == 1576
