"""modeld's behaviour: openpilot's test_modeld invariants on the shared frame step and across real processes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ModeldHarness, event_reader, stop_process

from selfdrive_glue import messaging
from selfdrive_glue.nv12 import nv12_info

pytestmark = pytest.mark.xdist_group("cpu_artifact_1928")
INFO = nv12_info(1928, 1208)
FRAME_NS = 50_000_000


def _calibrated(core, frame_id: int = 1) -> None:
  core.on_message(event_reader("deviceState", deviceType="tici"))
  core.on_message(event_reader("roadCameraState", frameId=frame_id, sensor="ar0231"))
  core.on_message(event_reader("liveCalibration", rpyCalib=[0.0, 0.0, 0.0]))


@pytest.fixture(scope="module")
def core_factory(cpu_artifact_1928):
  from modeld_msm.core import ModeldCore
  return lambda: ModeldCore(cpu_artifact_1928)


def _frame(n: int, buf=None):
  from modeld_msm.core import Frame
  buf = np.zeros(INFO.size, np.uint8) if buf is None else buf
  sof = n * FRAME_NS
  return Frame(buf, n, sof, sof + FRAME_NS)


def _decode(out):
  return {svc: messaging.log_from_bytes(b) for svc, b in out}


def test_frame_ids_and_timestamps_propagate(core_factory):
  core = core_factory()
  road, wide = np.zeros(INFO.size, np.uint8), np.full(INFO.size, 7, np.uint8)
  for n in range(1, 8):
    core.on_message(event_reader("roadCameraState", frameId=n, sensor="ar0231"))
    out = core.on_frame(_frame(n, road), _frame(n, wide))
    assert [s for s, _ in out] == ["modelV2", "drivingModelData", "cameraOdometry"]
    d = _decode(out)
    m, o, dm = d["modelV2"].modelV2, d["cameraOdometry"].cameraOdometry, d["drivingModelData"].drivingModelData
    assert m.frameId == m.frameIdExtra == n and m.timestampEof == n * FRAME_NS + FRAME_NS
    assert m.frameAge == 0 and m.frameDropPerc == 0
    assert o.frameId == n and o.timestampEof == m.timestampEof and dm.frameId == n
    assert m.modelExecutionTime > 0 and len(m.position.x) == 33 and len(m.laneLines) == 4 and len(m.leadsV3) == 3


def test_valid_only_after_calibration(core_factory):
  core = core_factory()
  d = _decode(core.on_frame(_frame(1)))
  assert not d["modelV2"].valid and not d["cameraOdometry"].valid and not d["drivingModelData"].valid
  assert not core.live_calib_seen and not core.tfm.any()  # zero transform before calibration, like openpilot
  _calibrated(core, 2)
  d = _decode(core.on_frame(_frame(2)))
  assert d["modelV2"].valid and d["cameraOdometry"].valid and core.live_calib_seen
  assert core.tfm[2, 2] == pytest.approx(1.0) and core.tfm[0, 0] == pytest.approx(2.90989, rel=1e-4)


def test_main_stream_swap_recomputes_the_transforms_from_the_last_calibration(core_factory):
  """The road camera goes away and wide becomes main (a reconnect): the next frame warps with the wide camera's
  transforms, from the calibration seen before, without a new liveCalibration."""
  from selfdrive_glue.camera import model_transforms
  core = core_factory()
  _calibrated(core)
  core.on_frame(_frame(1))
  road_tfm = core.tfm.copy()
  core.switch_main(True)
  core.on_frame(_frame(2))
  want, _ = model_transforms(np.zeros(3), "tici", "ar0231", main_wide=True)
  assert not np.allclose(core.tfm, road_tfm) and np.allclose(core.tfm, want)
  core.switch_main(True)                     # no change: nothing recomputed
  assert "liveCalibration" not in core.updated


def test_nothing_published_on_dropped_frames(core_factory):
  core = core_factory()
  _calibrated(core)
  assert core.on_frame(_frame(1))
  assert core.on_frame(_frame(2))
  assert core.on_frame(_frame(5)) == []          # 3 and 4 never came: prepare-only, nothing sent
  assert core.stats.dropped_steps == 1
  d = _decode(core.on_frame(_frame(6)))
  assert d["modelV2"].modelV2.frameId == 6
  # cameraOdometry is only valid on a step without drops: 6 followed 5 directly
  assert d["cameraOdometry"].valid


def test_frame_age_from_road_camera_state(core_factory):
  core = core_factory()
  assert core.on_frame(_frame(8)) == []   # the first frame after 0 counts as a drop, as in openpilot
  core.on_message(event_reader("roadCameraState", frameId=12, sensor="ar0231"))
  d = _decode(core.on_frame(_frame(9)))
  assert d["modelV2"].modelV2.frameAge == 3


def test_nonfinite_outputs_publish_invalid_and_keep_going(core_factory, caplog):
  core = core_factory()
  _calibrated(core)
  real_run = core.model.run

  def poisoned(*a, **k):
    out, raw = real_run(*a, **k)
    if raw is not None:
      raw = raw.copy()
      raw[3] = np.nan
    return out, raw
  core.model.run = poisoned
  with caplog.at_level("ERROR", logger="modeld"):
    for n in range(1, 4):
      d = _decode(core.on_frame(_frame(n)))
      assert not d["modelV2"].valid and not d["cameraOdometry"].valid
  assert core.stats.nonfinite_steps == 3
  assert sum("NaN/inf" in r.message for r in caplog.records) == 1   # once per burst
  core.model.run = real_run
  assert _decode(core.on_frame(_frame(4)))["modelV2"].valid


def test_bad_calibration_is_counted_not_fatal(core_factory, caplog):
  core = core_factory()
  _calibrated(core)
  core.on_frame(_frame(1))
  good = core.tfm.copy()
  core.on_message(event_reader("liveCalibration", rpyCalib=[0.1, float("nan"), 0.0]))
  with caplog.at_level("ERROR", logger="modeld"):
    assert core.on_frame(_frame(2))
  assert core.stats.bad_inputs == 1 and np.array_equal(core.tfm, good)
  assert any("liveCalibration" in r.message for r in caplog.records)


def _published(core, n: int):
  """One step's modelV2: whether it is valid, and its action."""
  e = _decode(core.on_frame(_frame(n)))["modelV2"]
  return SimpleNamespace(valid=e.valid, action=e.modelV2.action)


