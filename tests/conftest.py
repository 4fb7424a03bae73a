"""Shared fixtures: the tiny reference models and CPU artifacts compiled from them, built once per test session.

A tiny compile takes ~30-40 s on a loaded 2-core box, so every test that needs an artifact reuses these. Under
pytest-xdist (`-n 2 --dist loadgroup`) mark tests that share one with `pytest.mark.xdist_group(<fixture name>)`
so a single worker builds it. The artifacts are read-only for tests: to tamper, copy first (see `clone_artifact`).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A Tensor made without a device lands on tinygrad's first usable one, picked once per process at first use. Pick it now,
# before a test puts the emulated render node behind QCOM: otherwise the pick (QCOM or CPU) depends on the tests' order.
from tinygrad import Device  # noqa: E402

Device.DEFAULT  # noqa: B018


def run_cli(*args, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  """`modeld-msm ARGS` in a real subprocess of this interpreter (the venv's), output captured as text."""
  return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                        cwd=REPO, env={**os.environ, **(env or {})})


def clone_artifact(src: Path, dst: Path) -> Path:
  """Copy an artifact by hard links (cheap for 50+ MB of pickles). Never write into a clone's files in place:
  replace them with `rewrite_file`, which unlinks first, so the session artifact stays intact."""
  shutil.copytree(src, dst, copy_function=os.link)
  return dst


def rewrite_file(path: Path, data: bytes) -> None:
  path.unlink()
  path.write_bytes(data)


@pytest.fixture
def prefix(monkeypatch):
  """A private OPENPILOT_PREFIX: this test's msgq files and VisionIPC sockets, removed afterwards."""
  import glob
  import uuid
  p = f"t{uuid.uuid4().hex[:11]}"
  monkeypatch.setenv("OPENPILOT_PREFIX", p)
  yield p
  shutil.rmtree(f"/dev/shm/msgq_{p}", ignore_errors=True)
  for leftover in glob.glob(f"/tmp/{p}_visionipc_*"):   # a server killed mid-test cannot unlink its socket
    os.unlink(leftover)


def event_reader(service: str, **fields):
  """A real capnp Event of `service` with the given member fields, as a reader decoded from its bytes."""
  from selfdrive_glue import messaging
  e = messaging.new_message(service, valid=True)
  m = getattr(e, service)
  for k, v in fields.items():
    setattr(m, k, v)
  return messaging.log_from_bytes(e.to_bytes())


class FakeControlSocket:
  """The listening socket of a camera server written in a test: each connection's request goes to answer(conn, request)
  on a thread of its own; close() stops it and removes the socket file."""

  def __init__(self, path: str, answer):
    self.path, self.answer = path, answer
    self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    self.sock.bind(path)
    self.sock.listen(4)
    self.sock.settimeout(0.1)   # so the thread notices close()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        conn, _ = self.sock.accept()
      except OSError:
        continue
      with conn:
        self.answer(conn, conn.recv(64))

  def close(self) -> None:
    self._stop.set()
    self._thread.join(2)
    self.sock.close()
    Path(self.path).unlink(missing_ok=True)


def stop_process(p: subprocess.Popen, timeout: float = 10) -> str:
  """SIGINT (what openpilot's manager sends), then SIGKILL; returns what the process printed."""
  if p.poll() is None:
    p.send_signal(2)
    try:
      p.wait(timeout)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
  return p.stdout.read() if p.stdout else ""


@pytest.fixture(scope="session")
def cli():
  return run_cli


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
  """Directory with driving_vision.onnx + driving_policy.onnx, `tiny` size, seed 0."""
  from compile.refmodels.driving import write_models
  d = tmp_path_factory.mktemp("tiny_models")
  write_models(d, "tiny", 0)
  return d


