"""Accuracy against ground truth for outputs of synthetic drives: `replay` writes it beside each output, `regress` reports
it for both runs, `demo` for its live drive.

Which segments: only those whose initData says `synth` wrote them (version "modeld-msm synth", gitBranch "synth"); the
scene is then RoadScene(seed, camera) with the seed in initData.dongleId and the camera from the sensor. Real segments
and old-shaped synthetic ones (written without initData) get no accuracy: nothing is guessed for them.

Time: synth renders camera state i of segment k at scene time start_s + i / FPS (start_s = k * seconds into the drive) and
logs that state's start of frame at BOOT_NS + the same time. So an output's scene time is read from the log's road
camera state with the output's frameId, and deliberately not from the video frame replay paired with that state: if the
pairing showed the model another picture, the error grows here instead of the mistake being assumed away.

The truth is what modeld's outputs are held to (selfdrive_glue/road_truth.py): lane lines at 20 m, and desiredCurvature
against the curvature of the ego path at the lateral action time modeld used (liveDelay.lateralDelay + the action
offsets of modeld_msm/actions.py, from the latest liveDelay before each frame, as the core takes it).
"""
from __future__ import annotations

import functools
import html
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from modeld_msm.actions import action_times
from modeld_msm.core import DEFAULT_LAT_DELAY
from offcar.accuracy import CURVATURE_CORR_LIMIT, LANE_ERROR_DISTANCE, LANE_ERROR_LIMIT_M, lane_errors, passes, summarize
from offcar.frame_map import SENSOR_SIZES
from offcar.report import find_segments
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import sha256_file, write_atomic
from selfdrive_glue.logs import LogReader
from selfdrive_glue.road_render import RoadScene
from selfdrive_glue.road_truth import truth
from selfdrive_glue.route import Segment
from selfdrive_glue.synth import BOOT_NS

SIDECAR_SUFFIX = ".accuracy.json"  # <output log>.accuracy.json: beside replay_store's <output log>.json, never confused with it
SIDECAR_VERSION = 1
SUMMARY_KEYS = ("frames", "lane_error_m_p50", "lane_error_m_p90", "curvature_corr", "curvature_mae", "skipped_frames", "passes")
SYNTH_VERSION, SYNTH_BRANCH = "modeld-msm synth", "synth"  # what selfdrive_glue/synth.py writes into initData (a test pins it)


@dataclass(frozen=True)
class TruthSource:
  """Where the truth of one output comes from: the synthetic scene, and each road frameId's scene time."""
  seed: int
  camera: str
  frames: dict[int, tuple[float, float]]  # road camera frameId -> (scene time s, lateral action time s)

  def describe(self) -> str:
    return f"synthetic drive, seed {self.seed}, {self.camera}"

  def to_json(self) -> dict:
    fids = sorted(self.frames)
    return {"source": "synth", "seed": self.seed, "camera": self.camera, "frame_id": fids,
            "scene_t": [self.frames[f][0] for f in fids], "lat_action_t": [self.frames[f][1] for f in fids]}

  @classmethod
  def from_json(cls, d: Any) -> TruthSource:
    try:
      if d["source"] != "synth":
        raise ValueError(f"unknown truth source {d['source']!r}")
      frames = {int(f): (float(t), float(a)) for f, t, a in zip(d["frame_id"], d["scene_t"], d["lat_action_t"], strict=True)}
      return cls(int(d["seed"]), str(d["camera"]), frames)
    except (KeyError, TypeError, ValueError) as e:
      raise UserError(f"unreadable ground-truth record ({e}); replay the segment again to rewrite it") from None


def lat_action_t(lateral_delay: float) -> float:
  """The time after a frame modeld's desiredCurvature aims at, for a liveDelay.lateralDelay."""
  return action_times(0.0, lateral_delay)[1]


