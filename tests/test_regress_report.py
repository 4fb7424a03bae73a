"""regress --report: the HTML page (fields pass/fail, distributions, worst frames on the camera image) and the
model_replay gates, on real replay outputs of a synthetic segment and on made-up outputs."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_replay
from test_regress import _outputs, _write

from offcar import replay_store as store
from offcar.regress import regress, write_report
from offcar.replay import replay_segment
from selfdrive_glue.files import write_atomic
from selfdrive_glue.logs import LogReader, LogWriter
from selfdrive_glue.synth import synth_segment

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("replay")
artifact = test_replay.artifact  # the tiny 1344x760 CPU artifact fixture, cached under .cache/ and shared with test_replay.py


@pytest.fixture(scope="module")
def replayed(tmp_path_factory, artifact):
  """(segment, REF output dir, NEW output dir, planted frameIds): a real replay, and a copy with lane line 1 and the path
  moved at two frames."""
  d = tmp_path_factory.mktemp("report")
  seg = d / "00000009--0123456789--1"
  synth_segment(seg, 0.5, 9, "1344x760", index=1, qcamera=False, progress=False)
  (d / "ref").mkdir()
  res = replay_segment(seg, artifact, d / "ref" / f"{seg.name}.zst")
  assert res.error is None and res.published >= 5
  fids = [ev.modelV2.frameId for ev in LogReader(d / "ref" / f"{seg.name}.zst") if ev.which() == "modelV2"]
  planted = (fids[1], fids[-2])
  (d / "new").mkdir()
  out = []
  for ev in LogReader(d / "ref" / f"{seg.name}.zst"):
    b = ev.as_builder()
    if ev.which() == "modelV2" and ev.modelV2.frameId in planted:
      b.modelV2.laneLines[1].y = [v + 0.8 for v in ev.modelV2.laneLines[1].y]
      b.modelV2.position.y = [v + 0.02 * k for k, v in enumerate(ev.modelV2.position.y)]
    out.append(b.to_bytes())
  with LogWriter(d / "new" / f"{seg.name}.zst") as w:
    w.write_all(out)
  return seg, d / "ref", d / "new", planted


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "cli.main", "regress", *map(str, args)], capture_output=True, text=True, timeout=300,
                        cwd=ROOT)


def _rows(page: str) -> dict[str, str]:
  """field -> PASS/FAIL, from the fields table."""
  return {f: s for s, f in re.findall(r'<tr class="(?:pass|fail)"><td>(PASS|FAIL)</td><td>([^<]+)</td>', page)}


def _blank_share(png: Path) -> float:
  """Share of the picture in the blank canvas' grey (40, 40, 40): ~all of it without a camera image, ~none with one."""
  import matplotlib.image
  img = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int)
  return float((np.abs(img - 40).max(axis=-1) <= 2).mean())


def test_report_marks_failing_fields_and_draws_the_worst_frames_on_the_camera_image(replayed, tmp_path):
  seg, ref, new, planted = replayed
  r = _cli(new, ref, "--report", tmp_path / "rep", "--segment", seg)
  assert r.returncode == 1, r.stdout + r.stderr
  page = (tmp_path / "rep" / "report.html").read_text()
  assert '<h1 class="REGRESSION">' in page
  rows = _rows(page)
  assert {f for f, s in rows.items() if s == "FAIL"} == {"modelV2.laneLines[1].y", "modelV2.position.y"}
  assert len(rows) > 50 and "modelV2.laneLines[2].y" in rows  # every compared field is listed, the others pass
  frames = re.findall(r'<img src="(frame_\d+\.png)"', page)
  assert len(frames) == len(planted)
  for fid in planted:
    assert f"frame {fid}, " in page
  assert page.count("road camera: video frame ") == len(planted)
  for f in frames:
    png = tmp_path / "rep" / f
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and _blank_share(png) < 0.05
  assert (tmp_path / "rep" / "distributions.png").stat().st_size > 10_000 and 'src="distributions.png"' in page
  # without the segment the same frames are drawn on a blank canvas, and the page says how to get the image
  r = _cli(new, ref, "--report", tmp_path / "blank")
  blank = (tmp_path / "blank" / "report.html").read_text()
  assert r.returncode == 1 and "pass --segment DIR" in blank and "road camera" not in blank
  assert _blank_share(tmp_path / "blank" / "frame_0.png") > 0.5
  # the segment that `replay --engine ray` records beside each output is found without --segment
  for d in (new, ref):
    shutil.copytree(d, tmp_path / f"side-{d.name}")
  out = tmp_path / "side-new" / f"{seg.name}.zst"
  write_atomic(store.meta_path(out), f'{{"segment": "{seg}"}}'.encode())
  r = _cli(tmp_path / "side-new", tmp_path / "side-ref", "--report", tmp_path / "side")
  assert r.returncode == 1 and (tmp_path / "side" / "report.html").read_text().count("road camera: video frame ") == len(planted)


