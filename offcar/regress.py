"""Compare two replay output logs field by field, like openpilot's model_replay / process_replay compare_logs.

Messages are paired in log order and must be the same service. Every leaf field is compared: exactly by default (same
device and build must give identical bytes), or within a relative tolerance (|a-b| <= tol * max(|a|,|b|), the
dictdiffer rule openpilot uses) plus an optional absolute one. Ignored fields (default logMonoTime, frameDropPerc,
modelExecutionTime) match by name at any depth, or by dotted prefix (`modelV2.leadsV3`).

Both runs must be replays of one drive (DriveId): two drives differ in every field, which would read as a regression.
A mismatch is refused (UserError) unless asked for (allow_different_drives), and then recorded on the result.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from offcar import replay_store as store
from offcar.frame_map import SENSOR_SIZES
from offcar.log_compare import DEFAULT_IGNORE, CompareResult, as_array, compare_messages, merged_fields, read_messages
from offcar.replay_accuracy import SYNTH_BRANCH, SYNTH_VERSION, regress_html, regress_json, regress_lines, sidecar_path
from offcar.report import write_html
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import replacing, write_atomic
from selfdrive_glue.logs import LOG_SUFFIXES, LogReader


def _log_files(d: Path) -> dict[str, Path]:
  return {p.relative_to(d).as_posix(): p for p in sorted(d.rglob("*")) if p.is_file() and p.suffix in LOG_SUFFIXES + (".rlog", ".log")}


def pairs(new: Path, ref: Path) -> Iterator[tuple[str, Path | None, Path | None]]:
  """(name, new file, ref file): the two files, or each log in two output directories matched by relative path."""
  for p in (new, ref):
    if not p.exists():
      raise UserError(f"{p} not found; pass two replay output logs (or two output directories)")
  if new.is_dir() != ref.is_dir():
    raise UserError(f"cannot compare a directory with a file ({new} vs {ref})")
  if not new.is_dir():
    yield new.name, new, ref
    return
  fn, fr = _log_files(new), _log_files(ref)
  if not fn and not fr:
    raise UserError(f"no logs (.zst/.bz2) in {new} or {ref}")
  for k in sorted(set(fn) | set(fr)):
    yield k, fn.get(k), fr.get(k)


def regress(new: str | os.PathLike, ref: str | os.PathLike, tolerance: float = 0.0, abs_tolerance: float = 0.0,
            ignore: tuple[str, ...] = DEFAULT_IGNORE, allow_different_drives: bool = False
            ) -> tuple[list[CompareResult], dict[str, tuple[list, list]]]:
  """Compare; returns per-file results and the messages (for plotting) keyed by file name. NEW and REF replayed from
  different drives: UserError, or with allow_different_drives compared anyway and said in each result's different_drives."""
  if tolerance < 0 or abs_tolerance < 0:
    raise UserError("tolerances must be >= 0")
  results: list[CompareResult] = []
  messages: dict[str, tuple[list, list]] = {}
  listed = list(pairs(Path(new), Path(ref)))
  only_new, only_ref = [k for k, pn, pr in listed if pr is None], [k for k, pn, pr in listed if pn is None]
  disjoint = ""
  if only_new and only_ref and len(only_new) + len(only_ref) == len(listed):
    # replay names each output after its segment: two folders without a name in common hold replays of other segments
    disjoint = f"NEW and REF share no log (NEW: {_names(only_new)}; REF: {_names(only_ref)}), so they are replays of different segments"
    _refuse(disjoint, allow_different_drives)
  for name, pn, pr in listed:
    res = CompareResult(str(pn) if pn else f"(missing) {name}", str(pr) if pr else f"(missing) {name}", name=name)
    if disjoint and not results:  # said once, on the first result
      res.different_drives.append(disjoint)
    if pn is None or pr is None:
      res.structural.append(f"{name} is only in {'REF' if pn is None else 'NEW'}")
      results.append(res)
      continue
    mn, mr = read_messages(pn, res.damage), read_messages(pr, res.damage)
    res.drives = (drive_id(pn, mn), drive_id(pr, mr))
    why = drive_mismatch(*res.drives)
    if why:
      _refuse(f"{name}: NEW and REF are replays of different drives: {why}", allow_different_drives)
      res.different_drives.append(why)
    compare_messages(mn, mr, res, tolerance, abs_tolerance, ignore)
    results.append(res)
    messages[name] = (mn, mr)
  return results, messages