def _spy_action_t(core):
  """Record the action_t each step hands the model, as master's combined model would be given it."""
  seen, real_run = [], core.model.run

  def spy(*a, action_t=None, **k):
    seen.append(action_t)
    return real_run(*a, action_t=action_t, **k)   # the tiny pair's programs read no action_t: the plan path is kept
  core.model.run = spy
  return seen


def test_a_bad_lateral_delay_is_counted_never_fatal_never_sticky(core_factory, caplog):
  """Issue 40.1/40.2: a lateralDelay <= -0.075 s stopped modeld (a crash loop under the manager); a NaN one reached
  master's action_t and, through the smoothing, desiredCurvature for good."""
  core = core_factory()
  _calibrated(core)
  core.on_message(event_reader("carState", vEgo=20.0))
  seen = _spy_action_t(core)
  n = 0
  with caplog.at_level("ERROR", logger="modeld"):
    for bad in (-0.1, float("nan"), float("inf"), -1e30):
      n += 1
      core.on_message(event_reader("liveDelay", lateralDelay=bad))
      m = _published(core, n)
      assert m.valid and np.isfinite(m.action.desiredCurvature), bad
  assert core.stats.bad_inputs == 4 and sum("liveDelay.lateralDelay" in r.message for r in caplog.records) == 1
  assert all(np.isfinite(a).all() for a in seen) and [round(float(a[0, 0]), 4) for a in seen] == [0.275] * 4   # the default, 0.2 s
  core.on_message(event_reader("liveDelay", lateralDelay=0.5))
  m = _published(core, n + 1)
  assert m.valid and float(seen[-1][0, 0]) == pytest.approx(0.575)   # the good value at once
  core.on_message(event_reader("liveDelay", lateralDelay=float("nan")))
  core.on_frame(_frame(n + 2))
  assert float(seen[-1][0, 0]) == pytest.approx(0.575)   # then the last good one, not the default


