import subprocess
import sys

import numpy as np
import pytest

from offcar.regress import regress
from selfdrive_glue import messaging
from selfdrive_glue.errors import UserError
from selfdrive_glue.logs import LogWriter


def _outputs(n=30, change=None, exec_time=0.0, drop=None):
  """Model outputs like replay writes (modelV2, drivingModelData, cameraOdometry per frame) with smooth made-up values."""
  evs = []
  for i in range(n):
    t = 5_000_000_000 + i * 50_000_000
    m = messaging.new_message("modelV2", logMonoTime=t, valid=True)
    mv = m.modelV2
    mv.frameId = i
    mv.modelExecutionTime = exec_time
    ts = np.linspace(0, 10, 33)
    mv.position.x = (20 * ts).tolist()
    mv.position.y = (0.01 * ts ** 2 * np.sin(i / 5)).tolist()
    lanes = mv.init("laneLines", 4)
    for k in range(4):
      lanes[k].y = [float((-5.4 + 3.6 * k) + 0.1 * np.sin(i / 3))] * 33
    mv.laneLineProbs = [0.1, 0.9, 0.8, 0.2]
    leads = mv.init("leadsV3", 3)
    leads[0].x = [30.0 - 0.1 * i] * 6
    leads[0].prob = 0.9
    mv.action.desiredCurvature = float(0.001 * np.cos(i / 4))
    mv.action.desiredAcceleration = 0.1
    if change and change[0] == i:
      change[1](mv)
    d = messaging.new_message("drivingModelData", logMonoTime=t, valid=True)
    d.drivingModelData.frameId = i
    d.drivingModelData.action.desiredCurvature = mv.action.desiredCurvature
    o = messaging.new_message("cameraOdometry", logMonoTime=t, valid=True)
    o.cameraOdometry.frameId = i
    o.cameraOdometry.trans = [20.0, 0.0, 0.0]
    evs += [m.to_bytes(), d.to_bytes(), o.to_bytes()]
  if drop is not None:
    del evs[drop]
  return evs


def _write(path, evs):
  with LogWriter(path) as w:
    w.write_all(evs)
  return path


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "cli.main", "regress", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_unchanged_passes_and_writes_a_report(tmp_path):
  ref = _write(tmp_path / "ref.zst", _outputs())
  new = _write(tmp_path / "new.zst", _outputs(exec_time=0.02))  # modelExecutionTime differs: ignored by default
  r = _cli(new, ref, "--report", tmp_path / "rep")
  assert r.returncode == 0, r.stdout + r.stderr
  assert "PASS" in r.stdout
  png = tmp_path / "rep" / "new.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
  assert (tmp_path / "rep" / "report.txt").read_text().startswith("PASS")
  # without the default ignore list, the timing difference is a regression
  r = _cli(new, ref, "--ignore", "logMonoTime")
  assert r.returncode == 1 and "modelV2.modelExecutionTime" in r.stdout


def test_planted_change_is_found_and_named(tmp_path):
  ref = _write(tmp_path / "ref.zst", _outputs())

  def plant(mv):
    lanes = mv.laneLines
    ys = list(lanes[2].y)
    ys[5] += 0.25
    lanes[2].y = ys
  new = _write(tmp_path / "new.zst", _outputs(change=(17, plant)))
  r = _cli(new, ref, "--report", tmp_path / "rep")
  assert r.returncode == 1
  assert "REGRESSION" in r.stderr
  worst = [ln for ln in r.stdout.splitlines() if ln.startswith("  modelV2")]
  assert worst[0].split()[0] == "modelV2.laneLines[2].y" and worst[0].split()[1] == "1/990"
  assert (tmp_path / "rep" / "report.txt").read_text().startswith("REGRESSION")
  # a relative tolerance of 20% absorbs a 0.25 m change on a 1.8 m line
  assert _cli(new, ref, "--tolerance", "0.2").returncode == 0
  assert _cli(new, ref, "--tolerance", "0.05").returncode == 1
  assert _cli(new, ref, "--ignore", "laneLines", "logMonoTime").returncode == 0


def test_tiny_float_change_fails_exact_comparison(tmp_path):
  ref = _write(tmp_path / "ref.zst", _outputs())

  def nudge(mv):
    mv.action.desiredCurvature = float(np.nextafter(np.float32(mv.action.desiredCurvature), np.float32(1)))
  new = _write(tmp_path / "new.zst", _outputs(change=(3, nudge)))
  results, _ = regress(new, ref)
  assert results[0].regression
  assert sorted(f.path for f in results[0].worst()) == ["drivingModelData.action.desiredCurvature", "modelV2.action.desiredCurvature"]
  results, _ = regress(new, ref, tolerance=1e-5)
  assert not results[0].regression


def test_missing_or_extra_messages_are_a_regression(tmp_path):
  ref = _write(tmp_path / "ref.zst", _outputs())
  new = _write(tmp_path / "new.zst", _outputs(drop=10))
  r = _cli(new, ref)
  assert r.returncode == 1 and "STRUCTURE" in r.stdout


def test_directories_of_outputs(tmp_path):
  for d in ("a", "b"):
    (tmp_path / d).mkdir()
    _write(tmp_path / d / "seg--0.zst", _outputs(10))
  _write(tmp_path / "a" / "seg--1.zst", _outputs(10))
  _write(tmp_path / "b" / "seg--1.zst", _outputs(10))
  assert _cli(tmp_path / "a", tmp_path / "b").returncode == 0
  _write(tmp_path / "b" / "seg--2.zst", _outputs(10))
  r = _cli(tmp_path / "a", tmp_path / "b")
  assert r.returncode == 1 and "seg--2.zst is only in REF" in r.stdout


def test_bad_inputs(tmp_path):
  ref = _write(tmp_path / "ref.zst", _outputs(5))
  r = _cli(tmp_path / "nope.zst", ref)
  assert r.returncode == 2 and "not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1
  (tmp_path / "junk.zst").write_bytes(b"\x1f\x8b" + b"0" * 100)
  r = _cli(tmp_path / "junk.zst", ref)
  assert r.returncode == 2 and "gzip" in r.stderr
  with pytest.raises(UserError):
    regress(tmp_path, ref)
  with pytest.raises(UserError):
    regress(ref, ref, tolerance=-1)
