"""regress compares two replays of one drive: replays of different drives (another synthetic seed, another camera clock or
other frames, folders without a log in common) are refused unless --allow-different-drives, each run's accuracy line names
its own drive, and `--report --segment` refuses a segment the runs did not come from."""
import json
import shutil
from pathlib import Path

import pytest
import test_replay
from conftest import run_cli
from test_regress import _outputs, _write

from offcar import replay_store as store
from offcar.log_compare import read_messages
from offcar.regress import regress
from offcar.replay_accuracy import regress_accuracy, regress_lines
from selfdrive_glue import messaging
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import write_atomic
from selfdrive_glue.logs import LogReader

pytestmark = pytest.mark.xdist_group("replay")
artifact = test_replay.artifact  # the cached tiny 1344x760 CPU artifact
NAME = "00000001--0123456789--0"  # both drives' segments carry this name, so their output folders pair the logs
LOG = f"{NAME}.zst"


@pytest.fixture(scope="module")
def drives(tmp_path_factory, artifact):
  """seed -> (segment, replay output folder): 2 s synthetic drives of seeds 1 and 2, replayed through the CLI."""
  d = tmp_path_factory.mktemp("identity")
  out = {}
  for seed in (1, 2):
    seg = d / f"seed{seed}" / NAME
    r = run_cli("synth", "-o", seg, "--seconds", 2, "--seed", seed, "--camera", "1344x760", "--no-qcamera", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("replay", "--quiet", seg, "-o", d / f"out{seed}", "--artifact", artifact)
    assert r.returncode == 0 and (d / f"out{seed}" / f"{LOG}.accuracy.json").is_file(), r.stdout + r.stderr
    out[seed] = seg, d / f"out{seed}"
  return out


def _error(r) -> str:
  assert r.returncode == 2, r.stdout + r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1, r.stderr
  return lines[0]


def _retimed(src: Path, dst: Path, shift_ns: int = 0) -> Path:
  """A copy of the log `src` (no sidecar beside it) as if its frames came from another camera clock: every timestampEof moved."""
  evs = []
  for ev in LogReader(src):
    b = ev.as_builder()
    inner = getattr(b, ev.which())
    if hasattr(inner, "timestampEof"):
      inner.timestampEof = inner.timestampEof + shift_ns
    evs.append(b.to_bytes())
  dst.parent.mkdir(parents=True, exist_ok=True)
  return _write(dst, evs)


def test_replays_of_two_seeds_are_refused_unless_allowed(drives, tmp_path):
  (_, out1), (_, out2) = drives[1], drives[2]
  # the case: folders pair the logs by name; the frames and clocks match too, only the seeds tell the drives apart
  err = _error(run_cli("regress", out2, out1))
  assert "different drives" in err and "seed 2" in err and "seed 1" in err and "--allow-different-drives" in err
  err = _error(run_cli("regress", out2 / LOG, out1 / LOG))
  assert "different drives" in err
  r = run_cli("regress", out2, out1, "--allow-different-drives", "--report", tmp_path / "rep")
  assert r.returncode == 1 and "REGRESSION" in r.stderr, r.stdout + r.stderr
  assert sum(x.startswith(f"WARNING   {LOG}: different drives") for x in r.stdout.splitlines()) == 1, r.stdout
  new = next(x for x in r.stdout.splitlines() if x.startswith(f"ACCURACY  {LOG} NEW: "))
  ref = next(x for x in r.stdout.splitlines() if x.startswith(f"ACCURACY  {LOG} REF: "))
  assert new.endswith("[synthetic drive, seed 2, 1344x760]") and ref.endswith("[synthetic drive, seed 1, 1344x760]"), (new, ref)
  rep = json.loads((tmp_path / "rep" / "report.json").read_text())
  assert "seed 2" in rep["files"][0]["different_drives"][0]
  assert rep["accuracy"][0]["source"] == {"new": "synthetic drive, seed 2, 1344x760", "ref": "synthetic drive, seed 1, 1344x760"}
  assert "different drives, compared anyway" in (tmp_path / "rep" / "report.html").read_text()
  # two replays of one drive still pass, with no warning
  shutil.copytree(out1, tmp_path / "again")
  r = run_cli("regress", tmp_path / "again", out1)
  assert r.returncode == 0 and "WARNING" not in r.stdout and "PASS" in r.stdout, r.stdout + r.stderr


def test_each_accuracy_line_names_its_own_runs_seed(drives):
  (_, out1), (_, out2) = drives[1], drives[2]
  messages = {LOG: (read_messages(out2 / LOG, []), read_messages(out1 / LOG, []))}
  lines = regress_lines(regress_accuracy(messages, out2, out1))
  assert [x.rsplit("[", 1)[1] for x in lines] == ["synthetic drive, seed 2, 1344x760]", "synthetic drive, seed 1, 1344x760]"], lines
  # a run without its own record is held to the other's, and says whose
  bare = out1.parent / "bare"
  bare.mkdir(exist_ok=True)
  shutil.copy(out1 / LOG, bare / LOG)
  lines = regress_lines(regress_accuracy({LOG: messages[LOG][1:] * 2}, bare, out1))
  assert lines[0].endswith("[synthetic drive, seed 1, 1344x760 (from REF's record)]") and lines[1].endswith("seed 1, 1344x760]"), lines


def test_folders_without_a_log_in_common_are_refused(drives, tmp_path):
  (_, out1), (_, out2) = drives[1], drives[2]
  (tmp_path / "other").mkdir()
  shutil.copy(out2 / LOG, tmp_path / "other" / "00000002--0123456789--0.zst")
  err = _error(run_cli("regress", tmp_path / "other", out1))
  assert "share no log" in err and "00000002--0123456789--0.zst" in err and LOG in err
  r = run_cli("regress", tmp_path / "other", out1, "--allow-different-drives")
  assert r.returncode == 1 and sum(x.startswith("WARNING") for x in r.stdout.splitlines()) == 1 and "is only in REF" in r.stdout


def _timed(path: Path, n: int = 10, t0: int = 40_000_000_000, frame0: int = 0, at: int | None = None, dt: int = 0) -> Path:
  """Made-up outputs whose frames have a camera clock: frame k (from frame0) ended at t0 + k * 50 ms; frame `at` dt later."""
  evs = []
  for b in _outputs(n):
    ev = messaging.log_from_bytes(b)
    mb = ev.as_builder()
    inner = getattr(mb, ev.which())
    inner.frameId = inner.frameId + frame0
    if hasattr(inner, "timestampEof"):
      inner.timestampEof = t0 + (inner.frameId - frame0) * 50_000_000 + (dt if inner.frameId == at else 0)
    evs.append(mb.to_bytes())
  return _write(path, evs)


def test_real_drives_are_told_apart_by_camera_clock_and_frames(tmp_path):
  """Without sidecars (a real drive, or copied logs): the frames' camera clock and frameIds identify the drive."""
  ref = _timed(tmp_path / "ref.zst")
  with pytest.raises(UserError, match="different drives.*camera frame 0 ended at 41000000000 ns in NEW but at 40000000000 ns in REF"):
    regress(_timed(tmp_path / "clock.zst", t0=41_000_000_000), ref)
  with pytest.raises(UserError, match="different drives.*no camera frame in common"):
    regress(_timed(tmp_path / "frames.zst", frame0=1200), ref)
  results, _ = regress(tmp_path / "clock.zst", ref, allow_different_drives=True)
  assert results[0].regression and "camera frame 0" in results[0].different_drives[0]
  # one frame's time changed is a difference in a field, reported as a regression of that field, not another drive
  results, _ = regress(_timed(tmp_path / "one.zst", at=3, dt=7), ref)
  assert not results[0].different_drives and {f.path for f in results[0].worst()} == {"modelV2.timestampEof", "cameraOdometry.timestampEof"}
  results, _ = regress(_timed(tmp_path / "same.zst"), ref)
  assert not results[0].regression and not results[0].different_drives


def test_report_segment_must_be_the_drive_the_runs_came_from(drives, tmp_path):
  (seg1, out1), (seg2, _) = drives[1], drives[2]
  err = _error(run_cli("regress", out1, out1, "--report", tmp_path / "wrong", "--segment", seg2))
  assert f"--segment {seg2} is not the drive" in err and "seed 2" in err and "seed 1" in err
  assert not (tmp_path / "wrong").exists()
  r = run_cli("regress", out1, out1, "--segment", seg1)  # the same check with --segment alone (its truth for the accuracy)
  assert r.returncode == 0 and "WARNING" not in r.stdout, r.stdout + r.stderr
  r = run_cli("regress", out1, out1, "--segment", seg2, "--allow-different-drives")
  assert r.returncode == 0, r.stdout + r.stderr
  assert any(x.startswith(f"WARNING   {LOG}: different drives") and str(seg2) in x for x in r.stdout.splitlines()), r.stdout
  # the segment `replay --engine ray` recorded beside an output is checked too
  shutil.copytree(out1, tmp_path / "side")
  write_atomic(store.meta_path(tmp_path / "side" / LOG), json.dumps({"segment": str(seg2)}).encode())
  err = _error(run_cli("regress", tmp_path / "side", tmp_path / "side", "--report", tmp_path / "rep"))
  assert "recorded beside the output" in err and "is not the drive" in err
  # no sidecar (as for a real drive): the segment's camera states decide; here the clock is another camera's
  log = _retimed(out1 / LOG, tmp_path / "bare" / LOG, shift_ns=3_000_000_000)
  err = _error(run_cli("regress", log, log, "--segment", seg1))
  assert f"--segment {seg1} is not the drive" in err and "in the segment" in err
  log = _retimed(out1 / LOG, tmp_path / "bare2" / LOG)
  r = run_cli("regress", log, log, "--segment", seg1)
  assert r.returncode == 0, r.stdout + r.stderr