def _names(names: list[str], n: int = 3) -> str:
  return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _refuse(why: str, allowed: bool) -> None:
  if not allowed:
    raise UserError(f"{why}; compare two replays of one drive, or pass --allow-different-drives to compare them anyway")


# ---- which drive -------------------------------------------------------------------------------------------------------
@dataclass
class DriveId:
  """What a replay output records of the drive it came from. The log: each modelV2 frameId with its road camera frame's
  timestampEof, the camera's own clock (two real drives never share it; replay copies it from the camera state, so the
  model cannot change it). The accuracy sidecar replay writes beside it: the segment name, and for a synthetic drive the
  scene seed and camera, the one thing that tells two synthetic drives of one length apart (their frames and clocks match).
  replay --engine ray's sidecar: the segment's path."""
  log: str
  frames: dict[int, int]  # frameId -> timestampEof [ns]
  segment: str | None = None
  seed: int | None = None
  camera: str | None = None

  def describe(self) -> str:
    where = f"segment {self.segment}" if self.segment else self.log
    return where + (f" (synthetic drive, seed {self.seed}, {self.camera})" if self.seed is not None else "")


def drive_id(log: Path, msgs: list[tuple[str, dict]]) -> DriveId:
  frames = {int(f["modelV2.frameId"]): int(f.get("modelV2.timestampEof", 0)) for w, f in msgs if w == "modelV2" and "modelV2.frameId" in f}
  d = DriveId(str(log), frames)
  try:
    doc = json.loads(sidecar_path(log).read_text())
  except (OSError, ValueError):
    doc = None  # none (not synthetic), or unreadable: the accuracy lines say so
  if isinstance(doc, dict):
    d.segment = str(doc["segment"]) if isinstance(doc.get("segment"), str) else None
    truth = doc.get("truth")
    if isinstance(truth, dict) and isinstance(truth.get("seed"), int):
      d.seed, d.camera = truth["seed"], str(truth.get("camera"))
  meta = store.read_meta(log)
  if d.segment is None and meta and isinstance(meta.get("segment"), str):
    d.segment = Path(meta["segment"]).name
  return d


def _frames_mismatch(a: dict[int, int], b: dict[int, int], na: str, nb: str) -> str | None:
  """Two frameId -> timestampEof maps of one drive share frames, and their clocks agree. Only when no shared frame agrees
  is it another drive: one frame's time changed is a difference the field comparison reports."""
  if not a or not b:
    return None
  common = sorted(set(a) & set(b))
  if not common:
    return f"no camera frame in common ({na} frames {min(a)}-{max(a)}, {nb} frames {min(b)}-{max(b)})"
  if all(a[f] != b[f] for f in common):
    f = common[0]
    return f"camera frame {f} ended at {a[f]} ns in {na} but at {b[f]} ns in {nb}, and no other shared frame agrees"
  return None


def drive_mismatch(new: DriveId, ref: DriveId) -> str | None:
  """Why NEW and REF are not replays of one drive, or None. Segment names alone decide nothing (a copied segment is the
  same drive under another name); they are named in the message."""
  if new.seed is not None and ref.seed is not None and (new.seed, new.camera) != (ref.seed, ref.camera):
    return f"NEW is from {new.describe()}, REF from {ref.describe()}"
  why = _frames_mismatch(new.frames, ref.frames, "NEW", "REF")
  return f"NEW is from {new.describe()}, REF from {ref.describe()}: {why}" if why else None


def segment_drive(seg) -> DriveId | None:
  """What the segment says of its drive, like drive_id of an output: its road camera states' frameIds and timestampEof,
  and, where its initData says synth wrote it, the scene seed (dongleId) and camera (sensor). None without an rlog."""
  rlog = seg.log("rlog")
  if rlog is None:
    return None
  d = DriveId(str(seg.path), {}, seg.name)
  seed = sensor = None
  for i, ev in enumerate(LogReader(rlog)):
    which = ev.which()
    if i == 0 and which == "initData" and (str(ev.initData.version), str(ev.initData.gitBranch)) == (SYNTH_VERSION, SYNTH_BRANCH):
      try:
        seed = int(str(ev.initData.dongleId), 16)
      except ValueError:
        pass  # an edited synth log: the accuracy lines say so; the frames still decide
    elif which == "roadCameraState":
      st = ev.roadCameraState
      sensor = sensor or str(st.sensor)
      d.frames[int(st.frameId)] = int(st.timestampEof)
  if seed is not None and sensor in SENSOR_SIZES:
    d.seed, d.camera = seed, "{}x{}".format(*SENSOR_SIZES[sensor])
  return d


