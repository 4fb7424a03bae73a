"""The car's artifact: tiny models compiled for QCOM (captured on the emulated render node under openpilot's QCOM flags) and
served through the real MSM code path, in this process (ModeldCore) and as the modeld process.

Level A computes nothing, so these assert what the device path does (frame ids, submits, BO tables, strict validation,
GEM lifetimes), not numbers. On a vamOS device run them with MODELD_DEV=MSM+QCOM:IR3 (the `device` ones run unchanged).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ModeldHarness, event_reader, stop_process

from selfdrive_glue import messaging
from selfdrive_glue.nv12 import nv12_info

pytestmark = pytest.mark.xdist_group("qcom_artifact")
MODELD_DEV = os.environ.get("MODELD_DEV", "EMU+QCOM:IR3")
EMU = MODELD_DEV.startswith("EMU")
emu_only = pytest.mark.skipif(not EMU, reason="inspects the emulated render node")
INFO = nv12_info(1928, 1208)
FRAME_NS = 50_000_000
# openpilot 0.11's QCOM build (docs contract §12: IMAGE=2 on larch64); master's modeld builds IMAGE=1
OPENPILOT_QCOM_FLAGS = {"FLOAT16": 1, "NOLOCALS": 1, "JIT_BATCH_SIZE": 0, "OPENPILOT_HACKS": 1, "IMAGE": 2}


@contextlib.contextmanager
def _on_device(monkeypatch):
  """MODELD_DEV for the artifact's load; tinygrad's default device is put back afterwards for the other tests of this worker."""
  from tinygrad.helpers import DEV
  old = DEV.value
  monkeypatch.setenv("MODELD_DEV", MODELD_DEV)
  try:
    yield
  finally:
    DEV.value = old


def _qcom_device():
  from tinygrad import Device
  return Device["QCOM"]


@pytest.mark.device
def test_compile_uses_openpilot_qcom_flags_and_proves_replay(qcom_artifact, cli):
  meta = json.loads((qcom_artifact / "metadata.json").read_text())
  assert meta["flags"] == OPENPILOT_QCOM_FLAGS and meta["openpilot"] == "0.11"
  assert meta["device"] == "QCOM" and meta["load_target"] == "QCOM:IR3" and meta["capture_target"] == "EMU+QCOM:IR3"
  assert "IMAGE_PITCH_ALIGNMENT=64" in meta["arch"], meta["arch"]   # the device opened under IMAGE
  checks = {c: (res, detail) for c, res, detail in meta["validation"]["checks"]}
  res, detail = checks["pickle replay (EMU)"]
  assert res == "ok" and "strict BO validation, 0 faults" in detail, detail
  submits = int(detail.split(" submits")[0].rsplit(" ", 1)[1])
  assert submits >= len(meta["validation"]["step_plan"])   # at least one GEM_SUBMIT per replayed step
  log = (qcom_artifact.parent / "compile.log").read_text()
  assert "capture flags (openpilot 0.11's): FLOAT16=1 NOLOCALS=1 JIT_BATCH_SIZE=0 OPENPILOT_HACKS=1 IMAGE=2" in log
  r = cli("verify", qcom_artifact, "--device", "QCOM", "--camera", "1928x1208")
  assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.device
def test_core_serves_qcom_artifact(qcom_artifact, monkeypatch):
  from modeld_msm.core import Frame, ModeldCore
  with _on_device(monkeypatch):
    core = ModeldCore(qcom_artifact)
    it = _qcom_device().iface
    core.on_message(event_reader("deviceState", deviceType="tici"))
    core.on_message(event_reader("liveCalibration", rpyCalib=[0.0, 0.01, 0.0]))
    bufs = [np.random.default_rng(i).integers(0, 256, INFO.size, dtype=np.uint8) for i in range(3)]   # a VisionIPC-like ring
    start = it.stats["submits"]
    subs, published = [], {}
    for n in (1, 2, 3, 5, 6, 7):   # frame 4 never arrives: 5 is a dropped (warp-only) step
      core.on_message(event_reader("roadCameraState", frameId=n, sensor="ar0231"))
      s0 = it.stats["submits"]
      out = core.on_frame(Frame(bufs[n % 3], n, n * FRAME_NS, n * FRAME_NS + FRAME_NS // 2))
      subs.append(it.stats["submits"] - s0)
      if out:
        published[n] = out
    assert sorted(published) == [1, 2, 3, 6, 7]
    for n, out in published.items():
      assert [svc for svc, _ in out] == ["modelV2", "drivingModelData", "cameraOdometry"]
      evs = {svc: messaging.log_from_bytes(b) for svc, b in out}
      m = evs["modelV2"].modelV2
      assert (m.frameId, m.frameIdExtra, m.timestampEof) == (n, n, n * FRAME_NS + FRAME_NS // 2)
      assert evs["drivingModelData"].drivingModelData.frameId == n and evs["cameraOdometry"].cameraOdometry.frameId == n
    assert core.stats.dropped_steps == 1 and core.stats.published == 5
    # every step reached the kernel, the dropped one too (its warp keeps the image queues moving)
    assert all(s >= 1 for s in subs), subs
    full = [s for n, s in zip((1, 2, 3, 5, 6, 7), subs) if n != 5]
    assert len(set(full)) == 1 and subs[3] < full[0], subs   # a full step is the same plan every time; warp-only is smaller
    jobs = list(it.recent)[-min(it.stats["submits"] - start, len(it.recent)):]
    assert len(jobs) >= 6
    for j in jobs:
      assert len(j.handles) == len(set(j.handles)) == j.nr_bos, j.handles   # each BO listed once
    assert it.retired == it.last_fence and not it.inflight and not it.pending


@emu_only
def test_emulator_saw_every_submit_under_strict_validation(qcom_artifact, monkeypatch):
  from modeld_msm.core import Frame, ModeldCore
  with _on_device(monkeypatch):
    core = ModeldCore(qcom_artifact)
    it = _qcom_device().iface
    node = it.node
    assert node.strict
    s_node, s_if, f0, d0 = node.stats.submits, it.stats["submits"], len(node.stats.faults), node.stats.dispatches
    core.on_message(event_reader("deviceState", deviceType="tici"))
    core.on_message(event_reader("liveCalibration", rpyCalib=[0.0, 0.0, 0.0]))
    buf = np.zeros(INFO.size, np.uint8)
    for n in (1, 2, 4, 5):
      core.on_message(event_reader("roadCameraState", frameId=n, sensor="ar0231"))
      core.on_frame(Frame(buf, n, n * FRAME_NS, n * FRAME_NS + 1))
    _qcom_device().synchronize()
    new = node.stats.submits - s_node
    assert new == it.stats["submits"] - s_if and new >= 4          # the node saw exactly what the interface submitted
    assert node.stats.faults[f0:] == [], node.stats.faults[f0:]   # strict: every dereferenced BO was in its submit's table
    records = list(node.submits)[-new:]
    assert len(records) == new
    for r in records:
      assert len(r.handles) == len(set(r.handles)), r.handles
    dispatches = list(node.dispatches)[-(node.stats.dispatches - d0):]
    assert dispatches and any(d.textures for d in dispatches)    # IMAGE=2: the convolutions read fp16 images through textures


def _live_handles(it) -> int:
  """GEM handles open on the node: the kernel's count on the emulator, our own alloc/close balance on a real node."""
  own = it.stats["alloc"] - it.stats["close"]
  if EMU:
    assert it.node.live_handles == own   # the interface's bookkeeping matches what the node holds
  return own