def synthetic_source(events: Iterable[Any], where: str = "segment") -> TruthSource | None:
  """The truth source of a segment's events (in log order), or None unless the first event is an initData saying synth
  wrote it."""
  seed = sensor = rpy = None
  lat = lat_action_t(DEFAULT_LAT_DELAY)  # what the core uses until the first liveDelay arrives
  frames: dict[int, tuple[float, float]] = {}
  for i, ev in enumerate(events):
    which = ev.which()
    if i == 0 and which != "initData":
      return None  # synth (like a device) logs initData first; stopping here keeps real segments at scale cheap
    if which == "initData":
      d = ev.initData
      if str(d.version) != SYNTH_VERSION or str(d.gitBranch) != SYNTH_BRANCH:
        return None
      try:
        seed = int(str(d.dongleId), 16)
      except ValueError:
        raise UserError(f"{where}: initData says synth wrote it but its dongleId {str(d.dongleId)!r} is not the scene seed in hex; "
                        "the log was edited or is not synth's") from None
    elif which == "liveDelay":
      lat = lat_action_t(float(ev.liveDelay.lateralDelay))
    elif which == "liveCalibration" and rpy is None:
      rpy = list(ev.liveCalibration.rpyCalib)
    elif which == "roadCameraState":
      st = ev.roadCameraState
      sensor = sensor or str(st.sensor)
      frames[int(st.frameId)] = ((int(st.timestampSof) - BOOT_NS) / 1e9, lat)
  if seed is None:
    return None  # no initData: a real segment, or synth's old shape; never guessed
  if sensor not in SENSOR_SIZES:
    raise UserError(f"{where}: initData says synth wrote it but its road camera sensor is {sensor!r}, not one of "
                    f"{', '.join(sorted(SENSOR_SIZES))}")
  w, h = SENSOR_SIZES[sensor]
  source = TruthSource(seed, f"{w}x{h}", frames)
  # synth logs the scene's own camera rotation: a seed that does not reproduce it (edited, or masked to 64 bits by the
  # dongleId) would hold the outputs to another road
  if rpy is not None and not np.allclose(rpy, _scene(seed, source.camera).calib_rpy, atol=1e-6):
    raise UserError(f"{where}: initData names scene seed {seed}, but that scene's calibration {list(_scene(seed, source.camera).calib_rpy)} "
                    f"is not the logged {rpy}; the log is not synth's drive {seed}, so there is no ground truth for it")
  return source


def segment_source(seg: Segment) -> TruthSource | None:
  rlog = seg.log("rlog")
  if rlog is None:
    return None
  return synthetic_source(LogReader(rlog), str(rlog))


@functools.lru_cache(maxsize=8)
def _scene(seed: int, camera: str):
  return RoadScene(seed, camera)


@functools.lru_cache(maxsize=8192)  # regress asks for the same frames for NEW and REF; truth() is ~8 ms
def truth_at(seed: int, camera: str, t: float, lat_t: float):
  return truth(_scene(seed, camera), t, lat_t)


# one model output: (frameId, lane line y (4, 33) on X_IDXS, action.desiredCurvature)
Output = tuple[int, np.ndarray, float]


@dataclass
class Evaluation:
  summary: dict[str, Any]  # accuracy.summarize's keys + skipped_frames, passes
  truths: dict[int, Any] = field(default_factory=dict)  # frameId -> road_truth.Truth, for plots


def evaluate(source: TruthSource, outputs: Iterable[Output], where: str = "output") -> Evaluation:
  """Accuracy of `outputs` against the scene. Outputs with non-finite lane lines or curvature (published valid=False) are
  left out of the statistics and counted in skipped_frames; an output whose frameId the segment does not have means the
  output is not a replay of this segment: UserError."""
  errors: list[np.ndarray] = []
  cp: list[float] = []
  ct: list[float] = []
  ev = Evaluation({})
  skipped = 0
  unknown: list[int] = []
  for fid, lane_y, curv in outputs:
    if fid not in source.frames:
      unknown.append(fid)
      continue
    t, lat_t = source.frames[fid]
    tr = ev.truths[fid] = truth_at(source.seed, source.camera, t, lat_t)
    lane_y = np.asarray(lane_y, np.float64)
    if lane_y.shape != (4, 33) or not np.isfinite(lane_y).all() or not math.isfinite(curv):
      skipped += 1
      continue
    errors.append(lane_errors(lane_y, tr))
    cp.append(float(curv))
    ct.append(tr.desired_curvature)
  if unknown:
    raise UserError(f"{where}: {len(unknown)} output(s) name camera frames the segment does not have (first frameId {unknown[0]}); "
                    f"the output is not a replay of this segment ({source.describe()})")
  ev.summary = {**summarize(errors, cp, ct), "skipped_frames": skipped}
  ev.summary["passes"] = passes(ev.summary)
  return ev


def lane_lines_y(lines: Any) -> np.ndarray:
  """modelV2.laneLines -> (4, 33) y on X_IDXS; an empty array when the message does not have that shape (evaluate skips it)."""
  if len(lines) != 4 or any(len(ll.y) != 33 for ll in lines):
    return np.full((0,), np.nan)
  return np.array([list(ll.y) for ll in lines], np.float64)


def outputs_from_log(path: Path) -> list[Output]:
  return [(int(ev.modelV2.frameId), lane_lines_y(ev.modelV2.laneLines), float(ev.modelV2.action.desiredCurvature))
          for ev in LogReader(path) if ev.which() == "modelV2"]