@pytest.fixture(scope="session")
def cpu_artifact_1928(tiny_models, tmp_path_factory) -> Path:
  """CPU artifact of the tiny models for 1928x1208, built through the CLI in a subprocess (its stdout is kept
  beside it in compile.log)."""
  out = tmp_path_factory.mktemp("cpu_artifact_1928") / "artifact"
  r = run_cli("compile", "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx",
              "--camera", "1928x1208", "--device", "CPU", "-o", out)
  assert r.returncode == 0, f"modeld-msm compile failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
  (out.parent / "compile.log").write_text(r.stdout)
  return out


@pytest.fixture(scope="session")
def cpu_artifact_1344(tiny_models, tmp_path_factory) -> Path:
  """CPU artifact of the tiny models for 1344x760, built in-process through `compile.build.compile_artifact`."""
  from compile.build import compile_artifact
  out = tmp_path_factory.mktemp("cpu_artifact_1344") / "artifact"
  models = {"vision": tiny_models / "driving_vision.onnx", "policy": tiny_models / "driving_policy.onnx"}
  report = compile_artifact("driving", models, (1344, 760), "CPU", out,
                            log=lambda *_: None)
  (out.parent / "compile.log").write_text(report.table())
  return out


@pytest.fixture(scope="session")
def dm_model(tmp_path_factory) -> Path:
  """dmonitoring_model.onnx, `tiny` size, seed 0."""
  from compile.refmodels.dmonitoring import write_dm_model
  return write_dm_model(tmp_path_factory.mktemp("dm_model"), "tiny", 0).path


@pytest.fixture(scope="session")
def dm_cpu_artifact(dm_model, tmp_path_factory) -> Path:
  """CPU driver-monitoring artifact of the tiny DM model for 1928x1208, built in-process (compile.build)."""
  from compile.build import compile_artifact
  out = tmp_path_factory.mktemp("dm_cpu_artifact") / "artifact"
  report = compile_artifact("dmonitoring", {"dmonitoring": dm_model}, (1928, 1208), "CPU", out, log=lambda *_: None)
  (out.parent / "compile.log").write_text(report.table())
  return out


