"""Master's combined model through the whole off-car pipeline: compiled, replayed over a logged (synthetic) drive beside
0.11's split artifact of the same weights, and compared field by field with `regress`. Without an action head modeld takes
the plan, as for 0.11, and every published field is the split pipeline's; with one, only the action fields differ."""
from __future__ import annotations

import re

import pytest

from compile.refmodels.supercombo import write_supercombo_model
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def drive(tmp_path_factory):
  d = tmp_path_factory.mktemp("supercombo_replay")
  r = run_cli("synth", "-o", d / "seg", "--seconds", "2", "--seed", "1", "--quiet", timeout=300)
  assert r.returncode == 0, r.stderr
  return d


def _replay(drive, artifact, name: str):
  out = drive / name
  r = run_cli("replay", drive / "seg", "--artifact", artifact, "-o", out, "--quiet", timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return out


@pytest.mark.parametrize("action_head", [False, True])
def test_combined_replay_publishes_what_the_split_pair_does(drive, cpu_artifact_1928, action_head):
  tag = "head" if action_head else "plan"
  model = write_supercombo_model(drive / f"model_{tag}", "tiny", 0, action_head=action_head).path   # the tiny pair's seed
  art = drive / f"art_{tag}"
  r = run_cli("compile", "--model", model, "--device", "CPU", "-o", art, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  split = _replay(drive, cpu_artifact_1928, "rep_split") if not (drive / "rep_split").exists() else drive / "rep_split"
  combined = _replay(drive, art, f"rep_{tag}")
  g = run_cli("regress", combined, split, "--report", drive / f"report_{tag}", "--segment", drive / "seg", timeout=300)
  page = (drive / f"report_{tag}" / "report.html").read_text()
  if not action_head:
    assert '<h1 class="PASS">' in page and "modelV2.leadsV3[0].aStd" in page   # the HTML report reads a combined replay too
    assert g.returncode == 0, g.stdout[-3000:] + g.stderr[-2000:]
    return
  assert g.returncode != 0, g.stdout
  differing = {line.split()[0] for line in g.stdout.splitlines() if line.startswith("  ") and "/" in line.split()[1]}
  assert differing and all(".action." in f for f in differing), g.stdout
  assert {"modelV2.action.desiredAcceleration", "modelV2.action.desiredCurvature"} <= differing, g.stdout
  # the report marks the action fields and draws their worst frames
  assert '<h1 class="REGRESSION">' in page and re.search(r'<img src="frame_\d+\.png"', page) and "road camera: video frame " in page
  fails = set(re.findall(r'<tr class="fail"><td>FAIL</td><td>([^<]+)</td>', page))
  assert fails and all(".action." in f for f in fails), fails


@pytest.fixture(scope="module")
def combined_artifact(tmp_path_factory):
  d = tmp_path_factory.mktemp("supercombo_core")
  model = write_supercombo_model(d / "model", "tiny", 0).path
  r = run_cli("compile", "--model", model, "--device", "CPU", "-o", d / "art", timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return d / "art"


def test_ray_replay_of_the_combined_artifact_is_the_local_one(drive, combined_artifact):
  """`replay --engine ray` (a local cluster of its own) writes the very bytes the local engine writes."""
  pytest.importorskip("ray")
  local = _replay(drive, combined_artifact, "rep_local_sc")
  out = drive / "rep_ray_sc"
  r = run_cli("replay", drive / "seg", "--artifact", combined_artifact, "-o", out, "--engine", "ray", "--quiet", timeout=600,
              env={"RAY_USAGE_STATS_ENABLED": "0"})
  assert r.returncode == 0, r.stderr[-3000:]
  assert (out / "seg.zst").read_bytes() == (local / "seg.zst").read_bytes()


def test_core_feeds_action_t_from_the_delays_and_takes_the_action_head(combined_artifact):
  """action_t = [liveDelay.lateralDelay + 0.075, longitudinalActuatorDelay + 0.3 + 0.075] every frame (master's constants);
  desiredAcceleration is the head's, smoothed as master smooths it; at standstill the curvature is held."""
  import numpy as np

  from modeld_msm.actions import LONG_SMOOTH_SECONDS, smooth_value
  from modeld_msm.constants import DT_MDL
  from modeld_msm.core import DEMO_LONG_ACTUATOR_DELAY, Frame, ModeldCore
  from selfdrive_glue import messaging
  from selfdrive_glue.nv12 import nv12_info
  from tests.conftest import event_reader
  core = ModeldCore(combined_artifact)
  raws, run = [], core.model.run
  core.model.run = lambda *a, **kw: (r := run(*a, **kw), raws.append(r[1]))[0]   # the raw output of each step, as the core got it
  buf = np.random.default_rng(0).integers(0, 256, nv12_info(*core.camera).size, dtype=np.uint8)
  prev = 0.0
  for n, lat in ((1, 0.2), (2, 0.35), (3, 0.1)):
    core.on_message(event_reader("liveDelay", lateralDelay=lat))
    out = dict(core.on_frame(Frame(buf, n, n * 50_000_000, n * 50_000_000 + 1)))
    assert core.model.host["action_t"][0] == pytest.approx([lat + 1.5 * DT_MDL, DEMO_LONG_ACTUATOR_DELAY + LONG_SMOOTH_SECONDS + 1.5 * DT_MDL])
    m = messaging.log_from_bytes(out["modelV2"]).modelV2
    raw_accel = float(raws[-1][core.model.slices["outputs"]["action"]][1])
    prev = float(np.float32(smooth_value(raw_accel, prev, LONG_SMOOTH_SECONDS)))
    assert m.action.desiredAcceleration == pytest.approx(prev, abs=1e-6)
    assert m.action.desiredCurvature == 0.0 and m.action.shouldStop == (raw_accel < 0.1)   # v_ego 0: held, stop below 0.1 m/s^2


def test_modeld_process_serves_the_combined_artifact(combined_artifact, prefix):
  """The real process (VisionIPC + msgq): a combined artifact is served like 0.11's, frame after frame."""
  from tests.conftest import ModeldHarness, stop_process
  h = ModeldHarness(combined_artifact)
  try:
    m, _ = h.start(1)
    for n in range(2, 6):
      m, o = h.step(n)
      assert m is not None and m.frameId == n and o.frameId == n, stop_process(h.proc)
  finally:
    out = h.close()
  assert "Traceback" not in out, out


def test_release_smoke_and_install_of_a_combined_bundle(tmp_path):
  """release --model: one contract per bundle (bundle.json "contract"), its smoke recorded and passing, and install's dry run
  naming the contract it found."""
  import json

  from tests.test_install import make_prefixed_openpilot
  model = write_supercombo_model(tmp_path / "m", "tiny", 0).path
  b = tmp_path / "bundle"
  r = run_cli("release", "--model", model, "--device", "CPU", "--camera", "1928x1208", "--smoke-frames", "3", "-o", b, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  index = json.loads((b / "bundle.json").read_text())
  assert index["contract"] == "supercombo" and list(index["artifacts"]) == ["1928x1208"]
  s = run_cli("smoke", "--bundle", b, timeout=600)
  assert s.returncode == 0 and "PASS" in s.stdout, s.stdout + s.stderr
  op = make_prefixed_openpilot(tmp_path / "op")
  d = run_cli("install", op, "--bundle", b, "--allow-cpu", "--dry-run", timeout=300)
  assert d.returncode == 0 and "master's combined model (driving_supercombo.onnx)" in d.stdout, d.stdout + d.stderr
  both = run_cli("release", "--model", model, "--vision", model, "--policy", model, "--device", "CPU", "-o", tmp_path / "x", timeout=120)
  assert both.returncode == 2 and "not both" in both.stderr and not (tmp_path / "x").exists()
