"""The driver-monitoring model: openpilot's contract (reference model, refusals by name), its compile, and the step
dmonitoringmodeld runs, checked against onnxruntime on the same warped image."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from artifact.format import ArtifactError, resolve_artifact, verify_artifact
from compile.onnx_model import decode_output_slices, encode_output_slices, load_model_info
from compile.programs.dm_warp import warp_y_numpy
from compile.refmodels.dmonitoring import DM_SLICES, DM_WIDTH, build_dm_model, write_dm_model
from modeld_msm.constants import send_raw_pred
from modeld_msm.frames import Frame
from selfdrive_glue import messaging
from selfdrive_glue.camera import DM_INPUT_SIZE, dm_warp_matrix
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import nv12_info
from tests.conftest import REPO, event_reader

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.xdist_group("dm_cpu_artifact")
NV = nv12_info(1928, 1208)


def _io(vi):
  t = vi.type.tensor_type
  return t.elem_type, tuple(d.dim_value for d in t.shape.dim)


def test_reference_model_has_openpilots_io_and_metadata(tmp_path):
  w = write_dm_model(tmp_path, "tiny", 0)
  model = onnx.load(str(w.path))
  onnx.checker.check_model(model, full_check=True)
  assert {i.name: _io(i) for i in model.graph.input} == {"input_img": (TensorProto.UINT8, (1, 1440 * 960)),
                                                         "calib": (TensorProto.FLOAT, (1, 3))}
  assert [(o.name, _io(o)) for o in model.graph.output] == [("outputs", (TensorProto.FLOAT16, (1, DM_WIDTH)))]
  slices = decode_output_slices({p.key: p.value for p in model.metadata_props}["output_slices"])
  assert slices == DM_SLICES and DM_WIDTH == 2 * (12 + 8) + 1 + 512   # 0.11.1's layout: 0.11.0's 551 plus two sleep_probs
  assert slices["face_descs_lhd"] == slice(0, 12) and slices["wheel_on_right"] == slice(40, 41)
  # FLOAT16 inside like the shipped model: every floating-point weight is fp16
  floats = [i.data_type for i in model.graph.initializer if i.data_type != TensorProto.INT64]
  assert floats and set(floats) == {TensorProto.FLOAT16}
  # seeded: the same seed writes the same bytes, another seed other weights
  assert build_dm_model("tiny", 0).SerializeToString() == w.path.read_bytes()
  assert build_dm_model("tiny", 1).SerializeToString() != w.path.read_bytes()


def test_full_model_is_the_shipped_size_class(tmp_path):
  w = write_dm_model(tmp_path, "full", 0)
  # openpilot 0.11.1's dmonitoring_model.onnx is 7,494,962 bytes of fp16 weights
  assert 6.5e6 < w.bytes < 8.5e6 and 3.2e6 < w.params < 4.3e6, (w.bytes, w.params)
  load_model_info(w.path, "dmonitoring")   # and it meets the contract it is written for


def _edit(model, *, inputs=None, slices=None):
  m = onnx.ModelProto()
  m.CopyFrom(model)
  if inputs is not None:
    del m.graph.input[:]
    m.graph.input.extend(inputs)
  if slices is not None:
    for p in m.metadata_props:
      if p.key == "output_slices":
        p.value = encode_output_slices(slices)
  return m


@pytest.mark.parametrize("case,needle", [
  ("missing input", "no input 'calib'"),
  ("calib shape", "input 'calib' has shape (1, 4)"),
  ("image dtype", "input 'input_img' has dtype float32"),
  ("slice missing", "lack 'face_prob_rhd'"),
  ("face_descs width", "face_descs_lhd slice slice(0, 11, None) is 11 wide"),
  ("prob width", "face_prob_lhd slice slice(12, 14, None) is not one value wide"),
])
def test_a_model_off_the_contract_is_refused_by_name(tmp_path, case, needle):
  base = build_dm_model("tiny", 0)
  img = helper.make_tensor_value_info("input_img", TensorProto.UINT8, (1, 1440 * 960))
  calib = helper.make_tensor_value_info("calib", TensorProto.FLOAT, (1, 3))
  if case == "missing input":   # named otherwise: the graph stays sound, the contract's name is missing
    m = _edit(base, inputs=[img, helper.make_tensor_value_info("rpy", TensorProto.FLOAT, (1, 3))])
    for n in m.graph.node:
      n.input[:] = ["rpy" if x == "calib" else x for x in n.input]
  elif case == "calib shape":
    m = _edit(base, inputs=[img, helper.make_tensor_value_info("calib", TensorProto.FLOAT, (1, 4))])
  elif case == "image dtype":
    m = _edit(base, inputs=[helper.make_tensor_value_info("input_img", TensorProto.FLOAT, (1, 1440 * 960)), calib])
  else:
    s = dict(DM_SLICES)
    if case == "slice missing":
      del s["face_prob_rhd"]
    elif case == "face_descs width":
      s["face_descs_lhd"] = slice(0, 11)
    else:
      s["face_prob_lhd"] = slice(12, 14)
    m = _edit(base, slices=s)
  path = tmp_path / "dmonitoring_model.onnx"
  path.write_bytes(m.SerializeToString())
  with pytest.raises(UserError) as e:
    load_model_info(path, "dmonitoring")
  assert needle in str(e.value), str(e.value)


def test_compile_refuses_a_model_off_the_contract_in_one_line(tmp_path, cli):
  (tmp_path / "m").mkdir()
  from compile.refmodels.driving import build_model
  (tmp_path / "m" / "dmonitoring_model.onnx").write_bytes(build_model("vision", "tiny", 0).SerializeToString())   # the wrong model
  r = cli("compile", "--dmonitoring", tmp_path / "m" / "dmonitoring_model.onnx", "-o", tmp_path / "out", timeout=300)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert "is the vision model" in r.stderr and "pass it as --vision" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
  assert not (tmp_path / "out").exists()


def test_artifact_records_its_kind_and_checks(dm_cpu_artifact):
  art = verify_artifact(dm_cpu_artifact, process="dmonitoringmodeld")
  assert art.kind == "dmonitoring" and art.camera == (1928, 1208) and set(art.digests) == {"dmonitoring_model.pkl", "metadata.json"}
  checks = {c: r for c, r, _ in art.meta["validation"]["checks"]}
  assert {"dmonitoring vs onnxruntime", "jit == unjitted", "pickle reload"} <= set(checks) and set(checks.values()) == {"ok"}
  detail = dict((c, d) for c, _, d in art.meta["validation"]["checks"])["dmonitoring vs onnxruntime"]
  assert "face orientation" in detail and "deg" in detail


def test_the_other_process_kind_is_refused(dm_cpu_artifact, cpu_artifact_1928):
  with pytest.raises(ArtifactError, match="holds the driver-monitoring model .* not the driving model"):
    verify_artifact(dm_cpu_artifact, process="modeld")
  with pytest.raises(ArtifactError, match="holds the driving model .* not the driver-monitoring model"):
    verify_artifact(cpu_artifact_1928, process="dmonitoringmodeld")


def test_a_bundle_keeps_the_dm_artifacts_apart(tmp_path, dm_cpu_artifact):
  (tmp_path / "b" / "dmonitoring").mkdir(parents=True)
  (tmp_path / "b" / "dmonitoring" / "1928x1208").symlink_to(dm_cpu_artifact)
  assert resolve_artifact(tmp_path / "b", (1928, 1208), "dmonitoringmodeld") == tmp_path / "b" / "dmonitoring" / "1928x1208"
  with pytest.raises(ArtifactError, match="no driver-monitoring model .* artifact for camera 1344x760"):
    resolve_artifact(tmp_path / "b", (1344, 760), "dmonitoringmodeld")


@pytest.fixture(scope="module")
def dm_core(dm_cpu_artifact):
  from modeld_msm.dm_core import DMonitoringCore
  return DMonitoringCore(dm_cpu_artifact)


def _frames(seed: int, n: int):
  rng = np.random.default_rng(seed)
  # a VisionIPC buffer is longer than the frame; the warp reads the Y plane only
  return [rng.integers(0, 256, NV.size + 4096, dtype=np.uint8) for _ in range(n)]


def _published(core, buf, frame_id):
  out = core.on_frame(Frame(buf, frame_id, frame_id * 50_000_000, frame_id * 50_000_000 + 1))
  assert [svc for svc, _ in out] == ["driverStateV2"]
  return messaging.log_from_bytes(out[0][1])


def _ort_reference(dm_model, buf, calib, width=1928):
  sess = ort.InferenceSession(str(dm_model), providers=["CPUExecutionProvider"])
  img = warp_y_numpy(buf, dm_warp_matrix(width), nv12_info(width, 1208 if width == 1928 else 760), *DM_INPUT_SIZE)
  return sess.run(None, {"input_img": img.reshape(1, -1), "calib": np.asarray(calib, np.float32).reshape(1, 3)})[0].astype(np.float32)[0]


def test_driver_state_matches_onnxruntime_on_the_warped_frame(dm_core, dm_model):
  from modeld_msm.dm_outputs import parse_dm_outputs
  dm_core.reset()
  calib = [0.01, -0.04, 0.03]
  dm_core.on_member("liveCalibration", event_reader("liveCalibration", rpyCalib=calib).liveCalibration)
  for i, buf in enumerate(_frames(1, 3), 1):
    evt = _published(dm_core, buf, i)
    ds = evt.driverStateV2
    assert evt.valid and ds.frameId == i and ds.modelExecutionTime > 0 and ds.gpuExecutionTime > 0 and len(ds.rawPredictions) == 0
    want = parse_dm_outputs(_ort_reference(dm_model, buf, calib), DM_SLICES)
    assert ds.wheelOnRightProb == pytest.approx(want["wheelOnRightProb"], abs=0.02)
    for field in ("leftDriverData", "rightDriverData"):
      got, w = getattr(ds, field), want[field]
      for name, value in w.items():
        # fp16 model vs the CPU's fp32: the compile's tolerance (0.02 + 0.02 |ref|), through exp for the stds
        np.testing.assert_allclose(np.asarray(getattr(got, name), np.float32), np.asarray(value, np.float32), rtol=0.05, atol=0.03,
                                   err_msg=f"{field}.{name}")
      assert len(got.faceOrientation) == 3 and len(got.facePosition) == 2 and 0 < got.sleepProb < 1


def test_calibration_reaches_the_model_and_a_bad_one_is_counted(dm_core, caplog):
  dm_core.reset()
  buf = _frames(2, 1)[0]
  zero = _published(dm_core, buf, 1).driverStateV2.leftDriverData.faceOrientation[0]
  dm_core.on_member("liveCalibration", event_reader("liveCalibration", rpyCalib=[0.0, 0.3, -0.3]).liveCalibration)
  moved = _published(dm_core, buf, 2).driverStateV2.leftDriverData.faceOrientation[0]
  assert moved != zero
  with caplog.at_level("ERROR", logger="dmonitoringmodeld"):
    dm_core.on_member("liveCalibration", event_reader("liveCalibration", rpyCalib=[0.0, float("nan"), 0.0]).liveCalibration)
    dm_core.on_member("liveCalibration", event_reader("liveCalibration", rpyCalib=[0.0, 0.1]).liveCalibration)
    dm_core.on_member("liveCalibration", event_reader("liveCalibration", rpyCalib=[0.0, 1e30, 0.0]).liveCalibration)   # finite, absurd
  # counted each, logged once for the burst (modeld_msm/inputs_check.py)
  assert dm_core.stats.bad_inputs == 3 and sum("ignoring liveCalibration" in r.message for r in caplog.records) == 1
  assert _published(dm_core, buf, 3).driverStateV2.leftDriverData.faceOrientation[0] == moved   # the last good calib kept


def test_a_short_buffer_is_dropped_and_counted(dm_core):
  dm_core.reset()
  assert dm_core.on_frame(Frame(np.zeros(1000, np.uint8), 1, 0, 0)) == []
  assert dm_core.stats.dropped_steps == 1 and dm_core.stats.published == 0
  assert _published(dm_core, _frames(3, 1)[0], 2).valid


def test_nonfinite_outputs_publish_invalid_and_keep_going(dm_core, caplog):
  dm_core.reset()
  real = dm_core.program.jit

  class Poisoned:
    def __call__(self, *a):
      from tinygrad import Tensor
      out = real(*a).numpy().copy()
      out[0, 3] = np.nan
      return Tensor(out)
  dm_core.program.jit = Poisoned()
  buf = _frames(4, 1)[0]
  try:
    with caplog.at_level("ERROR", logger="dmonitoringmodeld"):
      assert [_published(dm_core, buf, i).valid for i in (1, 2)] == [False, False]
  finally:
    dm_core.program.jit = real
  assert sum("NaN/inf" in r.message for r in caplog.records) == 1 and dm_core.stats.nonfinite_steps == 2
  assert _published(dm_core, buf, 3).valid


@pytest.mark.slow
def test_qcom_dm_artifact_executes_on_the_emulated_a630_like_the_cpu(tmp_path, dm_model, dm_cpu_artifact, cli):
  """Captured on the emulated a630 under openpilot's QCOM flags (level B), then loaded by the car's runtime over the
  emulated render node, with the independent dispatches' waits for idle dropped: its driverStateV2 agrees with the CPU
  artifact's on the same frame."""
  out = tmp_path / "qcom"
  r = cli("compile", "--dmonitoring", dm_model, "--camera", "1928x1208", "--device", "QCOM", "-o", out)
  assert r.returncode == 0, r.stdout + r.stderr
  rows = {line.split("  ")[0].strip() for line in r.stdout.splitlines()}
  assert {"pickle replay (EMU)", "a630 time estimate", "a630 vs tinygrad CI", "register tiles", "image layout"} <= rows, r.stdout
  # no register-tile set is shipped for the tiny DM: the report says its kernels keep tinygrad's heuristic opts
  assert "tinygrad's heuristic opts (no shipped register-tile set" in r.stdout, r.stdout
  art = verify_artifact(out, device="QCOM", process="dmonitoringmodeld")
  assert art.meta["flags"] == {"FLOAT16": 1, "NOLOCALS": 1, "JIT_BATCH_SIZE": 0, "OPENPILOT_HACKS": 1, "IMAGE": 2}, art.meta["flags"]
  assert art.meta["openpilot"] == "0.11" and art.meta["kernel_us"]
  # the one-channel 4x4 stride-4 stem runs as a 1x1 convolution over 16-channel blocks, and the two Elus of a normalisation
  # that feed a grouped convolution as selects (compile/image_layout.py); the outputs below are still the CPU artifact's,
  # which runs the graph as it is
  assert art.meta["image_layout"] == {"dmonitoring_stems_space_to_depth": 1, "dmonitoring_elu_as_select": 2}, art.meta["image_layout"]
  assert art.meta["dm_warp"]["in_the_model_kernel"] is True   # the warp gathers inside the model's first kernel
  assert art.meta["dm_warp"]["matrix_as"] == "crop"            # the 1928x1208 camera's matrix is a translation inside the frame
  code = """
import json, sys, numpy as np
from modeld_msm.dm_core import DMonitoringCore
from modeld_msm.frames import Frame
from selfdrive_glue import messaging
core = DMonitoringCore(sys.argv[1])
buf = np.random.default_rng(5).integers(0, 256, int(sys.argv[2]), dtype=np.uint8)
d = messaging.log_from_bytes(core.on_frame(Frame(buf, 1, 0, 1))[0][1]).driverStateV2
from tinygrad import Device
node = getattr(getattr(Device[Device.DEFAULT], "iface", None), "node", None)
# which submitqueues the frame's work went to, with their priority (0 highest), and how many submits it took
queues = sorted({(node._queues[s.queue].prio, node.priorities) for s in node.submits}) if node is not None else []
import gc
dropped = sum(getattr(q, "waits_dropped", 0) for q in gc.get_objects() if type(q).__name__ == "MSMComputeQueue")
print(json.dumps([d.wheelOnRightProb, list(d.leftDriverData.faceOrientation), d.rightDriverData.faceProb, queues, len(node.submits) if node else 0,
                  dropped, list(node.stats.order_hazards) if node else []]))
"""
  got = {}
  for name, path in (("qcom", out), ("cpu", dm_cpu_artifact)):
    p = subprocess.run([sys.executable, "-c", code, str(path), str(NV.size)], capture_output=True, text=True, cwd=REPO, timeout=600,
                       # chunks of 0.5 ms: the tiny model's whole frame is about one default chunk (2.5 ms)
                       env={**os.environ, "MODELD_DEV": "EMU+QCOM:IR3", "EMU_EXEC": "1", "MSM_INDEPENDENT_NO_WFI": "1",
                            "MSM_CHUNK_US": "500"} if name == "qcom" else None)
    assert p.returncode == 0, p.stderr
    got[name] = json.loads(p.stdout.strip().splitlines()[-1])
  np.testing.assert_allclose(np.hstack([got["qcom"][0], got["qcom"][1], got["qcom"][2]]),
                             np.hstack([got["cpu"][0], got["cpu"][1], got["cpu"][2]]), atol=0.03)
  # its GPU work went to a submitqueue at the lowest priority, cut into several submits (time-bounded chunks), like modeld's
  (queues, submits) = got["qcom"][3], got["qcom"][4]
  assert queues == [[2, 3]] and submits > 1, got["qcom"]
  # with the wait-for-idle lever on (docs/a630-time.md): some waits dropped, and level B saw no dispatch race one in flight
  (dropped, hazards) = got["qcom"][5], got["qcom"][6]
  assert dropped > 0 and hazards == [], got["qcom"]


