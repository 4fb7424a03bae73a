"""Replay of synthetic segments through ModeldCore with a real (tiny, CPU) compiled artifact."""
import fcntl
import gzip
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from modeld_msm.regress import regress
from modeld_msm.replay import replay_segment
from selfdrive_glue.logs import LogReader, LogWriter
from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.synth import synth_route, synth_segment
from selfdrive_glue.video import VideoWriter

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("replay")  # one worker builds the artifact once


def _artifact_key() -> str:
  import json

  from compile.artifact import installed_versions
  h = hashlib.sha256(json.dumps(installed_versions(), sort_keys=True).encode())
  for p in sorted((ROOT / "compile").glob("*.py")):
    h.update(p.read_bytes())
  return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def artifact():
  """tiny reference models compiled for 1344x760 on CPU; cached under .cache/ keyed by the compiler sources."""
  from compile.build import compile_artifact
  from compile.refmodels import write_models
  cache = ROOT / ".cache" / "test-artifacts"
  cache.mkdir(parents=True, exist_ok=True)
  out = cache / f"tiny-1344x760-{_artifact_key()}"
  with open(cache / ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not out.exists():  # write_artifact is atomic: the directory appears complete or not at all
      for stale in cache.glob("*tiny-1344x760-*"):  # built by older compiler sources
        shutil.rmtree(stale, ignore_errors=True)
      models = cache / f"models-{out.name}"
      write_models(models, "tiny", 0)
      compile_artifact(models / "driving_vision.onnx", models / "driving_policy.onnx", (1344, 760), "CPU", out, log=lambda *_: None)
  return out


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
  d = tmp_path_factory.mktemp("replay") / "00000001--abcdef0123--0"
  synth_segment(d, 1.0, 31, "1344x760", progress=False, qcamera=False)
  return d


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "modeld_msm.cli", "replay", "--quiet", *map(str, args)], capture_output=True, text=True,
                        timeout=300, cwd=ROOT)


def _copy_seg(seg: Path, dst: Path) -> Path:
  shutil.copytree(seg, dst)
  return dst


def test_deterministic_and_paired_like_process_replay(seg, artifact, tmp_path):
  a = replay_segment(seg, artifact, tmp_path / "a.zst")
  b = replay_segment(seg, artifact, tmp_path / "b.zst")
  assert a.frames == b.frames == 20 and a.events_out == 60 and a.damage is None
  assert (tmp_path / "a.zst").read_bytes() == (tmp_path / "b.zst").read_bytes()
  out = list(LogReader(tmp_path / "a.zst"))
  assert [e.which() for e in out[:3]] == ["modelV2", "drivingModelData", "cameraOdometry"]
  evs = list(LogReader(seg / "rlog.zst"))
  road = [e for e in evs if e.which() == "roadCameraState"]
  wide = [e for e in evs if e.which() == "wideRoadCameraState"]
  models = [e for e in out if e.which() == "modelV2"]
  assert [m.modelV2.frameId for m in models] == [r.roadCameraState.frameId for r in road]
  assert [m.modelV2.frameIdExtra for m in models] == [w.wideRoadCameraState.frameId for w in wide]
  assert [m.modelV2.timestampEof for m in models] == [r.roadCameraState.timestampEof for r in road]
  # a step fires at the second camera state of the pair, and carries its log time
  assert [m.logMonoTime for m in models] == [w.logMonoTime for w in wide]
  assert all(m.valid for m in models)  # calibration and device state arrived before the first frame
  assert all(m.modelV2.modelExecutionTime == 0.0 for m in models)  # log clock, not the wall clock
  odo = [e.cameraOdometry for e in out if e.which() == "cameraOdometry"]
  assert [o.frameId for o in odo] == [r.roadCameraState.frameId for r in road]
  # the pictures matter: a different drive gives different outputs
  ys = np.array([list(m.modelV2.position.y) for m in models])
  assert np.isfinite(ys).all() and ys.std(axis=0).max() > 0


