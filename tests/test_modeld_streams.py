"""modeld's start-up refusals and what happens to its streams and core when camerad comes back."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import REPO, ModeldHarness

from artifact.format import MANIFEST
from modeld_msm.modeld import choose_streams
from modeld_msm.runner import StreamChoice, Streams, adopt_streams, check_artifact_path
from selfdrive_glue.errors import UserError
from selfdrive_glue.visionipc import VisionStreamType


@pytest.mark.parametrize("cmd", [["-m", "cli.main", "serve", "--no-realtime"], ["-m", "modeld_msm.modeld", "--demo"]])
def test_serve_refuses_a_missing_artifact_at_once(cmd, prefix, tmp_path):
  """No camera server runs here: before the fix serve waited for one forever."""
  t0 = time.monotonic()
  r = subprocess.run([sys.executable, *cmd, "--artifact", str(tmp_path / "no" / "such")], cwd=REPO,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr, r.stderr
  assert time.monotonic() - t0 < 30


def test_artifact_path_checks(tmp_path):
  with pytest.raises(UserError, match="does not exist"):
    check_artifact_path(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(UserError, match="neither an artifact"):
    check_artifact_path(tmp_path / "empty")
  (tmp_path / "file").write_text("x")
  with pytest.raises(UserError, match="neither an artifact"):
    check_artifact_path(tmp_path / "file")
  (tmp_path / "bundle" / "1928x1208").mkdir(parents=True)
  (tmp_path / "bundle" / "1928x1208" / MANIFEST).write_text("{}")
  check_artifact_path(tmp_path / "bundle")                    # a bundle: its artifact is picked once the camera size is known
  check_artifact_path(tmp_path / "bundle" / "1928x1208")


class FakeCore:
  def __init__(self, st):
    self.main_wide, self.camera, self.fed = st.main_wide, st.camera, []

  def on_member(self, svc, msg):
    self.fed.append((svc, msg))

  def switch_main(self, main_wide):
    self.main_wide = main_wide
    self.fed.append(("switch_main", main_wide))


def _streams(main_wide=False, camera=(1928, 1208)):
  return Streams(main=None, extra=None, main_wide=main_wide, camera=camera)  # type: ignore[arg-type]


class SM:
  def __init__(self, **seen):
    self.data = seen
    self.seen = {s: s in seen for s in ("deviceState", "carState", "roadCameraState", "liveCalibration", "driverMonitoringState",
                                        "carControl", "liveDelay")}

  def __getitem__(self, s):
    return self.data[s]


def test_reconnect_to_the_same_cameras_keeps_the_core():
  old = _streams()
  core = FakeCore(old)
  assert adopt_streams(core, old, _streams(), FakeCore, SM(liveCalibration="calib")) is core and core.fed == []


def test_reconnect_with_the_main_stream_swapped_tells_the_core():
  """Road gone, wide is now main: the same core is told, and nothing else is fed to it."""
  old = _streams(main_wide=False)
  core = FakeCore(old)
  assert adopt_streams(core, old, _streams(main_wide=True), FakeCore, SM(liveCalibration="calib", carState="cs")) is core
  assert core.main_wide is True and core.fed == [("switch_main", True)]


def test_driving_stream_choice_is_openpilots():
  """Road as main with wide as extra when both exist; wide alone is main; nothing to read without a road camera."""
  road, wide, driver = VisionStreamType.ROAD, VisionStreamType.WIDE_ROAD, VisionStreamType.DRIVER
  assert choose_streams({road, wide, driver}) == StreamChoice(road, wide, main_wide=False)
  assert choose_streams({road}) == StreamChoice(road, None, main_wide=False)
  assert choose_streams({wide}) == StreamChoice(wide, None, main_wide=True)
  assert choose_streams(set()) is None and choose_streams({driver}) is None


def test_reconnect_with_a_new_camera_size_builds_a_core_for_it():
  old = _streams()
  core = FakeCore(old)
  made = []

  def make(st):
    made.append(FakeCore(st))
    return made[-1]
  new = adopt_streams(core, old, _streams(main_wide=True, camera=(1344, 760)), make, SM(liveCalibration="calib", deviceState="ds"))
  assert new is made[0] and new.camera == (1344, 760) and new.main_wide is True
  assert sorted(new.fed) == [("deviceState", "ds"), ("liveCalibration", "calib")]   # what was seen, handed over


@pytest.mark.slow
@pytest.mark.xdist_group("cpu_artifact_1928")
def test_geometry_is_checked_again_after_a_camera_restart(cpu_artifact_1928, prefix):
  """camerad comes back with buffers that are not the VENUS layout: refused as at start-up, not read as frames."""
  from selfdrive_glue.visionipc import VisionIpcServer
  h = ModeldHarness(cpu_artifact_1928)
  try:
    assert h.start(1)[0] is not None
    h.srv.close()
    time.sleep(0.5)
    w, hh = h.size
    srv = VisionIpcServer("camerad")
    for st in h.streams:   # tight NV12, not VENUS
      srv.create_buffers_with_sizes(st, 4, w, hh, w * hh * 3 // 2, w, w * hh)
    srv.start_listener()
    h.srv = srv
    frame = h.frame[:w * hh * 3 // 2]
    # one frame at a time, then time to react: a notification that lands while modeld exits would kill it with SIGUSR2
    # (the exit-status-140 defect of issue 11, not what is tested here)
    for n in range(2, 40):
      for st in h.streams:
        srv.send(st, frame, n, n * h.FRAME_NS, n * h.FRAME_NS + h.FRAME_NS)
      try:
        h.proc.wait(1.0)
        break
      except subprocess.TimeoutExpired:
        pass
    rc = h.proc.wait(30)
  finally:
    out = h.close()
  assert rc == 2 and "VENUS" in out and "Traceback" not in out, out