def test_gpu_execution_time_is_the_program_run_alone_inside_the_model_time(dm_core):
  """openpilot times driverStateV2.gpuExecutionTime around the GPU run and its read-back only, inside modelExecutionTime
  (which also covers the frame's upload): a clock that ticks once per reading shows which readings bracket which."""
  ticks = iter(range(1000))
  dm_core.reset()
  saved, dm_core.clock = dm_core.clock, lambda: float(next(ticks))
  try:
    ds = _published(dm_core, _frames(3, 1)[0], 1).driverStateV2
  finally:
    dm_core.clock = saved
  # readings: 0 before the frame, 1 and 2 around the run, 3 after it
  assert ds.modelExecutionTime == 3.0 and ds.gpuExecutionTime == 1.0


@pytest.mark.parametrize("value,on", [("1", True), ("yes", True), ("0", True), ("", False), (None, False)])
def test_send_raw_pred_is_any_non_empty_value_as_openpilot_reads_it(value, on):
  env = {} if value is None else {"SEND_RAW_PRED": value}
  assert send_raw_pred(env) is on
  # and what a process started with it uses (the constant is read once, at import)
  base = {k: v for k, v in os.environ.items() if k != "SEND_RAW_PRED"}
  r = subprocess.run([sys.executable, "-c", "from modeld_msm.constants import SEND_RAW_PRED; print(SEND_RAW_PRED)"], env={**base, **env},
                     capture_output=True, text=True, timeout=60, cwd=REPO)
  assert r.stdout.strip() == str(on), r.stderr