def test_bad_car_state_and_car_params_are_counted(cpu_artifact_1928, core_factory):
  from modeld_msm.core import DEMO_LONG_ACTUATOR_DELAY, ModeldCore
  cp = messaging.car.CarParams.new_message(longitudinalActuatorDelay=float("nan")).as_reader()
  core = ModeldCore(cpu_artifact_1928, car_params=cp)
  assert core.long_delay == DEMO_LONG_ACTUATOR_DELAY and core.stats.bad_inputs == 1
  _calibrated(core)
  for n, v in enumerate((float("nan"), float("inf"), 1e9), 1):
    core.on_message(event_reader("carState", vEgo=v, steeringTorque=float("nan"), leftBlinker=True))
    m = _published(core, n)
    assert m.valid and np.isfinite(m.action.desiredCurvature) and np.isfinite(m.action.desiredAcceleration), v
  assert core.stats.bad_inputs == 1 + 3 * 2
  core.on_message(event_reader("carState", vEgo=20.0))
  assert _published(core, 4).valid


def test_a_nonfinite_action_is_published_invalid_and_not_kept(core_factory):
  """A NaN plan (a model's bad frame) made a NaN action, and the smoothing kept it in prev_action after the model
  recovered: every later desiredCurvature NaN."""
  core = core_factory()
  _calibrated(core)
  core.on_message(event_reader("carState", vEgo=20.0))
  real_run = core.model.run

  def nan_plan(*a, **k):
    out, raw = real_run(*a, **k)
    if out is not None:
      out = {**out, "plan": np.full_like(out["plan"], np.nan)}
    return out, raw
  core.model.run = nan_plan
  assert not _published(core, 1).valid
  core.model.run = real_run
  for n in (2, 3):
    m = _published(core, n)
    assert m.valid and np.isfinite(m.action.desiredCurvature) and np.isfinite(m.action.desiredAcceleration)


def test_desire_pulse_only_on_rising_edge(core_factory):
  core = core_factory()
  ms = core.model
  z = np.zeros(INFO.size, np.uint8)
  eye = np.eye(3, dtype=np.float32)
  tc = np.array([[1, 0]], np.float32)
  d = np.zeros(8, np.float32)
  d[3] = 1
  ms.run(z, z, eye, eye, d, tc, True)            # edge on a dropped frame: prev is updated, the pulse is lost
  assert ms.host["desire"][3] == 1                   # written for the warp JIT's inputs anyway
  ms.run(z, z, eye, eye, d, tc, False)
  assert ms.host["desire"][3] == 0                   # held: no new edge
  ms.run(z, z, eye, eye, np.zeros(8, np.float32), tc, False)
  ms.run(z, z, eye, eye, d, tc, False)
  assert ms.host["desire"][3] == 1
  d0 = np.zeros(8, np.float32)
  d0[0] = 1
  ms.run(z, z, eye, eye, d0, tc, False)
  assert ms.host["desire"][0] == 0                   # "none" never pulses


# ---- across processes: our VisionIPC server + msgq publishers -> `python -m modeld_msm.modeld` -> our SubMaster ----