@pytest.fixture(scope="session")
def qcom_artifact(tiny_models, tmp_path_factory, cli) -> Path:
  """QCOM artifact of the tiny models for 1928x1208, compiled through the CLI in a subprocess (log kept beside it).

  Built once per run even when xdist spreads this module over workers (pytest 9.2 ignores xdist 3.8's xdist_group, which renames
  `item._nodeid`): workers share the run's base directory and take turns on a lock; the first builds, the others reuse it."""
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = tmp_path_factory.getbasetemp().parent / "qcom_artifact"
    root.mkdir(exist_ok=True)
  else:
    root = tmp_path_factory.mktemp("qcom_artifact")
  out = root / "artifact"
  with open(root / ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (out / "manifest.json").exists():
      r = cli("compile", "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx",
              "--camera", "1928x1208", "--device", "QCOM", "-o", out)
      assert r.returncode == 0, f"modeld-msm compile --device QCOM failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
      (root / "compile.log").write_text(r.stdout)
  return out


class ModeldHarness:
  """Real processes around a real modeld: our VisionIPC server and msgq publishers -> `python -m modeld_msm.modeld`
  -> our SubMaster. `send(n)` publishes camera states + frames with frame id n; `wait_model` returns what modeld sent."""

  FRAME_NS = 50_000_000

  def __init__(self, artifact: Path, env: dict[str, str] | None = None, size: tuple[int, int] = (1928, 1208), master_names: bool = False):
    import numpy as np

    from selfdrive_glue import messaging
    from selfdrive_glue.nv12 import nv12_info
    from selfdrive_glue.visionipc import VisionStreamType
    # master_names: publish only openpilot master's names (since 2026-08) of the road camera and calibration services
    self.road, calib = ("narrowRoadCameraState", "extrinsicsCalibration") if master_names else ("roadCameraState", "liveCalibration")
    self.messaging = messaging
    self.streams = (VisionStreamType.NARROW_ROAD if master_names else VisionStreamType.ROAD, VisionStreamType.WIDE_ROAD)
    self.size, self.info = size, nv12_info(*size)
    self.frame = np.zeros(self.info.size, np.uint8)
    self.srv = self.camera_server(self.streams)
    self.pm = messaging.PubMaster([self.road, "wideRoadCameraState", "deviceState", calib, "carState"])
    self.sm = messaging.SubMaster(["modelV2", "drivingModelData", "cameraOdometry"], poll="modelV2")
    self.proc = subprocess.Popen([sys.executable, "-m", "modeld_msm.modeld", "--artifact", str(artifact), "--demo"],
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ds = messaging.new_message("deviceState", valid=True)
    ds.deviceState.deviceType = "tici"
    lc = messaging.new_message(calib, valid=True)
    lc.liveCalibration.rpyCalib = [0.0, 0.0, 0.0]   # the member keeps 0.11's name in our schema (a rename keeps the ordinal)
    self._calibration = (("deviceState", ds.to_bytes()), (calib, lc.to_bytes()))

  def camera_server(self, streams):
    from selfdrive_glue.visionipc import VisionIpcServer
    srv = VisionIpcServer("camerad")
    for st in streams:
      srv.create_buffers_with_sizes(st, 4, *self.size, self.info.size, self.info.stride, self.info.uv_offset)
    srv.start_listener()
    return srv

  def restart_camera(self) -> None:
    import time
    self.srv.close()
    time.sleep(0.5)
    self.srv = self.camera_server(self.streams)

  def send(self, n: int, road: bool = True, wide: bool = True) -> None:
    for svc, st, on in ((self.road, self.streams[0], road), ("wideRoadCameraState", self.streams[1], wide)):
      if on:
        ev = self.messaging.new_message(svc, valid=True)
        member = getattr(ev, self.messaging.MEMBER_OF_SERVICE.get(svc, svc))
        member.frameId, member.sensor = n, "ar0231"
        self.pm.send(svc, ev)
        self.srv.send(st, self.frame, n, n * self.FRAME_NS, n * self.FRAME_NS + self.FRAME_NS)

  def wait_model(self, timeout: float = 20.0):
    """(modelV2, cameraOdometry) readers of the next output, or (None, None) after timeout seconds."""
    import time
    end = time.monotonic() + timeout
    model = None
    while time.monotonic() < end:
      self.sm.update(100)
      if self.sm.updated["modelV2"]:
        model = self.sm["modelV2"]
      # modeld sends modelV2 before cameraOdometry: a reader polling on modelV2 can wake between the two sends, so it
      # waits for the same frame's cameraOdometry (a pairing bug in modeld still shows: the ids then never meet)
      if model is not None and (self.sm["cameraOdometry"].frameId == model.frameId or time.monotonic() > end - 0.05):
        return model, self.sm["cameraOdometry"]
      assert self.proc.poll() is None, stop_process(self.proc)
    return model, (self.sm["cameraOdometry"] if model is not None else None)

  def start(self, n: int = 1, tries: int = 200):
    """Calibrate and send frame n until modeld is up and answers (the first frames may reach nobody while it loads).
    Frames go out once modeld's modelV2 publisher exists and our reader has followed it: an answer sent before the reader
    noticed the new publisher is never read, and modeld skips a resent frame of the capture it already paired, so that
    one lost answer would be waited for in vain."""
    import time
    sock = self.sm.sock["modelV2"]
    end = time.monotonic() + 0.3 * tries
    while sock.publisher() == 0 and time.monotonic() < end:
      assert self.proc.poll() is None, stop_process(self.proc)
      time.sleep(0.05)
    sock.ready()   # re-registers behind the new publisher now, before modeld has anything to send
    for _ in range(tries):
      for svc, dat in self._calibration:
        self.pm.send(svc, dat)
      self.send(n)
      m, o = self.wait_model(0.25)
      if m is not None:
        return m, o
    raise AssertionError(stop_process(self.proc))

  def step(self, n: int, timeout: float = 20.0):
    for svc, dat in self._calibration:
      self.pm.send(svc, dat)
    self.send(n)
    return self.wait_model(timeout)

  def close(self) -> str:
    out = stop_process(self.proc)
    self.srv.close()
    return out