def outputs_from_messages(msgs: list[tuple[str, dict]]) -> list[Output]:
  """regress's flattened messages -> outputs."""
  out = []
  for which, f in msgs:
    if which != "modelV2":
      continue
    lanes = [f.get(f"modelV2.laneLines[{i}].y") for i in range(4)]
    lane_y = np.array(lanes, np.float64) if all(isinstance(x, np.ndarray) and x.shape == (33,) for x in lanes) else np.full((0,), np.nan)
    out.append((int(f.get("modelV2.frameId", -1)), lane_y, float(f.get("modelV2.action.desiredCurvature", math.nan))))
  return out


def json_number(v: Any) -> Any:
  """JSON has no NaN: a statistic that does not exist (too few frames, a constant curvature) is written as null."""
  return None if isinstance(v, float) and not math.isfinite(v) else v


def sidecar_path(out: Path) -> Path:
  return out.with_name(out.name + SIDECAR_SUFFIX)


# ---- replay ------------------------------------------------------------------------------------------------------------
def write_replay_accuracy(seg: Segment, out: Path) -> dict | None:
  """Write <out>.accuracy.json for the replay output `out` of `seg`: per-segment accuracy, and the truth source (seed,
  camera, each frame's scene time) `regress` recomputes it from. None, and any old file removed, when `seg` is not
  synthetic: a stale record must not describe a new output."""
  side = sidecar_path(Path(out))
  source = segment_source(seg)
  if source is None:
    side.unlink(missing_ok=True)
    return None
  ev = evaluate(source, outputs_from_log(Path(out)), str(out))
  doc = {"v": SIDECAR_VERSION, "segment": seg.name, "output": Path(out).name, "output_sha256": sha256_file(Path(out)),
         **{k: json_number(v) for k, v in ev.summary.items()},
         "limits": {"lane_error_m_p50": LANE_ERROR_LIMIT_M, "curvature_corr": CURVATURE_CORR_LIMIT, "lane_error_distance_m": LANE_ERROR_DISTANCE},
         "truth": source.to_json()}
  write_atomic(side, json.dumps(doc, indent=1))
  return doc


def describe(s: dict) -> str:
  """One line of accuracy numbers (from a summary or a sidecar, where missing statistics are None)."""
  def f(k: str, fmt: str) -> str:
    v = s.get(k)
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)
  skipped = f", {s['skipped_frames']} non-finite skipped" if s.get("skipped_frames") else ""
  verdict = "meets" if s.get("passes") else "misses"
  return (f"lane error at 20 m p50 {f('lane_error_m_p50', '.3f')} m, p90 {f('lane_error_m_p90', '.3f')} m; curvature r "
          f"{f('curvature_corr', '.3f')}, MAE {f('curvature_mae', '.2e')} 1/m; {s.get('frames', 0)} frames{skipped} ({verdict} the limits)")


def replay_accuracy_lines(results: list, segments: list[Segment]) -> Iterator[tuple[bool, str]]:
  """For `replay`: write the sidecar of each successful output; yields (is_warning, line)."""
  by_name = {s.name: s for s in segments}
  for r in results:
    seg = by_name.get(r.segment)
    if r.error or seg is None:
      continue
    try:
      doc = write_replay_accuracy(seg, Path(r.out))
    except UserError as e:
      yield True, f"{r.segment}: no ground-truth accuracy: {e}"
      continue
    if doc is not None:
      truth = doc["truth"]
      yield False, f"{r.segment}: ground truth (synthetic, seed {truth['seed']}): {describe(doc)} -> {sidecar_path(Path(r.out))}"


# ---- regress -----------------------------------------------------------------------------------------------------------
@dataclass
class RunAccuracy:
  log: str
  new: dict | None = None  # summaries; None when that run could not be evaluated (see note)
  ref: dict | None = None
  new_source: str = ""  # the truth each run was held to: its own sidecar's, else where it was borrowed from
  ref_source: str = ""
  notes: list[str] = field(default_factory=list)


def _read_sidecar(log: Path) -> tuple[TruthSource | None, dict | None]:
  """(truth source, the recorded summary if the log is still the one it was computed from) of a replay output."""
  side = sidecar_path(log)
  if not side.is_file():
    return None, None
  try:
    doc = json.loads(side.read_text())
  except (OSError, ValueError) as e:
    raise UserError(f"{side}: unreadable ({e}); replay the segment again to rewrite it") from None
  source = TruthSource.from_json(doc.get("truth") if isinstance(doc, dict) else None)
  # the summary holds only for the bytes it was computed from; a log replaced since is evaluated again
  fresh = log.is_file() and doc.get("output_sha256") == sha256_file(log) and all(k in doc for k in SUMMARY_KEYS)
  return source, {k: doc[k] for k in SUMMARY_KEYS} if fresh else None