def _spawn_modeld(artifact, extra_env=None):
  env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
  return subprocess.Popen([sys.executable, "-m", "modeld_msm.modeld", "--artifact", str(artifact), "--demo"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_cycle_collector_frees_cycles_and_freezes_what_the_first_frames_built():
  """Full collections between frames traverse only what came after the first frames: state built during them (the
  emulator's per-program interpreters: 440k objects) is frozen once, after its garbage is freed."""
  import gc

  from modeld_msm.runner import CycleCollector

  class Node:
    def __init__(self):
      self.me = self

  c = CycleCollector(full_every=4, settle_frames=3)
  was_enabled = gc.isenabled()
  gc.disable()   # as in modeld: only the collector's own passes free cycles
  try:
    c.start()
    frozen = gc.get_freeze_count()
    kept = [[i] for i in range(20_000)]   # built by the first frames, alive for good
    for _ in range(100):
      Node()                              # a cycle a step leaves behind
    for _ in range(3):
      c.after_frame()
    assert c.freed >= 100 and gc.get_freeze_count() >= frozen + len(kept) and c.settle_ms > 0
    freed = c.freed
    for _ in range(100):
      Node()
    for _ in range(4):                    # the 4th frame since start is a full collection
      c.after_frame()
    assert c.freed >= freed + 100 and c.longest_ms >= 0
  finally:
    gc.unfreeze()
    if was_enabled:
      gc.enable()


@pytest.mark.slow
def test_modeld_process_end_to_end(cpu_artifact_1928, prefix):
  h = ModeldHarness(cpu_artifact_1928)
  try:
    m, _ = h.start(1)
    seen = [m.frameId]
    for n in range(2, 10):
      m, o = h.step(n)
      assert m is not None, stop_process(h.proc)
      seen.append(m.frameId)
      assert m.frameId == m.frameIdExtra == o.frameId and m.timestampEof == m.frameId * FRAME_NS + FRAME_NS
    assert seen[1:] == list(range(2, 10))
    # corrupt bytes on a subscribed service are counted and ignored; modeld keeps publishing
    h.pm.send("carState", b"\x00\x00\x00\x00\x05\x00\x00\x00" + b"\xff" * 16)
    m, _ = h.step(10)
    assert m is not None and m.frameId == 10
    # a frame with only the wide camera: nothing may be published for it
    h.send(13, road=False)
    assert h.wait_model(1.5)[0] is None
    # the next road frame follows a gap, so it only advances the image queues (prepare-only): still nothing
    h.send(14)
    assert h.wait_model(1.5)[0] is None
    m, o = h.step(15)
    assert m is not None and m.frameId == 15 and o.frameId == 15
    # camerad restarts: modeld waits, reconnects to the new server and goes on publishing
    h.restart_camera()
    for n in range(16, 400):
      m, _ = h.step(n, 0.25)
      if m is not None:
        break
    assert m is not None and m.frameId >= 16, stop_process(h.proc)
  finally:
    out = h.close()
  assert "Traceback" not in out, out
  assert "dropped bad message on 'carState'" in out, out
  # with the collector off (realtime), modeld collects between frames and says what it freed: a short run may free
  # nothing (with artifact/cpu_replay.py this one freed 0), so freeing itself is test_cycle_collector's, on planted cycles
  assert re.search(r"\d+ cyclic objects freed between frames", out), out[-2000:]
  # modeld leads the GPU turn the DM yields to, on a page beside its msgq files (a CPU artifact submits no GPU work, so
  # it marks nothing: tests/test_gpu_turn.py has the marks)
  from modeld_msm import gpu_turn
  path = f"/dev/shm/msgq_{prefix}/{gpu_turn.PAGE_NAME}"
  assert os.path.exists(path) and gpu_turn.Page(path).seq % 2 == 0 and "GPU turn: lead" in out, out[-2000:]


@pytest.mark.slow
def test_modeld_refuses_wrong_stride(cpu_artifact_1928, prefix):
  from selfdrive_glue.visionipc import VisionIpcServer, VisionStreamType
  srv = VisionIpcServer("camerad")
  srv.create_buffers_with_sizes(VisionStreamType.ROAD, 2, 1928, 1208, 1928 * 1208 * 3 // 2, 1928, 1928 * 1208)  # tight, not VENUS
  srv.start_listener()
  p = _spawn_modeld(cpu_artifact_1928)
  try:
    rc = p.wait(60)
  finally:
    out = stop_process(p)
    srv.close()
  assert rc != 0 and "VENUS" in out and "Traceback" not in out, out
