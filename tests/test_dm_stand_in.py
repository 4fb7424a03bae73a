"""The trained driver-monitoring stand-in, held to the cabin the renderer drew, through the step dmonitoringmodeld runs
(DMonitoringCore on a CPU artifact): it meets its bars on a held-out cabin, and bugs planted between the camera buffer
and the parsed driverStateV2 (the other camera's warp, calib never reaching the model, the driver sides swapped) push
it past them while the runtime comparison (the artifact against onnxruntime on the inputs the core fed it) still
passes: the comparison alone cannot see them."""
from __future__ import annotations

import json

import numpy as np
import pytest

from compile.programs.dm_warp import warp_y_numpy
from compile.refmodels.dmonitoring import DM_SLICES, dm_stand_in_model
from compile.refmodels.driving import STAND_IN_DIR
from modeld_msm.frames import Frame
from offcar import dm_accuracy
from selfdrive_glue import messaging
from selfdrive_glue.cabin_render import CabinScene
from selfdrive_glue.camera import DM_INPUT_SIZE, dm_warp_matrix
from tests.conftest import event_reader

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.xdist_group("dm_stand_in")

SEED = 40_000_003                # a held-out cabin (training seeds 20,000,000 up, evaluation 30,000,000 up)
CALIB = (0.0, 0.1, -0.1)         # rpyCalib: pitch and yaw at the training range's edge, so ignoring it costs 5.7 deg
TIMES = np.linspace(0, 60, 48, endpoint=False) + 0.13   # one 60 s segment: faces, the no-face and sunglasses stretches


def _compile(out):
  from compile.build import compile_artifact
  report = compile_artifact("dmonitoring", {"dmonitoring": STAND_IN_DIR / "dmonitoring_model.onnx"}, (1928, 1208), "CPU", out, log=lambda *_: None)
  assert "dmonitoring vs onnxruntime" in report.table()
  return out


@pytest.fixture(scope="module")
def stand_in_dm_artifact(tmp_path_factory):
  return _compile(tmp_path_factory.mktemp("dm_stand_in") / "artifact")


def _mici_matrix(width: int) -> np.ndarray:
  return dm_warp_matrix(1344)   # the mici's os04c10 fisheye, whatever the camera