def segment_mismatch(seg, drive: DriveId) -> str | None:
  """Why segment `seg` is not the drive `drive` was replayed from, or None: its synthetic seed, or its road camera states'
  frameIds and timestampEof, against what the output records."""
  sd = segment_drive(seg)
  if sd is None:
    return None
  if sd.seed is not None and drive.seed is not None and (sd.seed, sd.camera) != (drive.seed, drive.camera):
    return f"it is synthetic drive seed {sd.seed}, {sd.camera}; {drive.log} is from {drive.describe()}"
  return _frames_mismatch(drive.frames, sd.frames, drive.log, "the segment")


def check_segments(results: list[CompareResult], seg_of: dict, given=(), allow_different_drives: bool = False) -> None:
  """Refuse (UserError) a segment that is not the drive of both runs of its log (report.find_segments' log name ->
  segment); with allow_different_drives the mismatch goes into the result's different_drives instead."""
  given_paths = {Path(s.path).resolve() for s in given}
  for res in results:
    seg = seg_of.get(res.name)
    if seg is None or not res.drives:
      continue
    for run, drive in zip(("NEW", "REF"), res.drives):
      why = segment_mismatch(seg, drive)
      if not why:
        continue
      origin = "--segment" if Path(seg.path).resolve() in given_paths else "the segment recorded beside the output,"
      msg = f"{origin} {seg.path} is not the drive {run} {drive.log} was replayed from: {why}"
      if not allow_different_drives:
        raise UserError(f"{msg}; pass that drive's segment, or --allow-different-drives to use this one anyway")
      res.different_drives.append(msg)


def summary_lines(results: list[CompareResult], n: int = 10) -> list[str]:
  lines = []
  for r in results:
    for s in r.structural:
      lines.append(f"STRUCTURE {Path(r.new).name}: {s}")
    for d in r.damage:
      lines.append(f"DAMAGED   {d}")
    for d in dict.fromkeys(r.different_drives):
      lines.append(f"WARNING   {r.name or Path(r.new).name}: different drives, compared anyway: {d}")
  bad = [f for f in merged_fields(results) if f.failed]
  if bad:
    lines.append(f"{len(bad)} field(s) differ; worst {min(n, len(bad))}:")
    lines.append(f"  {'field':<52} {'failed':>12} {'max |diff|':>12} {'max rel':>10}  first msg  new vs ref")
    for f in bad[:n]:
      ex = " vs ".join(_short(x) for x in f.example)
      lines.append(f"  {f.path:<52} {f.failed:>5}/{f.compared:<6} {f.max_abs:>12.4g} {f.max_rel:>10.3g}  {f.first_message!s:>9}  {ex}")
  return lines


def _short(v) -> str:
  s = json.dumps(v) if not isinstance(v, str) else v
  return s if len(s) <= 24 else s[:21] + "..."


# ---- report ------------------------------------------------------------------------------------------------------------
_PANELS = [  # (title, [(label, path, index)])
  ("plan x at 10 s [m]", [("x", "modelV2.position.x", -1)]),
  ("plan y at 10 s [m]", [("y", "modelV2.position.y", -1)]),
  ("desired curvature [1/m]", [("curv", "modelV2.action.desiredCurvature", 0)]),
  ("desired acceleration [m/s^2]", [("accel", "modelV2.action.desiredAcceleration", 0)]),
  ("lane lines y at 0 m [m]", [("left", "modelV2.laneLines[1].y", 0), ("right", "modelV2.laneLines[2].y", 0)]),
  ("lane line probs", [("left", "modelV2.laneLineProbs", 1), ("right", "modelV2.laneLineProbs", 2)]),
  ("lead distance [m]", [("x", "modelV2.leadsV3[0].x", 0)]),
  ("lead prob", [("p", "modelV2.leadsV3[0].prob", 0)]),
  # dmonitoringmodeld's, when the replay had the driver camera
  ("driver face pitch / yaw [rad]", [("pitch", "driverStateV2.leftDriverData.faceOrientation", 0),
                                     ("yaw", "driverStateV2.leftDriverData.faceOrientation", 1)]),
  ("driver face prob", [("p", "driverStateV2.leftDriverData.faceProb", 0)]),
]


