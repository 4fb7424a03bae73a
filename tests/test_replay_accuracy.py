"""Ground truth for replay and regress: synthetic segments are recognised from their initData, each output frame is held to
the scene at the right time, `replay` writes <output>.accuracy.json and `regress` reports both runs."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_replay import artifact  # noqa: F401  (the cached tiny 1344x760 CPU artifact; same xdist group)

from offcar.frame_map import plan_segment
from offcar.replay_accuracy import TruthSource, evaluate, lat_action_t, outputs_from_log, synthetic_source, truth_at
from selfdrive_glue import messaging
from selfdrive_glue.errors import UserError
from selfdrive_glue.logs import LogReader
from selfdrive_glue.road_render import RoadScene
from selfdrive_glue.route import open_segment
from selfdrive_glue.synth import segment_events, synth_route, synth_segment
from selfdrive_glue.video import VideoReader

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("replay")
SEED, CAMERA, SECONDS = 31, "1344x760", 1.0


def _events(index: int = 0, encode_index: bool = True, seconds: float = SECONDS):
  scene = RoadScene(SEED, CAMERA)
  return [messaging.log_from_bytes(b) for b in segment_events(scene, index * seconds, seconds, int(round(seconds * 20)), index=index,
                                                              encode_index=encode_index)]


def test_synthetic_segments_are_recognised_and_timed_by_their_log():
  """synth's initData names the scene; every road frameId maps to the time it was rendered, segment k starting k * seconds
  in, even when seconds * 20 is not a whole number of frames."""
  src = synthetic_source(_events(index=2))
  assert src is not None and (src.seed, src.camera) == (SEED, CAMERA)
  fids = sorted(src.frames)
  assert fids == list(range(40, 60))  # synth numbers frames from the start of the drive
  assert [src.frames[f][0] for f in fids] == pytest.approx([2.0 + i / 20 for i in range(20)], abs=1e-9)
  assert all(src.frames[f][1] == pytest.approx(0.2 + 0.075) for f in fids)  # liveDelay 0.2 + one step and a half
  odd = synthetic_source(_events(index=3, seconds=0.33))  # 7 frames a segment; segment 3 starts 0.99 s in, frame 20
  assert odd is not None and min(odd.frames) == 20 and odd.frames[20][0] == pytest.approx(0.99, abs=1e-9)


def test_other_segments_get_no_truth():
  """No initData (synth's old shape, or an old real log) or an initData from another writer: nothing is guessed."""
  assert synthetic_source(_events(encode_index=False)) is None
  evs = []
  for ev in _events():
    if ev.which() == "initData":
      m = messaging.new_message("initData", logMonoTime=ev.logMonoTime)
      m.initData.dongleId = ev.initData.dongleId
      m.initData.version = "0.9.7-release"  # a device's
      m.initData.gitBranch = "release3"
      ev = messaging.log_from_bytes(m.to_bytes())
    evs.append(ev)
  assert synthetic_source(evs) is None
  # a synth marker with a dongleId that is not a seed is refused by name, not read as some other scene
  bad = []
  for ev in _events():
    if ev.which() == "initData":
      m = messaging.new_message("initData", logMonoTime=ev.logMonoTime)
      m.initData.dongleId, m.initData.version, m.initData.gitBranch = "not-hex", "modeld-msm synth", "synth"
      ev = messaging.log_from_bytes(m.to_bytes())
    bad.append(ev)
  with pytest.raises(UserError, match="dongleId 'not-hex' is not the scene seed"):
    synthetic_source(bad)
  # a seed that is hex but not this drive's (its scene's calibration is not the logged one): refused, not scored against another road
  other = []
  for ev in _events():
    if ev.which() == "initData":
      m = messaging.new_message("initData", logMonoTime=ev.logMonoTime)
      m.initData.dongleId, m.initData.version, m.initData.gitBranch = f"{SEED + 1:016x}", "modeld-msm synth", "synth"
      ev = messaging.log_from_bytes(m.to_bytes())
    other.append(ev)
  with pytest.raises(UserError, match=f"initData names scene seed {SEED + 1}, but that scene's calibration"):
    synthetic_source(other)


def test_evaluate_scores_against_the_truth_and_refuses_foreign_frames():
  src = synthetic_source(_events(index=1))
  assert src is not None
  truths = {f: truth_at(src.seed, src.camera, *src.frames[f]) for f in src.frames}
  perfect = [(f, tr.lane_lines_y, tr.desired_curvature) for f, tr in truths.items()]
  s = evaluate(src, perfect).summary
  assert s["frames"] == 20 and s["lane_error_m_p50"] == pytest.approx(0, abs=1e-9) and s["curvature_corr"] == pytest.approx(1) and s["passes"]
  off = [(f, y + 0.5, c) for f, y, c in perfect]  # every line 0.5 m to the right
  assert evaluate(src, off).summary["lane_error_m_p50"] == pytest.approx(0.5) and not evaluate(src, off).summary["passes"]
  nan = perfect[:1] + [(f, y * np.nan, c) for f, y, c in perfect[1:3]] + perfect[3:]
  s = evaluate(src, nan).summary
  assert s["frames"] == 18 and s["skipped_frames"] == 2
  with pytest.raises(UserError, match="frameId 999"):
    evaluate(src, perfect + [(999, perfect[0][1], 0.0)])


@pytest.fixture(scope="module")
def route(tmp_path_factory):
  """Two 1 s segments of one drive: segment 1 starts 1 s in, its frameIds at 20."""
  d = tmp_path_factory.mktemp("acc_route")
  synth_route(d, 2, SECONDS, SEED, CAMERA, progress=False, qcamera=False)
  return d


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def replayed(route, artifact, tmp_path_factory):  # noqa: F811
  out = tmp_path_factory.mktemp("acc_out")
  r = _cli("replay", "--quiet", route, "-o", out / "new", "--artifact", artifact)
  assert r.returncode == 0, r.stdout + r.stderr
  return out, r


def test_replay_writes_the_accuracy_beside_each_output(route, replayed):
  out, r = replayed
  segs = sorted(p for p in route.iterdir() if p.is_dir())
  for k, seg in enumerate(segs):
    log = out / "new" / f"{seg.name}.zst"
    side = out / "new" / f"{seg.name}.zst.accuracy.json"
    doc = json.loads(side.read_text())
    n_out = sum(1 for ev in LogReader(log) if ev.which() == "modelV2")
    assert doc["segment"] == seg.name and doc["frames"] + doc["skipped_frames"] == n_out > 10
    assert doc["truth"]["seed"] == SEED and doc["truth"]["camera"] == CAMERA
    assert all(isinstance(doc[k_], float) for k_ in ("lane_error_m_p50", "lane_error_m_p90", "curvature_corr"))
    assert doc["lane_error_m_p50"] <= doc["lane_error_m_p90"]
    assert min(doc["truth"]["scene_t"]) == pytest.approx(k * SECONDS)  # segment k starts k * seconds into the drive
    # on stderr with the other notes: stdout stays one result line per segment
    assert f"replay: {seg.name}: ground truth (synthetic, seed {SEED}): lane error at 20 m p50 {doc['lane_error_m_p50']:.3f} m" in r.stderr
    assert str(side) in r.stderr
  assert len(r.stdout.strip().splitlines()) == len(segs)


def test_mapped_time_is_the_time_of_the_picture_the_model_saw(route, replayed):
  """For each output of segment 1, the picture replay paired with its frameId is the scene rendered at the mapped time,
  not one frame earlier or later. The pictures are what pin the mapping to the frame: the truth at 20 m moves only
  ~0.2 mm per frame on these roads, so a shifted mapping changes the numbers a little, which is checked too."""
  out, _ = replayed
  seg = sorted(p for p in route.iterdir() if p.is_dir())[1]
  src = TruthSource.from_json(json.loads((out / "new" / f"{seg.name}.zst.accuracy.json").read_text())["truth"])
  plan = plan_segment(open_segment(seg))
  video_of = {int(plan.events[p].roadCameraState.frameId): v for p, v in plan.road.frame_of.items()}
  frames = [f.copy() for f in VideoReader(seg / "fcamera.hevc").frames()]
  scene = RoadScene(SEED, CAMERA)
  outputs = outputs_from_log(out / "new" / f"{seg.name}.zst")
  checked = 0
  for fid, _, _ in outputs[::4]:
    t = src.frames[fid][0]
    seen = frames[video_of[fid]].astype(np.int16)
    diffs = []
    for dt in (-0.05, 0.0, 0.05):
      buf = np.zeros_like(frames[0])
      scene.render_into(buf, t + dt, "road")
      diffs.append(float(np.abs(buf.astype(np.int16) - seen).mean()))
    assert diffs[1] < 0.8 * min(diffs[0], diffs[2]), (fid, t, diffs)
    checked += 1
  assert checked >= 3
  shifted = TruthSource(src.seed, src.camera, {f: (t + 0.05, a) for f, (t, a) in src.frames.items()})
  fid = outputs[len(outputs) // 2][0]
  a, b = truth_at(src.seed, src.camera, *src.frames[fid]), truth_at(src.seed, src.camera, *shifted.frames[fid])
  assert np.abs(a.lane_y_at(20.0) - b.lane_y_at(20.0)).min() > 1e-5 and abs(a.plan[-1, 1] - b.plan[-1, 1]) > 0.05  # path at 10 s
  assert evaluate(src, outputs).summary["lane_error_m_p50"] != evaluate(shifted, outputs).summary["lane_error_m_p50"]
  assert src.frames[fid][1] == pytest.approx(lat_action_t(0.2))


def test_regress_reports_both_runs_against_ground_truth(route, replayed, artifact, tmp_path):  # noqa: F811
  out, _ = replayed
  r = _cli("regress", out / "new", out / "new", "--report", tmp_path / "rep")
  assert r.returncode == 0, r.stdout + r.stderr
  segs = sorted(p.name for p in route.iterdir() if p.is_dir())
  for name in segs:
    doc = json.loads((out / "new" / f"{name}.zst.accuracy.json").read_text())
    for run in ("NEW", "REF"):
      line = next(x for x in r.stdout.splitlines() if x.startswith(f"ACCURACY  {name}.zst {run}: "))
      assert f"p50 {doc['lane_error_m_p50']:.3f} m" in line and f"{doc['frames']} frames" in line and f"seed {SEED}, {CAMERA}" in line
  page = (tmp_path / "rep" / "report.html").read_text()
  assert "<h2>Ground truth</h2>" in page and page.count(f"seed {SEED}, {CAMERA}</td>") == 2 * len(segs)
  rep = json.loads((tmp_path / "rep" / "report.json").read_text())
  assert sorted(a["log"] for a in rep["accuracy"]) == [f"{n}.zst" for n in segs] and all(a["new"]["frames"] > 10 for a in rep["accuracy"])
  # without the sidecars the truth still comes from the segment, when regress is told where it is
  bare = tmp_path / "bare"
  bare.mkdir()
  log = out / "new" / f"{segs[1]}.zst"
  (bare / log.name).write_bytes(log.read_bytes())
  r = _cli("regress", bare / log.name, log, "--segment", route / segs[1])
  assert r.returncode == 0 and sum(x.startswith(f"ACCURACY  {log.name} ") for x in r.stdout.splitlines()) == 2, r.stdout + r.stderr


def test_non_synthetic_segment_gets_no_accuracy_and_loses_a_stale_one(artifact, tmp_path):  # noqa: F811
  seg = tmp_path / "old--0"
  synth_segment(seg, SECONDS, SEED, CAMERA, progress=False, qcamera=False, encode_index=False)  # no initData: not recognised
  out = tmp_path / "out.zst"
  stale = tmp_path / "out.zst.accuracy.json"
  stale.write_text("{}")
  r = _cli("replay", "--quiet", seg, "-o", out, "--artifact", artifact)
  assert r.returncode == 0, r.stdout + r.stderr
  assert out.is_file() and not stale.exists() and "ground truth" not in r.stdout + r.stderr
  r = _cli("regress", out, out)
  assert r.returncode == 0 and "ACCURACY" not in r.stdout


def test_regress_evaluates_a_log_changed_since_its_sidecar_again(route, replayed, tmp_path):
  """A sidecar's summary is used only for the bytes it was computed from: a log replaced since (here every lane line moved
  1 m right) is evaluated again from the sidecar's truth source, not reported with the stale numbers."""
  from selfdrive_glue.logs import LogWriter
  out, _ = replayed
  name = sorted(p.name for p in route.iterdir() if p.is_dir())[0] + ".zst"
  log, side = out / "new" / name, out / "new" / (name + ".accuracy.json")
  evs = []
  for ev in LogReader(log):
    b = ev.as_builder()
    if ev.which() == "modelV2":
      for ll in b.modelV2.laneLines:
        ll.y = [y + 1.0 for y in ll.y]
    evs.append(b.to_bytes())
  moved = tmp_path / "moved"
  moved.mkdir()
  with LogWriter(moved / name) as w:
    w.write_all(evs)
  (moved / side.name).write_bytes(side.read_bytes())  # the old sidecar, now stale
  r = _cli("regress", moved / name, log)
  assert r.returncode == 1, r.stdout + r.stderr  # lane lines differ: a regression
  doc = json.loads(side.read_text())
  new = next(x for x in r.stdout.splitlines() if x.startswith(f"ACCURACY  {name} NEW: "))
  ref = next(x for x in r.stdout.splitlines() if x.startswith(f"ACCURACY  {name} REF: "))
  assert f"p50 {doc['lane_error_m_p50']:.3f} m" in ref and f"p50 {doc['lane_error_m_p50']:.3f} m" not in new
  assert f"{doc['frames']} frames" in new
