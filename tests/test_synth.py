import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from selfdrive_glue.errors import UserError
from selfdrive_glue.logs import LogReader
from selfdrive_glue.road_render import RoadScene
from selfdrive_glue.route import expand_segments, open_segment
from selfdrive_glue.synth import ENCODER_LEAD, encoded_positions, synth_route, synth_segment
from selfdrive_glue.video import VideoReader, venus_planes


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
  d = tmp_path_factory.mktemp("synth") / "seg"
  synth_segment(d, 1.0, 21, "1344x760", progress=False)
  return d


def test_segment_layout_and_rates(seg):
  assert sorted(p.name for p in seg.iterdir()) == ["ecamera.hevc", "fcamera.hevc", "qcamera.ts", "qlog.zst", "rlog.zst"]
  evs = list(LogReader(seg / "rlog.zst"))
  counts = Counter(e.which() for e in evs)
  assert counts == {"roadCameraState": 20, "wideRoadCameraState": 20, "driverMonitoringState": 20, "carState": 100, "carControl": 100,
                    "liveCalibration": 4, "liveDelay": 4, "deviceState": 2, "carParams": 1, "initData": 1,
                    "roadEncodeIdx": 20 - ENCODER_LEAD - 1, "wideRoadEncodeIdx": 20 - ENCODER_LEAD}
  assert evs[0].which() == "initData" and str(evs[0].initData.deviceType) == "mici"
  times = [e.logMonoTime for e in evs]
  assert times == sorted(times)
  assert all(e.valid for e in evs)
  road = [e.roadCameraState for e in evs if e.which() == "roadCameraState"]
  wide = [e.wideRoadCameraState for e in evs if e.which() == "wideRoadCameraState"]
  assert [r.frameId for r in road] == list(range(20)) == [w.frameId for w in wide]
  assert all(str(r.sensor) == "os04c10" for r in road)
  sof = np.array([r.timestampSof for r in road])
  assert (np.diff(sof) == 50_000_000).all()
  assert all(abs(int(w.timestampSof) - int(r.timestampSof)) < 10_000_000 for r, w in zip(road, wide))  # pairable
  dev = next(e.deviceState for e in evs if e.which() == "deviceState")
  assert str(dev.deviceType) == "mici"
  assert len(list(LogReader(seg / "qlog.zst"))) < len(evs)


def test_messages_agree_with_the_rendered_scene(seg):
  scene = RoadScene(21, "1344x760")
  evs = list(LogReader(seg / "rlog.zst"))
  t0 = next(e.logMonoTime for e in evs if e.which() == "carParams")  # the first frame's time (initData comes just before)
  cal = next(e.liveCalibration for e in evs if e.which() == "liveCalibration")
  assert list(cal.rpyCalib) == pytest.approx(scene.calib_rpy, abs=1e-7)
  for e in [e for e in evs if e.which() == "carState"][::17]:
    ego = scene.ego((e.logMonoTime - t0) / 1e9)
    assert e.carState.vEgo == pytest.approx(ego.v_ego, rel=1e-6)
    assert e.carState.steeringAngleDeg == pytest.approx(ego.steering_angle_deg, rel=1e-5, abs=1e-5)
    assert e.carState.leftBlinker == ego.left_blinker


def test_hevc_decodes_to_the_rendered_frames(seg):
  scene = RoadScene(21, "1344x760")
  positions = encoded_positions(20, 0)
  for (name, which), pos in zip((("fcamera.hevc", "road"), ("ecamera.hevc", "wide")), positions):
    r = VideoReader(seg / name)
    assert (r.width, r.height) == (1344, 760)
    frames = list(r.frames())
    assert len(frames) == len(pos)
    for k in (0, 7, len(pos) - 1):  # video frame k shows the moment of camera state pos[k]
      want = venus_planes(scene.render(pos[k] / 20, which), scene.info)[0].astype(int)
      got = venus_planes(frames[k], scene.info)[0]
      assert np.abs(got - want).mean() < 2.5, (name, k)
  assert VideoReader(seg / "qcamera.ts").count() == len(positions[0])