@pytest.mark.device
def test_gem_handles_return_to_baseline_after_free(qcom_artifact, monkeypatch):
  from tinygrad.engine import realize

  from artifact.format import verify_artifact
  from artifact.load import activate_target
  from modeld_msm.core import Frame, ModeldCore
  with _on_device(monkeypatch):
    activate_target(verify_artifact(qcom_artifact))   # opens the device first, so its own buffers are in the baseline
    dev = _qcom_device()
    gc.collect()
    dev.synchronize()
    dev.allocator.free_cache()
    base, had_stack, cached = _live_handles(dev.iface), hasattr(dev, "_stack"), set(realize.runtime_cache)
    core = ModeldCore(qcom_artifact)
    buf = np.zeros(INFO.size, np.uint8)
    for n in (1, 2, 4):
      core.on_message(event_reader("roadCameraState", frameId=n, sensor="ar0231"))
      core.on_frame(Frame(buf, n, n * FRAME_NS, n * FRAME_NS + 1))
    assert _live_handles(dev.iface) > base + 10
    del core
    # what holds GEM objects after the JITs are gone: tinygrad's allocator cache and its process-wide program cache
    for k in set(realize.runtime_cache) - cached:
      del realize.runtime_cache[k]
    gc.collect()
    dev.synchronize()
    dev.allocator.free_cache()
    gc.collect()
    dev.synchronize()
    stack = int(hasattr(dev, "_stack") and not had_stack)   # the device's private-memory stack, grown once by the first program
    assert _live_handles(dev.iface) == base + stack, (_live_handles(dev.iface), base, stack)
    assert not dev.iface.zombies


@pytest.mark.device
def test_device_sees_each_new_frame_in_a_reused_camera_buffer(qcom_artifact, monkeypatch):
  from modeld_msm.model_state import ModelState
  with _on_device(monkeypatch):
    ms = ModelState(qcom_artifact)
    buf, eye, tc = np.zeros(INFO.size, np.uint8), np.eye(3, dtype=np.float32), np.array([[1, 0]], np.float32)
    ms.run(buf, buf, eye, eye, np.zeros(8, np.float32), tc, False)
    buf[:] = np.random.default_rng(1).integers(0, 256, INFO.size, dtype=np.uint8)   # camerad reuses the buffer for a later frame
    ms.run(buf, buf, eye, eye, np.zeros(8, np.float32), tc, False)
    assert np.array_equal(ms._frame("main", buf).numpy(), buf[:INFO.size])   # what the program read from GPU memory