def test_pairing_does_not_depend_on_arrival_order(seg, artifact, tmp_path):
  """Wide states logged before their road states: the same steps fire (process_replay waits for both)."""
  src = _copy_seg(seg, tmp_path / "swapped")
  raws = list(LogReader(seg / "rlog.zst").events_with_bytes())
  with LogWriter(src / "rlog.zst") as w:
    pending = None
    for ev, b in raws:
      if ev.which() == "roadCameraState":
        pending = b
        continue
      w.write(b)
      if ev.which() == "wideRoadCameraState":
        w.write(pending)
  replay_segment(seg, artifact, tmp_path / "ref.zst")
  replay_segment(src, artifact, tmp_path / "new.zst")
  results, _ = regress(tmp_path / "new.zst", tmp_path / "ref.zst")  # logMonoTime (the trigger) is ignored
  assert not results[0].regression, results[0].worst()


def test_single_camera_segment(artifact, tmp_path):
  d = tmp_path / "single"
  synth_segment(d, 0.5, 32, "1344x760", progress=False, qcamera=False, wide=False)
  res = replay_segment(d, artifact, tmp_path / "out.zst")
  models = [e.modelV2 for e in LogReader(tmp_path / "out.zst") if e.which() == "modelV2"]
  assert res.frames == 10 and len(models) == 10
  assert all(m.frameIdExtra == m.frameId for m in models)


