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

from offcar.frame_map import plan_segment
from offcar.regress import regress
from offcar.replay import Replayer, replay_many, replay_segment
from selfdrive_glue.errors import UserError
from selfdrive_glue.logs import LogReader, LogWriter
from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.route import expand_segments, open_segment
from selfdrive_glue.synth import synth_route, synth_segment
from selfdrive_glue.video import VideoReader, VideoWriter

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("replay")  # one worker builds the artifact once


def _artifact_key() -> str:
  import json

  from artifact.format import installed_versions
  h = hashlib.sha256(json.dumps(installed_versions(), sort_keys=True).encode())
  for p in sorted((ROOT / "compile").glob("*.py")):
    h.update(p.read_bytes())
  return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def artifact():
  """tiny reference models compiled for 1344x760 on CPU; cached under .cache/ keyed by the compiler sources."""
  from compile.build import compile_artifact
  from compile.refmodels.driving import write_models
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
      models = {"vision": models / "driving_vision.onnx", "policy": models / "driving_policy.onnx"}
      compile_artifact("driving", models, (1344, 760), "CPU", out, log=lambda *_: None)
  return out


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
  d = tmp_path_factory.mktemp("replay") / "00000001--abcdef0123--0"
  synth_segment(d, 1.0, 31, "1344x760", progress=False, qcamera=False)
  return d


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "cli.main", "replay", "--quiet", *map(str, args)], capture_output=True, text=True,
                        timeout=300, cwd=ROOT)


def _copy_seg(seg: Path, dst: Path) -> Path:
  shutil.copytree(seg, dst)
  return dst


def test_deterministic_and_paired_like_process_replay(seg, artifact, tmp_path):
  a = replay_segment(seg, artifact, tmp_path / "a.zst")
  b = replay_segment(seg, artifact, tmp_path / "b.zst")
  # synth's real shape: video from frame 2, road frame 11 never encoded -> 17 road frames; steps on frames 2 and 12
  # follow a frame-id gap, so they only warm the image queues (as modeld does after a drop)
  assert a.frames == b.frames == 17 and a.published == 15 and a.events_out == 45 and a.damage is None
  assert a.mapping == "encode index" and a.skipped == 5 and a.recovered == 0 and a.start == "fresh"
  assert (tmp_path / "a.zst").read_bytes() == (tmp_path / "b.zst").read_bytes()
  out = list(LogReader(tmp_path / "a.zst"))
  assert [e.which() for e in out[:3]] == ["modelV2", "drivingModelData", "cameraOdometry"]
  evs = list(LogReader(seg / "rlog.zst"))
  encoded = {e.roadEncodeIdx.frameId for e in evs if e.which() == "roadEncodeIdx"}
  road = {e.roadCameraState.frameId: e for e in evs if e.which() == "roadCameraState"}
  wide = {e.wideRoadCameraState.frameId: e for e in evs if e.which() == "wideRoadCameraState"}
  models = [e for e in out if e.which() == "modelV2"]
  assert [m.modelV2.frameId for m in models] == sorted(encoded - {2, 12})
  assert all(m.modelV2.frameIdExtra == m.modelV2.frameId for m in models)  # road and wide of the same moment
  assert [m.modelV2.timestampEof for m in models] == [road[m.modelV2.frameId].roadCameraState.timestampEof for m in models]
  # a step fires at the second camera state of the pair, and carries its log time
  assert [m.logMonoTime for m in models] == [wide[m.modelV2.frameId].logMonoTime for m in models]
  assert all(m.valid for m in models)  # calibration and device state arrived before the first frame
  assert all(m.modelV2.modelExecutionTime == 0.0 for m in models)  # log clock, not the wall clock
  odo = [e.cameraOdometry for e in out if e.which() == "cameraOdometry"]
  assert [o.frameId for o in odo] == [m.modelV2.frameId for m in models]
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
  assert res.frames == 7 and len(models) == res.published == 5
  assert all(m.frameIdExtra == m.frameId for m in models)


