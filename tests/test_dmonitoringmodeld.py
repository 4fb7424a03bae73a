"""dmonitoringmodeld as openpilot runs it: a real process reading the driver camera from our VisionIPC server and
liveCalibration from msgq, publishing driverStateV2 for every frame; bad messages and camerad restarts are survived."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, stop_process

pytestmark = pytest.mark.xdist_group("dm_cpu_artifact")
FRAME_NS = 50_000_000


class DMHarness:
  def __init__(self, artifact, args=(), size=(1928, 1208)):
    from selfdrive_glue import messaging
    from selfdrive_glue.nv12 import nv12_info
    self.messaging, self.size, self.info = messaging, size, nv12_info(*size)
    self.frame = np.random.default_rng(0).integers(0, 256, self.info.size, dtype=np.uint8)
    self.srv = self.camera_server()
    self.pm = messaging.PubMaster(["liveCalibration", "extrinsicsCalibration"])
    self.sm = messaging.SubMaster(["driverStateV2"])
    self.proc = subprocess.Popen([sys.executable, "-m", "modeld_msm.dmonitoringmodeld", "--artifact", str(artifact), "--no-realtime", *args],
                                 cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)

  def camera_server(self):
    from selfdrive_glue.visionipc import VisionIpcServer, VisionStreamType
    srv = VisionIpcServer("camerad")
    srv.create_buffers_with_sizes(VisionStreamType.DRIVER, 4, *self.size, self.info.size, self.info.stride, self.info.uv_offset)
    srv.start_listener()
    return srv

  def send(self, n: int) -> None:
    from selfdrive_glue.visionipc import VisionStreamType
    self.srv.send(VisionStreamType.DRIVER, self.frame, n, n * FRAME_NS, n * FRAME_NS + FRAME_NS)

  def wait(self, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
      self.sm.update(50)
      if self.sm.updated["driverStateV2"]:
        return self.sm["driverStateV2"]
      assert self.proc.poll() is None, stop_process(self.proc)
    return None

  def step(self, n: int, timeout: float = 20.0):
    self.send(n)
    return self.wait(timeout)

  def start(self, tries: int = 400):
    for _ in range(tries):
      if (d := self.step(1, 0.25)) is not None:
        return d
    raise AssertionError(stop_process(self.proc))

  def close(self) -> str:
    out = stop_process(self.proc)
    self.srv.close()
    return out


@pytest.mark.slow
def test_dmonitoringmodeld_serves_every_driver_frame(dm_cpu_artifact, prefix):
  h = DMHarness(dm_cpu_artifact)
  try:
    h.start()
    seen = []
    for n in range(2, 8):
      d = h.step(n)
      assert d is not None and h.sm.valid["driverStateV2"], stop_process(h.proc)
      seen.append(d.frameId)
      assert 0 < d.leftDriverData.faceProb < 1 and len(d.rightDriverData.faceOrientationStd) == 3 and d.modelExecutionTime > 0
    assert seen == list(range(2, 8))   # no frame skip: every driver frame gets its driverStateV2
    # calibration reaches the model; a corrupt message is counted and dropped, never fatal
    before = list(h.step(8).leftDriverData.faceOrientation)
    lc = h.messaging.new_message("liveCalibration", valid=True)
    lc.liveCalibration.rpyCalib = [0.0, 0.4, -0.4]
    h.pm.send("liveCalibration", b"\x00\x00\x00\x00\x05\x00\x00\x00" + b"\xff" * 16)
    assert h.step(9) is not None
    h.pm.send("liveCalibration", lc)
    time.sleep(0.2)
    after = h.step(10)
    assert after is not None and after.frameId == 10 and list(after.leftDriverData.faceOrientation) != before
    # the newest master publishes the same calibration as extrinsicsCalibration (a rename: the Event's member is unchanged)
    ec = h.messaging.new_message("liveCalibration", valid=True)
    ec.liveCalibration.rpyCalib = [0.0, 0.0, 0.0]
    h.pm.send("extrinsicsCalibration", ec)
    time.sleep(0.2)
    assert list(h.step(11).leftDriverData.faceOrientation) == pytest.approx(before, abs=1e-6)   # back to the zero calib
    # camerad restarts: the process reconnects and goes on
    h.srv.close()
    time.sleep(0.5)
    h.srv = h.camera_server()
    for n in range(12, 400):
      if (d := h.step(n, 0.25)) is not None:
        break
    assert d is not None and d.frameId >= 12, stop_process(h.proc)
    # openpilot's manager stops it with SIGINT: a clean exit that says what it did
    h.proc.send_signal(signal.SIGINT)
    assert h.proc.wait(30) == 0
  finally:
    out = h.close()
  assert "Traceback" not in out, out
  assert "dropped bad message on 'liveCalibration'" in out, out
  assert "main=driver extra=none" in out and "dmonitoringmodeld stopping" in out, out
  assert "GPU turn: follow on /dev/shm/msgq_" in out, out   # it yields to modeld through the page beside its msgq files


def test_a_driving_artifact_is_refused_before_any_camera_is_awaited(cpu_artifact_1928, prefix):
  r = subprocess.run([sys.executable, "-m", "modeld_msm.dmonitoringmodeld", "--artifact", str(cpu_artifact_1928), "--no-realtime"],
                     cwd=REPO, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert "holds the driving model (modeld), not the driver-monitoring model" in r.stderr, r.stderr


@pytest.mark.slow
def test_serve_dm_picks_its_artifact_from_a_bundle(tmp_path, dm_cpu_artifact, cpu_artifact_1928, prefix):
  """A release bundle holds both kinds: serve-dm takes dmonitoring/<w>x<h>/, modeld the <w>x<h>/ beside it."""
  b = tmp_path / "bundle"
  (b / "dmonitoring").mkdir(parents=True)
  (b / "1928x1208").symlink_to(cpu_artifact_1928)
  (b / "dmonitoring" / "1928x1208").symlink_to(dm_cpu_artifact)
  h = DMHarness(b, ("--max-frames", "2"))
  try:
    assert h.start().frameId == 1
    assert h.step(2) is not None
    assert h.proc.wait(60) == 0   # --max-frames: stops by itself
  finally:
    out = h.close()
  assert "dmonitoring/1928x1208" in out, out


def test_sigint_while_python_looks_for_the_process_module_is_a_clean_stop():
  """Issue 40.3: a SIGINT while runpy imports the package of `python -m modeld_msm.<process>` (sys.argv[0] is "-m"
  then) ended in a KeyboardInterrupt traceback, exit 1 (dmonitoringmodeld and modeld alike: the package is theirs). Simulated
  without timing: the state runpy is in, then the signal."""
  code = ("import os, signal, sys, time; sys.argv = ['-m']; import modeld_msm; os.kill(os.getpid(), signal.SIGINT); time.sleep(5); "
          "sys.exit(3)")
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