def test_cli_jobs_match_serial_and_regress_passes(artifact, tmp_path):
  synth_route(tmp_path / "route", 2, 0.5, 33, "1344x760", qcamera=False, progress=False)
  r1 = _cli(tmp_path / "route", "--artifact", artifact, "-o", tmp_path / "serial")
  assert r1.returncode == 0, r1.stderr
  r2 = _cli(tmp_path / "route", "--artifact", artifact, "-o", tmp_path / "par", "--jobs", "2")
  assert r2.returncode == 0, r2.stderr
  files = sorted(p.name for p in (tmp_path / "serial").iterdir())
  assert len(files) == 2 and files == sorted(p.name for p in (tmp_path / "par").iterdir())
  for f in files:
    assert (tmp_path / "serial" / f).read_bytes() == (tmp_path / "par" / f).read_bytes()
  r = subprocess.run([sys.executable, "-m", "modeld_msm.cli", "regress", str(tmp_path / "par"), str(tmp_path / "serial")],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and "PASS: 2 log(s)" in r.stdout


def _one_line_error(r, *words):
  assert r.returncode == 2, (r.stdout, r.stderr)
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("modeld-msm replay: error:"), r.stderr
  for w in words:
    assert w in lines[0], lines[0]


def _encode(path: Path, w: int, h: int, n: int) -> None:
  with VideoWriter(path, w, h) as vw:
    for i in range(n):
      vw.write(np.full(nv12_info(w, h).size, 16 + i, np.uint8))


def test_bad_inputs(seg, artifact, tmp_path):
  missing = _copy_seg(seg, tmp_path / "missing")
  (missing / "ecamera.hevc").unlink()
  _one_line_error(_cli(missing, "--artifact", artifact, "-o", tmp_path / "o1.zst"), "ecamera.hevc", "missing")

  wrong_size = _copy_seg(seg, tmp_path / "size")
  _encode(wrong_size / "fcamera.hevc", 1928, 1208, 20)
  _one_line_error(_cli(wrong_size, "--artifact", artifact, "-o", tmp_path / "o2.zst"), "1928x1208", "1344x760")

  wrong_count = _copy_seg(seg, tmp_path / "count")
  _encode(wrong_count / "ecamera.hevc", 1344, 760, 25)
  _one_line_error(_cli(wrong_count, "--artifact", artifact, "-o", tmp_path / "o3.zst"), "25 frames", "20 wideRoadCameraState")

  gz = _copy_seg(seg, tmp_path / "gz")
  (gz / "rlog.zst").write_bytes(gzip.compress((seg / "rlog.zst").read_bytes()))
  _one_line_error(_cli(gz, "--artifact", artifact, "-o", tmp_path / "o4.zst"), "gzip")

  qlog_only = _copy_seg(seg, tmp_path / "qlog_only")
  (qlog_only / "rlog.zst").unlink()
  _one_line_error(_cli(qlog_only, "--artifact", artifact, "-o", tmp_path / "o7.zst"), "no rlog")

  _one_line_error(_cli(tmp_path / "nowhere", "--artifact", artifact, "-o", tmp_path / "o5.zst"), "not found")
  _one_line_error(_cli(seg, "-o", tmp_path / "o6.zst", "--artifact", ""), "artifact")
  for p in tmp_path.glob("o*.zst"):
    raise AssertionError(f"{p} written despite the error")


def test_damaged_log_tail_replays_the_prefix(seg, artifact, tmp_path):
  dmg = _copy_seg(seg, tmp_path / "dmg")
  # an uncompressed rlog cut inside its last third: whole events before the cut are still readable
  raw = b"".join(b for _, b in LogReader(seg / "rlog.zst").events_with_bytes())
  (dmg / "rlog.zst").unlink()
  (dmg / "rlog").write_bytes(raw[:len(raw) * 2 // 3 + 5])
  r = _cli(dmg, "--artifact", artifact, "-o", tmp_path / "out.zst")
  assert r.returncode == 0, r.stderr
  assert "warning" in r.stderr and "damaged" in r.stderr and "truncated" in r.stderr
  n = sum(1 for e in LogReader(tmp_path / "out.zst") if e.which() == "modelV2")
  assert 5 <= n < 20


def test_artifact_for_another_camera_is_refused(artifact, tmp_path):
  d = tmp_path / "big"
  synth_segment(d, 0.2, 34, "1928x1208", progress=False, qcamera=False, wide=False)
  r = _cli(d, "--artifact", artifact, "-o", tmp_path / "out.zst")
  _one_line_error(r, "1928x1208")


def test_first_calibration_is_known_from_the_start(seg, artifact, tmp_path):
  """A segment cut mid-drive: its first liveCalibration comes after some frames; model_replay prepends it."""
  late = _copy_seg(seg, tmp_path / "late")
  raws = list(LogReader(seg / "rlog.zst").events_with_bytes())
  first_cal = next(i for i, (ev, _) in enumerate(raws) if ev.which() == "liveCalibration")
  with LogWriter(late / "rlog.zst") as w:
    w.write_all(b for i, (_, b) in enumerate(raws) if i != first_cal)
  replay_segment(late, artifact, tmp_path / "out.zst")
  models = [e for e in LogReader(tmp_path / "out.zst") if e.which() == "modelV2"]
  assert len(models) == 20 and all(m.valid for m in models)


def test_output_naming(tmp_path):
  from modeld_msm.errors import UserError
  from modeld_msm.replay import output_paths
  from selfdrive_glue.route import Segment
  one = [Segment(tmp_path / "r--0")]
  two = one + [Segment(tmp_path / "r--1")]
  assert output_paths(one, tmp_path / "x.zst") == [tmp_path / "x.zst"]
  assert output_paths(one, tmp_path / "outdir") == [tmp_path / "outdir" / "r--0.zst"]
  assert output_paths(two, tmp_path / "outdir") == [tmp_path / "outdir" / "r--0.zst", tmp_path / "outdir" / "r--1.zst"]
  with pytest.raises(UserError, match="one log file"):
    output_paths(two, tmp_path / "x.zst")
  with pytest.raises(UserError, match="several segments are named"):
    output_paths([Segment(tmp_path / "a" / "s--0"), Segment(tmp_path / "b" / "s--0")], tmp_path / "o")