def test_identical_outputs_all_pass(replayed, tmp_path):
  seg, ref, _, _ = replayed
  r = _cli(ref, ref, "--report", tmp_path / "rep", "--segment", seg)
  assert r.returncode == 0, r.stdout + r.stderr
  page = (tmp_path / "rep" / "report.html").read_text()
  rows = _rows(page)
  assert len(rows) > 50 and set(rows.values()) == {"PASS"}
  assert '<h1 class="PASS">' in page and "No frame has a value outside tolerance" in page and "identical in every compared value" in page
  assert not list((tmp_path / "rep").glob("frame_*.png"))


def test_html_is_written_atomically(tmp_path, monkeypatch):
  import os
  ref = _write(tmp_path / "ref.zst", _outputs())
  new = _write(tmp_path / "new.zst", _outputs(change=(3, lambda mv: setattr(mv.action, "desiredAcceleration", 0.5))))
  results, messages = regress(new, ref)
  rep = tmp_path / "rep"
  rep.mkdir()
  (rep / "report.html").write_text("the previous report")
  real = os.replace

  def failing(src, dst):
    if Path(dst).name == "report.html":
      raise OSError(28, "No space left on device")
    return real(src, dst)
  monkeypatch.setattr(os, "replace", failing)
  with pytest.raises(OSError):
    write_report(rep, results, messages, 0.0, ("logMonoTime",), new=new, ref=ref)
  assert (rep / "report.html").read_text() == "the previous report"
  assert not [p.name for p in rep.iterdir() if p.name.startswith(".")]  # no temp file left behind
  monkeypatch.setattr(os, "replace", real)
  write_report(rep, results, messages, 0.0, ("logMonoTime",), new=new, ref=ref)
  assert _rows((rep / "report.html").read_text())["modelV2.action.desiredAcceleration"] == "FAIL"


def test_openpilot_gates(tmp_path):
  """model_replay's numbers: on a PC 30 % and no trajectories; on the device (float epsilon) both changes fail."""
  ref = _write(tmp_path / "ref.zst", _outputs())

  def plant(mv):
    mv.action.desiredCurvature = mv.action.desiredCurvature * 1.2
    lanes = mv.laneLines
    lanes[1].y = [v + 1.0 for v in lanes[1].y]
  new = _write(tmp_path / "new.zst", _outputs(change=(5, plant)))
  r = _cli(new, ref, "--gate", "openpilot-pc", "--report", tmp_path / "pc")
  assert r.returncode == 0, r.stdout + r.stderr
  page = (tmp_path / "pc" / "report.html").read_text()
  assert "modelV2.laneLines.y" in page and "modelV2.laneLines[1].y" not in _rows(page)  # stated as not compared
  assert _rows(page)["modelV2.action.desiredCurvature"] == "PASS"
  r = _cli(new, ref, "--gate", "openpilot-device")
  assert r.returncode == 1 and "modelV2.action.desiredCurvature" in r.stdout and "modelV2.laneLines[1].y" in r.stdout
  # openpilot's rule makes 0.3 an absolute bound too (the curvature, ~1e-3, passes by that); numbers given override the gate's
  r = _cli(new, ref, "--gate", "openpilot-pc", "--tolerance", "0.1", "--abs-tolerance", "0")
  assert r.returncode == 1 and "desiredCurvature" in r.stdout and "laneLines" not in r.stdout