def test_encode_index_is_real_shaped(tmp_path):
  """Like a device: segment 0's videos start ENCODER_LEAD states late, one road frame per segment is never encoded, and
  each encoded frame has an entry (camera frameId -> segmentNum/segmentId, encodeId counting from the route's start)."""
  synth_route(tmp_path, 2, 0.5, 5, "1344x760", qcamera=False, progress=False)
  segs = expand_segments([str(tmp_path)])
  encode_ids = {"roadEncodeIdx": [], "wideRoadEncodeIdx": []}
  for n, s in enumerate(segs):
    evs = list(LogReader(s.log()))
    states = [e.roadCameraState.frameId for e in evs if e.which() == "roadCameraState"]
    for svc, cam, pos in zip(("roadEncodeIdx", "wideRoadEncodeIdx"), ("fcamera.hevc", "ecamera.hevc"), encoded_positions(10, n)):
      idx = [getattr(e, svc) for e in evs if e.which() == svc]
      assert [i.frameId for i in idx] == [states[p] for p in pos]
      assert [i.segmentId for i in idx] == list(range(len(idx))) == [i.segmentIdEncode for i in idx]
      assert {i.segmentNum for i in idx} == {n} and {str(i.type) for i in idx} == {"fullHEVC"}
      assert VideoReader(s.path / cam).count() == len(idx)
      encode_ids[svc] += [i.encodeId for i in idx]
    road = [e.roadEncodeIdx.frameId for e in evs if e.which() == "roadEncodeIdx"]
    lead = ENCODER_LEAD if n == 0 else 0
    assert road[0] == states[lead]  # segment 0: the first states have no encoded frame
    assert len(set(states[lead:]) - set(road)) == 1  # one dropped road frame
  for ids in encode_ids.values():
    assert ids == list(range(len(ids)))  # continuous across the segment boundary
  old = synth_segment(tmp_path / "old", 0.5, 5, "1344x760", qcamera=False, progress=False, encode_index=False)
  kinds = {e.which() for e in LogReader(old.path / "rlog.zst")}
  assert not kinds & {"initData", "roadEncodeIdx", "wideRoadEncodeIdx"}
  assert VideoReader(old.path / "fcamera.hevc").count() == old.encoded == old.frames == 10


def test_deterministic_from_seed(tmp_path, seg):
  synth_segment(tmp_path / "again", 1.0, 21, "1344x760", progress=False)
  for name in ("rlog.zst", "qlog.zst"):
    assert (tmp_path / "again" / name).read_bytes() == (seg / name).read_bytes()
  a = [venus_planes(f, RoadScene(0, "1344x760").info)[0] for f in VideoReader(seg / "fcamera.hevc").frames()]
  b = [venus_planes(f, RoadScene(0, "1344x760").info)[0] for f in VideoReader(tmp_path / "again" / "fcamera.hevc").frames()]
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  synth_segment(tmp_path / "other", 1.0, 22, "1344x760", progress=False, qcamera=False, wide=False)
  assert (tmp_path / "other" / "rlog.zst").read_bytes() != (seg / "rlog.zst").read_bytes()
  assert not (tmp_path / "other" / "ecamera.hevc").exists()
  assert "wideRoadCameraState" not in {e.which() for e in LogReader(tmp_path / "other" / "rlog.zst")}


def test_route_of_consecutive_segments(tmp_path):
  res = synth_route(tmp_path, 2, 0.5, 3, "1344x760", qcamera=False, wide=False, progress=False)
  segs = expand_segments([str(tmp_path)])
  assert [s.number for s in segs] == [0, 1] and segs[0].route == res[0].route
  ids = [[e.roadCameraState.frameId for e in LogReader(s.log()) if e.which() == "roadCameraState"] for s in segs]
  assert ids == [list(range(10)), list(range(10, 20))]  # the drive continues across the boundary
  assert open_segment(segs[1].path).camera("fcamera.hevc") is not None


def test_cli_writes_and_refuses_to_overwrite(tmp_path):
  cmd = [sys.executable, "-m", "cli.main", "synth", "-o", str(tmp_path / "s"), "--seconds", "0.25", "--seed", "4",
         "--camera", "1344x760", "--quiet", "--no-qcamera"]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert (tmp_path / "s" / "rlog.zst").exists() and "5 frames" in r.stdout
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "not empty" in r.stderr and len(r.stderr.strip().splitlines()) == 1
  r = subprocess.run(cmd[:-4] + ["--camera", "640x480"], capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "640x480" in r.stderr


def test_segment_lookup_errors(tmp_path):
  with pytest.raises(UserError, match="not found"):
    open_segment(tmp_path / "missing--0")
  (tmp_path / "file").write_text("x")
  with pytest.raises(UserError, match="not a segment directory"):
    open_segment(tmp_path / "file")
  (tmp_path / "empty--3").mkdir()
  with pytest.raises(UserError, match="no rlog or qlog"):
    expand_segments([str(tmp_path / "empty--3")])