@pytest.fixture(scope="module")
def other_cameras_warp_artifact(tmp_path_factory):
  """An artifact whose program warps a 1928x1208 frame with the mici's matrix: camera.py's matrix wrong for the camera,
  when the artifact was built and when it is loaded (so the load's check of the one against the other agrees)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr("compile.programs.dmonitoring_step.dm_warp_matrix", _mici_matrix)
    return _compile(tmp_path_factory.mktemp("dm_stand_in_mici_warp") / "artifact")


def _swapped(slices: dict[str, slice]) -> dict[str, slice]:
  return {k.replace("_lhd", "_tmp").replace("_rhd", "_lhd").replace("_tmp", "_rhd"): v for k, v in slices.items()}


def _drive(artifact, bug: str | None = None) -> tuple[dm_accuracy.DMAccuracy, float]:
  """-> (accuracy on the held-out cabin, worst |artifact - onnxruntime| of the last frame relative to its scale)."""
  from modeld_msm.dm_core import DMonitoringCore
  with pytest.MonkeyPatch.context() as mp:
    if bug == "other camera's warp":
      mp.setattr("modeld_msm.dm_core.dm_warp_matrix", _mici_matrix)
    core = DMonitoringCore(artifact)
  if bug == "driver sides swapped":
    core.slices = _swapped(core.slices)
  if bug != "calib ignored":
    core.on_member("liveCalibration", event_reader("liveCalibration", rpyCalib=list(CALIB)).liveCalibration)
  scene = CabinScene(SEED, "1928x1208", CALIB)
  buf = np.zeros(scene.info.size, np.uint8)
  preds = []
  for i, t in enumerate(TIMES):
    scene.render_into(buf, float(t))
    out = core.on_frame(Frame(buf, i, i * 50_000_000, i * 50_000_000 + 1))
    preds.append(dm_accuracy.prediction(messaging.log_from_bytes(out[0][1]).driverStateV2, float(t)))
  # the runtime comparison: onnxruntime on the image and calib the core gave the artifact
  sess = ort.InferenceSession(str(STAND_IN_DIR / "dmonitoring_model.onnx"), providers=["CPUExecutionProvider"])
  img = warp_y_numpy(buf, core.warp_matrix, scene.info, *DM_INPUT_SIZE)
  ref = sess.run(None, {"input_img": img.reshape(1, -1), "calib": core.host["calib"].reshape(1, 3).astype(np.float32)})[0][0]
  ref = ref.astype(np.float32)
  diff = float(np.max(np.abs(core.run(buf) - ref) / (0.05 + 0.05 * np.abs(ref))))
  return dm_accuracy.evaluate(scene, preds), diff


@pytest.mark.slow
def test_stand_in_meets_its_bars_on_a_held_out_cabin(stand_in_dm_artifact):
  acc, diff = _drive(stand_in_dm_artifact)
  assert diff < 1, "the artifact and onnxruntime disagree on the same inputs"
  assert acc.passes(), acc.summary()
  assert acc.face_orientation_err_deg_p50 is not None and acc.face_orientation_err_deg_p50 < dm_accuracy.FACE_ORIENTATION_LIMIT_DEG / 2
  assert acc.frames == len(TIMES) and sum(not t.face for t in acc.truths) >= 2   # both classes are there for the AUC


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["other camera's warp", "calib ignored", "driver sides swapped"])
def test_planted_bug_is_seen_by_accuracy_not_by_the_runtime_comparison(request, bug):
  artifact = request.getfixturevalue("other_cameras_warp_artifact" if bug == "other camera's warp" else "stand_in_dm_artifact")
  acc, diff = _drive(artifact, bug)
  assert diff < 1, f"{bug}: the runtime comparison should still pass (both runtimes see the same wrong inputs)"
  err = acc.face_orientation_err_deg_p50
  assert err is not None and err > dm_accuracy.FACE_ORIENTATION_LIMIT_DEG, f"{bug}: orientation error {err} deg did not cross the bar"
  assert not acc.passes()


def test_driver_sides_swap_is_a_permutation_of_the_slices():
  s = _swapped(DM_SLICES)
  assert set(s) == set(DM_SLICES) and s["face_prob_lhd"] == DM_SLICES["face_prob_rhd"] and s["features"] == DM_SLICES["features"]


def test_stand_in_is_shipped_with_its_recipe_and_measured_accuracy(tmp_path):
  from compile.onnx_model import load_model_info
  from compile.refmodels.dmonitoring import write_dm_model
  from offcar.train.dm_recipe import checkpoint_name
  info = json.loads((STAND_IN_DIR / "dm_recipe.json").read_text())
  m = info["metrics"]
  assert m["face_orientation_err_deg_p50"] <= dm_accuracy.FACE_ORIENTATION_LIMIT_DEG and m["face_prob_auc"] >= dm_accuracy.FACE_PROB_AUC_LIMIT
  assert m["blink_accuracy"] >= dm_accuracy.BLINK_ACCURACY_LIMIT
  assert m["dm_frames"] == info["recipe"]["eval_scenes"] * info["recipe"]["eval_frames"]
  assert set(m["per_camera"]) == {"1928x1208", "1344x760"}
  model = dm_stand_in_model()
  assert {p.key: p.value for p in model.metadata_props}["model_checkpoint"] == checkpoint_name(info["recipe"]["seed"])
  load_model_info(write_dm_model(tmp_path, "tiny", stand_in=True).path, "dmonitoring")   # openpilot's DM contract, as shipped


def test_models_writes_the_stand_in_and_refuses_a_full_one(tmp_path, cli):
  r = cli("models", "--contract", "dmonitoring", "--stand-in", "-o", tmp_path / "m")
  assert r.returncode == 0 and "dmonitoring tiny stand-in" in r.stdout, r.stderr
  assert (tmp_path / "m" / "dmonitoring_model.onnx").read_bytes() == (STAND_IN_DIR / "dmonitoring_model.onnx").read_bytes()
  r = cli("models", "--contract", "dmonitoring", "--stand-in", "--size", "full", "-o", tmp_path / "f")
  assert r.returncode == 2 and "has no full size" in r.stderr and not (tmp_path / "f").exists()