def test_cli_jobs_match_serial_and_regress_passes(artifact, tmp_path):
  synth_route(tmp_path / "route", 2, 0.5, 33, "1344x760", qcamera=False, progress=False)
  r1 = _cli(tmp_path / "route", "--artifact", artifact, "-o", tmp_path / "serial")
  assert r1.returncode == 0, r1.stderr
  r2 = _cli(tmp_path / "route", "--artifact", artifact, "-o", tmp_path / "par", "--jobs", "2")
  assert r2.returncode == 0, r2.stderr
  files = sorted(p.name for p in (tmp_path / "serial").iterdir())  # each log and its ground-truth accuracy (synthetic segments)
  assert len(files) == 4 and files == sorted(p.name for p in (tmp_path / "par").iterdir())
  for f in files:
    assert (tmp_path / "serial" / f).read_bytes() == (tmp_path / "par" / f).read_bytes()
  r = subprocess.run([sys.executable, "-m", "cli.main", "regress", str(tmp_path / "par"), str(tmp_path / "serial")],
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
  _one_line_error(_cli(wrong_count, "--artifact", artifact, "-o", tmp_path / "o3.zst"), "25 frames", "wideRoadEncodeIdx accounts for 18")

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
  assert 5 <= n < 15


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
  assert len(models) == 15 and all(m.valid for m in models)


def test_output_naming(tmp_path):
  from offcar.replay import output_paths
  from selfdrive_glue.errors import UserError
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


# ---- frames through the encode index ----

def _with_log(seg: Path, dst: Path, keep=lambda ev: True) -> Path:
  """A copy of a segment whose rlog holds only the events `keep` accepts."""
  _copy_seg(seg, dst)
  raws = list(LogReader(seg / "rlog.zst").events_with_bytes())
  with LogWriter(dst / "rlog.zst") as w:
    w.write_all(b for ev, b in raws if keep(ev))
  return dst


def _encoded_ids(seg: Path) -> dict[str, set[int]]:
  evs = list(LogReader(seg / "rlog.zst"))
  return {state: {getattr(e, idx).frameId for e in evs if e.which() == idx}
          for state, idx in (("roadCameraState", "roadEncodeIdx"), ("wideRoadCameraState", "wideRoadEncodeIdx"))}


def _order_mapped(seg: Path, dst: Path) -> Path:
  """The hand-built equivalent of a real-shaped segment: no encode index, and only the camera states whose frame is in
  the video, so frame k of each file is state k (what an old-style log looks like)."""
  enc = _encoded_ids(seg)

  def keep(ev):
    w = ev.which()
    if w in ("roadEncodeIdx", "wideRoadEncodeIdx", "initData"):
      return False
    return w not in enc or getattr(ev, w).frameId in enc[w]
  return _with_log(seg, dst, keep)


def test_encode_index_replays_the_frames_it_names(seg, artifact, tmp_path):
  """synth plants a real offset (video from the third state) and a dropped frame: mapped through the index, the outputs
  are byte-identical to a hand-built segment with no offset (states trimmed to the encoded frames, paired by order)."""
  a = replay_segment(seg, artifact, tmp_path / "index.zst")
  b = replay_segment(_order_mapped(seg, tmp_path / "order--0"), artifact, tmp_path / "order.zst")
  assert a.mapping == "encode index" and b.mapping == "order (no encode index in the log)" and b.skipped == 0
  assert a.frames == b.frames == 17
  assert (tmp_path / "index.zst").read_bytes() == (tmp_path / "order.zst").read_bytes()
  # the same log without its index has 20 states for 17 pictures: order cannot explain it, so it is refused, not replayed
  no_index = _with_log(seg, tmp_path / "no_index", lambda ev: ev.which() not in ("roadEncodeIdx", "wideRoadEncodeIdx"))
  with pytest.raises(UserError, match="17 frames but the log has 20"):
    plan_segment(open_segment(no_index))


def test_lost_index_entry(seg, artifact, tmp_path):
  """An entry lost from the log between two consecutive ones is pinned down exactly (same outputs); one next to an
  encoder drop cannot be, so those states are skipped rather than guessed."""
  lost6 = _with_log(seg, tmp_path / "lost6", lambda ev: not (ev.which() == "roadEncodeIdx" and ev.roadEncodeIdx.frameId == 6))
  r = replay_segment(lost6, artifact, tmp_path / "lost6.zst")
  assert r.recovered == 1 and r.skipped == 5 and r.frames == 17
  replay_segment(seg, artifact, tmp_path / "ref.zst")
  assert (tmp_path / "lost6.zst").read_bytes() == (tmp_path / "ref.zst").read_bytes()
  # 11 was never encoded; with 12's entry lost, video frame 9 could be either, so neither state gets a picture
  lost12 = _with_log(seg, tmp_path / "lost12", lambda ev: not (ev.which() == "roadEncodeIdx" and ev.roadEncodeIdx.frameId == 12))
  plan = plan_segment(open_segment(lost12))
  road_ids = {plan.events[p].roadCameraState.frameId for p in plan.road.frame_of}
  assert road_ids == _encoded_ids(seg)["roadCameraState"] - {12} and plan.road.recovered == 0 and plan.road.skipped == 4


def _reencode(path: Path, frames: list[np.ndarray], w: int = 1344, h: int = 760) -> None:
  with VideoWriter(path, w, h) as vw:
    for f in frames:
      vw.write(f)


def test_planted_offsets_are_refused(seg, tmp_path):
  """A camera file shifted against its log, or from another segment, is refused by name; never paired silently."""
  frames = [f.copy() for f in VideoReader(seg / "fcamera.hevc").frames()]
  assert len(frames) == 17
  late = _copy_seg(seg, tmp_path / "late")  # two extra pictures in front: every index entry would name the wrong one
  _reencode(late / "fcamera.hevc", frames[:1] * 2 + frames)
  with pytest.raises(UserError, match="19 frames, but the log's roadEncodeIdx accounts for 17 .*shifted against the log"):
    plan_segment(open_segment(late))
  early = _copy_seg(seg, tmp_path / "early")  # the first two pictures cut off
  _reencode(early / "fcamera.hevc", frames[2:])
  with pytest.raises(UserError, match="15 frames, but the log's roadEncodeIdx puts camera frame 19 at video frame 16"):
    plan_segment(open_segment(early))
  other = synth_segment(tmp_path / "other", 1.0, 31, "1344x760", index=1, progress=False, qcamera=False, wide=False)
  foreign = _copy_seg(seg, tmp_path / "foreign")  # the same drive's next segment: 19 frames, no lead
  shutil.copy(other.path / "fcamera.hevc", foreign / "fcamera.hevc")
  with pytest.raises(UserError, match="from another segment"):
    plan_segment(open_segment(foreign))

  raws = list(LogReader(seg / "rlog.zst").events_with_bytes())
  corrupt = _copy_seg(seg, tmp_path / "corrupt")
  with LogWriter(corrupt / "rlog.zst") as w:
    for ev, b in raws:
      if ev.which() == "roadEncodeIdx" and ev.roadEncodeIdx.frameId == 3:  # claims frame 4's picture
        e = ev.as_builder()
        e.roadEncodeIdx.segmentId = 2
        b = e.to_bytes()
      w.write(b)
  with pytest.raises(UserError, match="encode index is corrupt"):
    plan_segment(open_segment(corrupt))


def test_fallback_to_order_is_reported(seg, artifact, tmp_path):
  """No encode index: order is all there is. An offset with equal counts cannot be seen, so the output says how frames
  were paired (summary line and a warning)."""
  enc = _encoded_ids(seg)["roadCameraState"]
  keep_n = len(enc)
  n_road = [0]

  def keep(ev):  # 17 road states for 17 pictures, but the last ones: two frames off from the video
    w = ev.which()
    if w in ("roadEncodeIdx", "wideRoadEncodeIdx", "initData"):
      return False
    if w == "roadCameraState":
      n_road[0] += 1
      return n_road[0] <= keep_n
    return w != "wideRoadCameraState"
  old = _with_log(seg, tmp_path / "old", keep)
  (old / "ecamera.hevc").unlink()
  r = _cli(old, "--artifact", artifact, "-o", tmp_path / "out.zst")
  assert r.returncode == 0, r.stderr
  assert "frames by order (no encode index in the log)" in r.stdout and "17 frames" in r.stdout
  assert "warning" in r.stderr and "no encode index" in r.stderr and "by order" in r.stderr
  r = _cli(seg, "--artifact", artifact, "-o", tmp_path / "index.zst")
  assert r.returncode == 0 and "frames by encode index; 5 camera state(s) without an encoded frame skipped" in r.stdout
  assert "warning" not in r.stderr


# ---- across segments ----

def test_reset_serves_many_segments_like_fresh_cores(seg, artifact, tmp_path):
  other = synth_segment(tmp_path / "other--0", 0.5, 40, "1344x760", progress=False, qcamera=False).path
  replay_segment(seg, artifact, tmp_path / "fresh.zst")
  r = Replayer(artifact)
  r.replay(other, tmp_path / "first.zst")
  jit = r.core.model.step.jit
  res = r.replay(seg, tmp_path / "reset.zst")
  assert res.start == "fresh" and r.core.model.step.jit is jit  # the loaded programs were kept
  assert len(r.core.model.state_buffers) == 4  # the image, big image, feature and desire queues; no reload fallback
  assert (tmp_path / "reset.zst").read_bytes() == (tmp_path / "fresh.zst").read_bytes()
  # without the reset the state of `other` leaks in: the check above can fail
  r.replay(other, tmp_path / "first.zst")
  carried = r.replay(seg, tmp_path / "carried.zst", mode="route", previous=open_segment(other))
  assert carried.start.startswith("carried on")
  assert (tmp_path / "carried.zst").read_bytes() != (tmp_path / "fresh.zst").read_bytes()


def test_core_reset_forgets_lane_change_desire_and_drops(artifact):
  """ModeldCore.reset(): a core driven into a lane change (DesireHelper, desire pulse, queues) with a frame drop behind it
  then behaves exactly like a new one."""
  from conftest import event_reader

  from modeld_msm.core import Frame, ModeldCore
  info = nv12_info(1344, 760)
  rng = np.random.default_rng(0)
  bufs = [rng.integers(0, 255, info.size, dtype=np.uint8) for _ in range(2)]

  def feed(core, first: int, blinker: bool):
    outs = []
    for n in range(first, first + 5):
      core.on_message(event_reader("deviceState", deviceType="mici"))
      core.on_message(event_reader("roadCameraState", frameId=n, sensor="os04c10"))
      core.on_message(event_reader("liveCalibration", rpyCalib=[0.0, 0.01, 0.0]))
      core.on_message(event_reader("carState", vEgo=25.0, leftBlinker=blinker, steeringPressed=blinker, steeringTorque=1.0 * blinker))
      core.on_message(event_reader("carControl", latActive=True))
      f = Frame(bufs[n % 2], n, n * 50_000_000, n * 50_000_000 + 30_000_000)
      outs.append(core.on_frame(f, f, n))
    return outs
  want = feed(ModeldCore(artifact, clock=lambda: 0.0), 1, False)  # a fixed clock: modelExecutionTime is 0 in both
  used = ModeldCore(artifact, clock=lambda: 0.0)
  feed(used, 1, True)
  feed(used, 10, True)  # after a gap: a dropped frame
  assert used.dh.lane_change_state == 2 and used.stats.dropped_steps == 1  # laneChangeStarting
  carried = feed(used, 1, False)
  assert carried != want
  used.reset()
  assert used.dh.lane_change_state == 0 and used.stats.frames == 0
  assert feed(used, 1, False) == want


@pytest.fixture(scope="module")
def route(tmp_path_factory):
  d = tmp_path_factory.mktemp("route")
  synth_route(d, 3, 0.5, 33, "1344x760", qcamera=False, progress=False)
  return expand_segments([str(d)])


def _run(route, artifact, out: Path, **kw) -> dict[str, bytes]:
  res = replay_many(route, artifact, out, progress=False, **kw)
  assert not [r.error for r in res if r.error]
  return {r.segment: r.out.read_bytes() for r in res} | {f"start {r.segment}": r.start.encode() for r in res}


def test_route_and_warmup_modes(route, artifact, tmp_path):
  names = [s.name for s in route]
  seg_mode = _run(route, artifact, tmp_path / "s", mode="segment")
  route_a = _run(route, artifact, tmp_path / "ra", mode="route")
  route_b = _run(list(reversed(route)), artifact, tmp_path / "rb", mode="route")  # argument order does not matter
  warm_a = _run(route, artifact, tmp_path / "wa", mode="warmup")
  warm_b = _run(route, artifact, tmp_path / "wb", mode="warmup")
  assert route_a == route_b and warm_a == warm_b  # identical run to run
  assert route_a[f"start {names[1]}"] == f"carried on from {names[0]}".encode()
  assert warm_a[f"start {names[1]}"] == f"warm-up on the last 7 frames of {names[0]}".encode()
  # the first segment starts fresh in every mode
  assert seg_mode[names[0]] == route_a[names[0]] == warm_a[names[0]]
  # a warm-up covering the whole previous segment is the continuous run through it
  assert warm_a[names[1]] == route_a[names[1]]
  # and carried state matters: a fresh start differs
  assert seg_mode[names[1]] != route_a[names[1]]
  # a short warm-up feeds only the tail of the previous segment
  short = _run(route, artifact, tmp_path / "short", mode="warmup", warmup_steps=3)
  assert short[f"start {names[2]}"] == f"warm-up on the last 3 frames of {names[1]}".encode()
  assert short[names[2]] != warm_a[names[2]]


def alone_fresh(seg, artifact, tmp_path: Path) -> bytes:
  replay_segment(seg, artifact, tmp_path / f"fresh-{seg.name}.zst")
  return (tmp_path / f"fresh-{seg.name}.zst").read_bytes()


def test_warmup_finds_the_previous_segment_on_disk(route, artifact, tmp_path):
  """Segment-parallel: a task given only segment n still warms up on n-1 from the route folder; without one it says so."""
  _run(route, artifact, tmp_path / "all", mode="warmup")
  alone = _run(route[1:2], artifact, tmp_path / "alone", mode="warmup")
  assert alone[route[1].name] == (tmp_path / "all" / f"{route[1].name}.zst").read_bytes()
  lonely = _copy_seg(route[1].path, tmp_path / "x" / route[1].name)
  res = replay_many([open_segment(lonely)], artifact, tmp_path / "l.zst", mode="warmup", progress=False)
  assert res[0].start == f"fresh (no previous segment {route[0].name})"
  # route mode: a segment that fails does not stop its route; the next one starts fresh and says why
  broken = [_copy_seg(s.path, tmp_path / "r" / s.name) for s in route]
  (broken[1] / "fcamera.hevc").unlink()
  res = replay_many(expand_segments([str(tmp_path / "r")]), artifact, tmp_path / "b", mode="route", progress=False)
  assert res[0].error is None and "fcamera.hevc" in (res[1].error or "") and res[2].error is None
  assert res[2].start == f"fresh (previous segment {route[1].name} failed)"
  assert res[2].out.read_bytes() == alone_fresh(route[2], artifact, tmp_path)


def test_cli_modes_with_jobs_match_serial(route, artifact, tmp_path):
  parent = route[0].path.parent
  for mode in ("warmup", "route"):
    r1 = _cli(parent, "--artifact", artifact, "-o", tmp_path / f"{mode}1", "--mode", mode)
    r2 = _cli(parent, "--artifact", artifact, "-o", tmp_path / f"{mode}2", "--mode", mode, "--jobs", "2")
    assert r1.returncode == 0 and r2.returncode == 0, (r1.stderr, r2.stderr)
    assert ("carried on" in r1.stdout) == (mode == "route") and ("warm-up on" in r1.stdout) == (mode == "warmup")
    for s in route:
      assert (tmp_path / f"{mode}1" / f"{s.name}.zst").read_bytes() == (tmp_path / f"{mode}2" / f"{s.name}.zst").read_bytes()


# ---- damaged or thin inputs (issue 24) ----

def test_damaged_camera_file_is_reported_with_its_frames(seg, artifact, tmp_path):
  """A slice the decoder cannot use: the replay goes on (the frame before stands in), but says which frames, in the
  summary line, a warning and the result recorded with the output."""
  import av
  bad = _copy_seg(seg, tmp_path / "bad")
  with av.open(str(seg / "fcamera.hevc"), format="hevc") as c:
    pos = [p.pos for p in c.demux(video=0) if p.size]
  data = bytearray((seg / "fcamera.hevc").read_bytes())
  data[pos[5] + 6:pos[5] + 14] = b"\xff" * 8  # its slice header; 0xff never forms a start code
  (bad / "fcamera.hevc").unlink()
  (bad / "fcamera.hevc").write_bytes(bytes(data))
  r = _cli(bad, "--artifact", artifact, "-o", tmp_path / "out.zst")
  assert r.returncode == 0, r.stderr
  assert "DAMAGED VIDEO: decode errors in" in r.stdout
  warn = [ln for ln in r.stderr.splitlines() if "fcamera.hevc is damaged" in ln]
  assert len(warn) == 1 and warn[0].startswith("modeld-msm replay: warning:") and "video frames 5" in warn[0], r.stderr
  res = replay_segment(bad, artifact, tmp_path / "api.zst")
  assert res.damaged_frames >= 1 and "fcamera.hevc is damaged" in (res.video_damage or "")
  assert replay_segment(seg, artifact, tmp_path / "clean.zst").video_damage is None


def test_no_model_output_is_an_error(seg, artifact, tmp_path):
  """Only the first encoded frame (camera frame 2) and its states: one step, and as it follows frames 0 and 1 it only
  fills the image queues. An output log without a model output is not a replay: nothing written, exit status 2."""
  first = min(_encoded_ids(seg)["roadCameraState"])
  cams = ("roadCameraState", "wideRoadCameraState", "roadEncodeIdx", "wideRoadEncodeIdx")
  thin = _with_log(seg, tmp_path / "thin", lambda ev: ev.which() not in cams or getattr(ev, ev.which()).frameId == first)
  for name in ("fcamera.hevc", "ecamera.hevc"):
    frame = next(VideoReader(seg / name).frames()).copy()
    (thin / name).unlink()
    _reencode(thin / name, [frame])
  plan = plan_segment(open_segment(thin))
  assert plan.road_steps and len(plan.road.frame_of) == 1 and plan.road.by_index
  r = _cli(thin, "--artifact", artifact, "-o", tmp_path / "out.zst")
  _one_line_error(r, "1 model step(s) but not one model output", "nothing written")
  assert not (tmp_path / "out.zst").exists()


def _retimed_wide(seg: Path, dst: Path, offset_ns: int) -> Path:
  """A copy of `seg` whose wide camera runs offset_ns after the road camera (before: 0.3 ms): its states' and index
  entries' start/end of frame and their log times move together, so they arrive in the order a device would log them."""
  _copy_seg(seg, dst)
  evs = []
  for ev, b in LogReader(seg / "rlog.zst").events_with_bytes():
    t = ev.logMonoTime
    if ev.which() in ("wideRoadCameraState", "wideRoadEncodeIdx"):
      e = ev.as_builder()
      m = getattr(e, ev.which())
      m.timestampSof += offset_ns
      m.timestampEof += offset_ns
      e.logMonoTime = t = t + offset_ns
      b = e.to_bytes()
    evs.append((t, b))
  evs.sort(key=lambda tb: tb[0])  # stable: ties keep log order
  with LogWriter(dst / "rlog.zst") as w:
    w.write_all(b for _, b in evs)
  return dst


@pytest.mark.parametrize("offset_ms,extra_minus_road", [(20, 0), (30, -1), (-20, 0), (-30, 1)])
def test_road_and_wide_pair_within_25_ms(seg, artifact, tmp_path, offset_ms, extra_minus_road):
  """modeld's window: a road and a wide frame whose start of frame is within 25 ms are one capture. 30 ms apart they
  are not: the road frame goes with the wide frame on its other side (20 ms away), as modeld pairs them."""
  moved = _retimed_wide(seg, tmp_path / "moved", offset_ms * 1_000_000)
  replay_segment(moved, artifact, tmp_path / "out.zst")
  models = [e.modelV2 for e in LogReader(tmp_path / "out.zst") if e.which() == "modelV2"]
  assert len(models) >= 10
  assert {m.frameIdExtra - m.frameId for m in models} == {extra_minus_road}


@pytest.mark.slow
def test_modeld_pairs_within_25_ms_too(cpu_artifact_1928, prefix):
  """Serve pairs VisionIPC receives, replay logged states (one rule, modeld_msm/frames.py): with the wide camera 20 ms early a road frame
  goes with the wide frame of the same capture; 30 ms early, with the next one (20 ms after it), as openpilot's modeld
  pairs them. One modeld process, the offset changed midway."""
  from conftest import ModeldHarness, stop_process

  class Offset(ModeldHarness):
    """Frames in start-of-frame order: with road frame n goes every wide frame up to n+1, which starts after it (waiting
    for it would run into modeld's receive timeout, the test not being real time)."""
    wide_ns = -20_000_000
    sent_wide = 0

    def _publish(self, svc: str, st, n: int, shift: int) -> None:
      ev = self.messaging.new_message(svc, valid=True)
      getattr(ev, svc).frameId, getattr(ev, svc).sensor = n, "ar0231"
      self.pm.send(svc, ev)
      sof = n * self.FRAME_NS + shift
      self.srv.send(st, self.frame, n, sof, sof + self.FRAME_NS)

    def send(self, n: int, road: bool = True, wide: bool = True) -> None:
      self._publish("roadCameraState", self.streams[0], n, 0)
      while self.sent_wide < n + 1:
        self.sent_wide += 1
        self._publish("wideRoadCameraState", self.streams[1], self.sent_wide, self.wide_ns)

  h = Offset(cpu_artifact_1928)
  deltas: dict[int, list[int]] = {-20_000_000: [], -30_000_000: []}
  try:
    n, m = 0, None
    while m is None and n < 400:  # modeld loads the artifact meanwhile; frames before it listens reach nobody
      n += 1
      m, _ = h.step(n, 0.25)
    assert m is not None, stop_process(h.proc)
    for offset, got in deltas.items():
      h.wide_ns = offset
      for _ in range(8):
        n += 1
        m, _ = h.step(n, 5.0)
        if m is not None:
          got.append(m.frameIdExtra - m.frameId)
  finally:
    out = h.close()
  assert "Traceback" not in out, out
  assert len(deltas[-20_000_000]) >= 6 and set(deltas[-20_000_000][1:]) == {0}, deltas
  # the first frame after the switch pairs across it; then every road frame takes the next wide one
  assert len(deltas[-30_000_000]) >= 5 and set(deltas[-30_000_000][2:]) == {1}, deltas