def _series(msgs: list[tuple[str, dict]], path: str, idx: int) -> tuple[np.ndarray, np.ndarray]:
  t, v = [], []
  for which, flat in msgs:
    if which != path.split(".", 1)[0] or path not in flat:
      continue
    arr = as_array(flat[path])
    if arr is None or arr.size == 0:
      continue
    t.append(flat.get("logMonoTime", 0) / 1e9)
    v.append(float(arr[idx]))
  return np.asarray(t), np.asarray(v)


def write_report(report_dir: str | os.PathLike, results: list[CompareResult], messages: dict, tolerance: float, ignore, abs_tolerance: float = 0.0,
                 new: str | os.PathLike = "", ref: str | os.PathLike = "", gate: str | None = None, segments=(), accuracy=()) -> list[Path]:
  """report.txt, report.json, one PNG per compared log (plan, lane lines, lead of both runs over time) and report.html
  (offcar.report: pass/fail per field, difference distributions, the worst frames drawn on the camera image).
  accuracy: replay_accuracy.regress_accuracy's rows (ground truth of synthetic segments), reported beside the comparison."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out = Path(report_dir)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  series_pngs: dict[str, Path] = {}
  txt = summary_lines(results, 30)
  verdict = "REGRESSION" if any(r.regression for r in results) else "PASS"
  txt += regress_lines(list(accuracy))
  write_atomic(out / "report.txt", "\n".join([f"{verdict} (tolerance {tolerance}, ignoring {', '.join(ignore)})", *txt]) + "\n")
  data = [{"new": r.new, "ref": r.ref, "regression": r.regression, "messages_new": r.messages_new, "messages_ref": r.messages_ref,
           "structural": r.structural, "damage": r.damage,
           "different_drives": r.different_drives, "worst": [asdict(f) for f in r.worst(30)]} for r in results]
  write_atomic(out / "report.json", json.dumps({"verdict": verdict, "tolerance": tolerance, "ignore": list(ignore), "files": data,
                                               "accuracy": regress_json(list(accuracy))}, indent=1))
  written += [out / "report.txt", out / "report.json"]
  for name, (mn, mr) in messages.items():
    # the driver-monitoring panels only when the replay has driverStateV2 (a third row)
    panels = [p for p in _PANELS if not p[1][0][1].startswith("driverStateV2") or any(w == "driverStateV2" for w, _ in mn + mr)]
    rows = -(-len(panels) // 4)
    fig, axes = plt.subplots(rows, 4, figsize=(18, 3.75 * rows), sharex=True, squeeze=False)
    for ax in axes.ravel()[len(panels):]:
      ax.set_visible(False)
    for ax, (title, series) in zip(axes.ravel(), panels):
      for label, path, idx in series:
        for msgs, run, style in ((mr, "REF", "-"), (mn, "NEW", "--")):
          t, v = _series(msgs, path, idx)
          if len(t):
            ax.plot(t - t[0], v, style, lw=1.2, label=f"{run} {label}" if len(series) > 1 else run)
      ax.set_title(title, fontsize=10)
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
    for ax in axes[-1]:
      ax.set_xlabel("time [s]")
    fig.suptitle(f"{name}: NEW vs REF ({verdict if any(r.regression for r in results if Path(r.new).name == Path(name).name) else 'match'})")
    fig.tight_layout()
    png = out / (name.replace("/", "__").rsplit(".", 1)[0] + ".png")
    with replacing(png, ".png") as tmp:
      fig.savefig(tmp, dpi=80)
    plt.close(fig)
    written.append(png)
    series_pngs[name] = png
  written += write_html(out, Path(new), Path(ref), results, messages, tolerance, abs_tolerance, tuple(ignore), gate, list(segments), series_pngs,
                        regress_html(list(accuracy)))
  return written


