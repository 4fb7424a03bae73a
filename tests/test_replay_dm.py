"""Replaying driver monitoring: a segment with the driver camera (dcamera.hevc, driverCameraState, driverEncodeIdx) runs
every encoded driver frame through the DM artifact beside modeld; driverStateV2 joins the output log, deterministically,
and `regress` compares it like modeld's outputs."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from offcar.regress import regress
from offcar.replay import replay_segment
from selfdrive_glue.logs import LogReader
from selfdrive_glue.route import DRIVER_CAMERA
from selfdrive_glue.synth import synth_segment

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dm_cpu_artifact")]


@pytest.fixture(scope="module")
def dseg(tmp_path_factory):
  return synth_segment(tmp_path_factory.mktemp("dseg") / "seg", 2.0, 3, driver=True, qcamera=False, progress=False).path


def _events(path):
  return [ev for ev, _ in LogReader(path).events_with_bytes()]


def test_synth_records_the_driver_camera_like_a_device(dseg):
  evs = _events(dseg / "rlog.zst")
  states = [e.driverCameraState for e in evs if e.which() == "driverCameraState"]
  index = [e.driverEncodeIdx for e in evs if e.which() == "driverEncodeIdx"]
  assert len(states) == 40 and (dseg / DRIVER_CAMERA).is_file()
  # segment 0: the encoder starts two frames late, then every frame is encoded, in order
  assert [int(i.frameId) for i in index] == [int(s.frameId) for s in states][2:] and [int(i.segmentId) for i in index] == list(range(38))
  from selfdrive_glue.video import VideoReader
  assert VideoReader(dseg / DRIVER_CAMERA).count() == 38


def test_driver_frames_replay_through_the_dm_and_repeat_exactly(dseg, cpu_artifact_1928, dm_cpu_artifact, tmp_path):
  a = replay_segment(dseg, cpu_artifact_1928, tmp_path / "a.zst", dm_artifact=dm_cpu_artifact)
  replay_segment(dseg, cpu_artifact_1928, tmp_path / "b.zst", dm_artifact=dm_cpu_artifact)
  assert a.dm_published == 38 and "driver monitoring: 38 driverStateV2" in a.summary()
  assert (tmp_path / "a.zst").read_bytes() == (tmp_path / "b.zst").read_bytes()   # the log's clock: no wall time in the bytes
  out = [e for e in _events(tmp_path / "a.zst") if e.which() == "driverStateV2"]
  log = {int(e.driverCameraState.frameId): e.logMonoTime for e in _events(dseg / "rlog.zst") if e.which() == "driverCameraState"}
  assert [int(e.driverStateV2.frameId) for e in out] == sorted(log)[2:]
  assert all(e.logMonoTime == log[int(e.driverStateV2.frameId)] and e.valid for e in out)
  assert all(e.driverStateV2.modelExecutionTime == 0 for e in out)
  # the replayed step is the live one: the same frame through DMonitoringCore gives the same driverStateV2
  from modeld_msm.dm_core import DMonitoringCore
  from modeld_msm.frames import Frame
  from selfdrive_glue import messaging
  from selfdrive_glue.video import VideoReader
  core = DMonitoringCore(dm_cpu_artifact, clock=lambda: 0.0)
  cal = next(e for e in _events(dseg / "rlog.zst") if e.which() == "liveCalibration")
  core.on_message(cal)
  ring = [np.zeros(core.frames.nv12.size, np.uint8)]
  first = next(iter(VideoReader(dseg / DRIVER_CAMERA).frames(ring)))
  live = messaging.log_from_bytes(core.on_frame(Frame(first, int(out[0].driverStateV2.frameId), 0, 0))[0][1]).driverStateV2
  assert list(live.leftDriverData.faceOrientation) == list(out[0].driverStateV2.leftDriverData.faceOrientation)


def test_regress_catches_a_dm_change(dseg, cpu_artifact_1928, dm_cpu_artifact, tmp_path):
  from compile.build import compile_artifact
  from compile.refmodels.dmonitoring import write_dm_model
  models = {"dmonitoring": write_dm_model(tmp_path / "m", "tiny", 9).path}
  other = compile_artifact("dmonitoring", models, (1928, 1208), "CPU", tmp_path / "dm9", log=lambda *_: None)
  replay_segment(dseg, cpu_artifact_1928, tmp_path / "ref.zst", dm_artifact=dm_cpu_artifact)
  replay_segment(dseg, cpu_artifact_1928, tmp_path / "new.zst", dm_artifact=other.out_dir)
  results, _ = regress(tmp_path / "new.zst", tmp_path / "ref.zst")
  bad = {f.path for r in results for f in r.fields.values() if f.failed}
  assert any(p.startswith("driverStateV2.leftDriverData.faceOrientation") for p in bad), bad
  assert not any(p.startswith("modelV2") for p in bad), bad   # modeld's outputs did not move


def test_without_the_driver_video_the_driving_replay_goes_on(dseg, cpu_artifact_1928, dm_cpu_artifact, tmp_path):
  seg = shutil.copytree(dseg, tmp_path / "seg")
  (seg / DRIVER_CAMERA).unlink()
  r = replay_segment(seg, cpu_artifact_1928, tmp_path / "o.zst", dm_artifact=dm_cpu_artifact)
  assert r.dm_published == 0 and r.published > 0 and f"no {DRIVER_CAMERA}" in r.summary()
  assert not any(e.which() == "driverStateV2" for e in _events(tmp_path / "o.zst"))