def regress_accuracy(messages: dict[str, tuple[list, list]], new: Path, ref: Path, segments: list[Segment] | None = None) -> list[RunAccuracy]:
  """Ground-truth accuracy of both runs of every compared log whose segment is synthetic. The truth comes from each
  log's replay sidecar, else the other run's, else the segment (`--segment`, or the one `replay --engine ray` recorded)."""
  seg_of = find_segments(sorted(messages), list(segments or []), new, ref)
  rows = []
  for name, (mn, mr) in sorted(messages.items()):
    row = RunAccuracy(name)
    logs = {"NEW": new / name if new.is_dir() else new, "REF": ref / name if ref.is_dir() else ref}
    sources: dict[str, TruthSource | None] = {}
    recorded: dict[str, dict | None] = {}
    for run, log in logs.items():
      try:
        sources[run], recorded[run] = _read_sidecar(log)
      except UserError as e:
        row.notes.append(f"{run}: {e}")
        sources[run] = recorded[run] = None
    fallback, origin = (sources["NEW"], "NEW's record") if sources["NEW"] else (sources["REF"], "REF's record")
    if fallback is None and name in seg_of:
      origin = f"segment {seg_of[name].name}"
      try:
        fallback = segment_source(seg_of[name])
      except UserError as e:
        row.notes.append(str(e))
    if fallback is None:
      if row.notes:
        rows.append(row)
      continue  # not synthetic (or not known to be): no accuracy, and no line
    for run, msgs in (("NEW", mn), ("REF", mr)):
      # each run is labelled with the truth it was held to: the two runs may come from different drives
      source = sources[run] or fallback
      setattr(row, f"{run.lower()}_source", source.describe() + ("" if sources[run] else f" (from {origin})"))
      if recorded[run] is not None:  # replay computed it for these very bytes: ~8 ms a frame saved per run
        setattr(row, run.lower(), recorded[run])
        continue
      try:
        s = evaluate(source, outputs_from_messages(msgs), f"{run} {logs[run]}").summary
      except UserError as e:
        row.notes.append(str(e))
        continue
      setattr(row, run.lower(), s)
    rows.append(row)
  return rows


def regress_lines(rows: list[RunAccuracy]) -> list[str]:
  lines = []
  for r in rows:
    for run in ("NEW", "REF"):
      s = getattr(r, run.lower())
      if s is not None:
        lines.append(f"ACCURACY  {r.log} {run}: {describe(s)}  [{getattr(r, run.lower() + '_source')}]")
    for n in r.notes:
      lines.append(f"ACCURACY  {r.log}: {n}")
  return lines


def regress_json(rows: list[RunAccuracy]) -> list[dict]:
  return [{"log": r.log, "source": {"new": r.new_source, "ref": r.ref_source}, "notes": r.notes,
           **{run: None if s is None else {k: json_number(v) for k, v in s.items()} for run, s in (("new", r.new), ("ref", r.ref))}} for r in rows]


def regress_html(rows: list[RunAccuracy]) -> str:
  """A small table for report.html ('' when no log has ground truth)."""
  if not rows:
    return ""

  def cell(s: dict | None, k: str, fmt: str) -> str:
    v = None if s is None else s.get(k)
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)
  body = []
  for r in rows:
    for run in ("NEW", "REF"):
      s, source = getattr(r, run.lower()), getattr(r, run.lower() + "_source")
      # "meets"/"misses", not PASS/FAIL: whether NEW matches REF is the verdict above; this is each run against the road
      status, colour = ("n/a", "#888") if s is None else (("meets", "#2e7d32") if s["passes"] else ("misses", "#c62828"))
      body.append(f'<tr><td style="background: {colour}; color: white">{status}</td><td>{html.escape(r.log)} {run}</td>'
                  f"<td>{cell(s, 'lane_error_m_p50', '.3f')}</td><td>{cell(s, 'lane_error_m_p90', '.3f')}</td>"
                  f"<td>{cell(s, 'curvature_corr', '.3f')}</td><td>{cell(s, 'frames', 'd')}</td><td>{html.escape(source)}</td></tr>")
  notes = "".join(f"<li>{html.escape(r.log)}: {html.escape(n)}</li>" for r in rows for n in r.notes)
  return (f"<h2>Ground truth</h2><p>Synthetic segments: each run's outputs against the road the renderer drew. Limits: lane error "
          f"at 20 m p50 &le; {LANE_ERROR_LIMIT_M} m, curvature r &ge; {CURVATURE_CORR_LIMIT}.</p>"
          "<table><tr><th>limits</th><th>log</th><th>lane error p50 [m]</th><th>p90 [m]</th><th>curvature r</th><th>frames</th><th>truth</th></tr>"
          + "".join(body) + "</table>" + (f"<ul>{notes}</ul>" if notes else ""))