# ---- across processes: VisionIPC server + msgq publishers -> `python -m modeld_msm.modeld` on QCOM -> SubMaster ----

@pytest.mark.slow
@pytest.mark.device
def test_modeld_process_serves_qcom_artifact(qcom_artifact, prefix):
  h = ModeldHarness(qcom_artifact, env={"MODELD_DEV": MODELD_DEV})
  try:
    m, o = h.start(1, tries=300)
    seen = [m.frameId]
    for n in range(2, 6):
      m, o = h.step(n)
      assert m is not None and m.frameId == m.frameIdExtra == o.frameId, stop_process(h.proc)
      seen.append(m.frameId)
    assert seen[1:] == [2, 3, 4, 5]
    h.send(7)   # after a gap: warp-only, nothing published
    assert h.wait_model(1.5)[0] is None
    m, o = h.step(8)
    assert m is not None and m.frameId == 8 and o.frameId == 8
  finally:
    out = h.close()
  assert "Traceback" not in out and "error" not in out.lower(), out
  assert "artifact" in out and "QCOM:IR3" in out, out   # the startup line names the artifact's target


def test_qcom_artifact_without_a_qcom_interface_is_refused(qcom_artifact, prefix, cli):
  if os.path.exists("/dev/kgsl-3d0") or any(Path("/dev/dri").glob("renderD*")):
    pytest.skip("this machine may have a QCOM interface")
  env = {k: v for k, v in os.environ.items() if k not in ("MODELD_DEV", "DEV")}
  r = subprocess.run([sys.executable, "-m", "cli.main", "verify", str(qcom_artifact)], capture_output=True, text=True, timeout=120,
                     env=env)
  assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr   # integrity is fine: it is the machine that is wrong
  # no camera server: serve must refuse the artifact at start-up, not after waiting for frames
  r = subprocess.run([sys.executable, "-m", "cli.main", "serve", "--artifact", str(qcom_artifact), "--no-realtime", "--max-frames", "1"],
                     capture_output=True, text=True, timeout=120, env={**env, "OPENPILOT_PREFIX": prefix})
  err = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
  assert r.returncode == 2, r.stdout + r.stderr
  assert "Traceback" not in r.stderr and len(err) == 1, r.stderr
  assert "is for QCOM (QCOM:IR3), which cannot be opened here" in err[0] and "compile" in err[0], err[0]


# what a Python without the tinymesa wheel sees (the car: it is published for x86_64 only): `import tinymesa` fails, its
# version is unknown, and tinygrad's library loader finds no Mesa, exactly as when the package is absent
_WITHOUT_TINYMESA = '''
import sys
from importlib.abc import MetaPathFinder
class _Hidden(MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] == "tinymesa":
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Hidden())
import importlib.metadata as md
_version = md.version
def _no_tinymesa(name):
  if name == "tinymesa":
    raise md.PackageNotFoundError(name)
  return _version(name)
md.version = _no_tinymesa
import tinygrad.runtime.support.c as c
_find = c.DLL.findlib
c.DLL.findlib = staticmethod(lambda nm, paths, extra_paths=[]: None if nm == "mesa" else _find(nm, paths, extra_paths))
'''


@emu_only
def test_the_car_loads_and_runs_a_qcom_artifact_without_the_compiler(qcom_artifact):
  """The IR3 programs are machine code: loading them needs no Mesa (backend/qcom.py's stand-in renderer answers the one
  question tinygrad's loader asks it). Three steps published on the emulated node at level A; a new kernel is refused
  with the line that says why."""
  code = _WITHOUT_TINYMESA + f'''
import json, numpy as np
try:
  import tinymesa
  hidden = False
except ModuleNotFoundError:
  hidden = True
from artifact.format import verify_artifact
from modeld_msm.core import ModeldCore
from modeld_msm.frames import Frame
from selfdrive_glue.nv12 import nv12_info
core = ModeldCore(verify_artifact({str(qcom_artifact)!r}))
buf = np.zeros(nv12_info(1928, 1208).size, np.uint8)
steps = [[svc for svc, _ in core.on_frame(Frame(buf, n, n * 50_000_000, n * 50_000_000 + 1))] for n in range(1, 4)]
from tinygrad import Device, Tensor
try:
  (Tensor([1.0, 2.0], device=Device.DEFAULT) * 3).realize()
  refused = ""
except Exception as e:
  refused = str(e)
print(json.dumps({{"hidden": hidden, "mesa": "mesa" in c.DLL._loaded_, "tinymesa": any(m.startswith("tinymesa") for m in sys.modules),
                  "steps": steps, "refused": refused, "device": Device.DEFAULT}}))
'''
  env = {**os.environ, "MODELD_DEV": MODELD_DEV}
  env.pop("DEV", None)
  r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.splitlines()[-1])
  assert out["hidden"] and not out["mesa"] and not out["tinymesa"], out
  assert out["steps"] == [["modelV2", "drivingModelData", "cameraOdometry"]] * 3 and out["device"].startswith("QCOM"), out
  assert "IR3 compiler" in out["refused"] and "compile the artifact on an x86_64 machine" in out["refused"], out
