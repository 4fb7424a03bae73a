"""`regress --report DIR`: an HTML page (report.html, its PNGs beside it) for a comparison of replay outputs.

- pass/fail per field against the stated tolerance rule, worst first;
- the distribution of |NEW - REF| for the fields that differ most, values outside the tolerance in red;
- the worst frames: the road camera image of that frameId, with the lane lines, road edges and planned path of both
  runs projected onto it (REF solid, NEW dashed), so a reviewer sees what a difference means on the road;
- the existing plan/lane/lead time series of each log.

Frames come from the segment the outputs were replayed from: `regress --segment DIR` (a segment or route folder, matched
to logs by segment name), else the `segment` that `replay --engine ray` recorded in each output's sidecar. Without one,
the predictions are drawn on a blank canvas and the page says so.

Tolerances are anchored on openpilot's model_replay (selfdrive/test/process_replay/model_replay.py and compare_logs.py):
a value fails when |a - b| > max(tol, tol * max(|a|, |b|)). On the device tol is the float epsilon (bit-exact in
practice); on a PC tol is 0.3 and the trajectory-like outputs (position, acceleration.x, path coefficients, leads, lane
lines, road edges) are not compared, because a different CPU/GPU moves them by more than any useful tolerance.
"""
from __future__ import annotations

import html
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from offcar import replay_store as store
from offcar.frame_map import plan_segment
from offcar.log_compare import CompareResult, FieldDiff, as_array, field_name, ignored, merged_fields, numeric_diff
from selfdrive_glue.camera import DEVICE_CAMERAS, CameraConfig, device_camera_config, rot_from_euler, view_frame_from_device_frame
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import replacing, write_atomic
from selfdrive_glue.logs import LOG_SUFFIXES
from selfdrive_glue.route import Segment
from selfdrive_glue.video import _container_format

# name -> (relative tolerance, absolute tolerance, fields not compared); openpilot's rule is both with the same value
_PC_IGNORE = ("modelV2.acceleration.x", "modelV2.position.x", "modelV2.position.xStd", "modelV2.position.y", "modelV2.position.yStd",
              "modelV2.position.z", "modelV2.position.zStd", "drivingModelData.path.xCoefficients",
              *(f"modelV2.leadsV3.{f}" for f in ("x", "y", "v", "a", "xStd", "yStd", "vStd", "aStd")),
              *(f"modelV2.laneLines.{f}" for f in "xyzt"), *(f"modelV2.roadEdges.{f}" for f in "xyzt"))
GATES: dict[str, tuple[float, float, tuple[str, ...]]] = {
  "openpilot-device": (sys.float_info.epsilon, sys.float_info.epsilon, ()),
  "openpilot-pc": (0.3, 0.3, _PC_IGNORE),
}
CAMERA_HEIGHT = 1.22  # m: openpilot's UI draws the planned path this far below the camera (lane lines are at their own z)
N_FIELDS = 12  # distributions plotted
N_FRAMES = 4  # worst frames drawn


@dataclass
class FieldValues:
  diffs: list[np.ndarray]
  bad: list[np.ndarray]


def _pairs(mn: list, mr: list, ign: set[str], tol: float, abs_tol: float) -> Iterator[tuple[int, str, str, np.ndarray, np.ndarray]]:
  """(message index, service, field name as compare_messages names it, |diff|, outside tolerance) for numeric leaves."""
  for i, ((wn, fn), (wr, fr)) in enumerate(zip(mn, mr)):
    if wn != wr:
      return
    for path in sorted(set(fn) & set(fr)):
      if ignored(path, ign):
        continue
      aa, bb = as_array(fn[path]), as_array(fr[path])
      if aa is None or bb is None or aa.shape != bb.shape or aa.size == 0:
        continue
      diff, bad = numeric_diff(aa, bb, tol, abs_tol)
      yield i, wn, field_name(path, wn), diff, bad


def find_segments(names: list[str], given: list[Segment], new: Path, ref: Path) -> dict[str, Segment]:
  """Log name -> the segment it was replayed from: --segment by name (or the only one for a single log), else the sidecar."""
  out: dict[str, Segment] = {}
  by_name = {s.name: s for s in given}
  for name in names:
    stem = name.rsplit("/", 1)[-1]
    for suf in (*LOG_SUFFIXES, ".rlog", ".log"):
      stem = stem.removesuffix(suf)
    if stem in by_name:
      out[name] = by_name[stem]
    elif len(given) == 1 and len(names) == 1:
      out[name] = given[0]
    else:
      for root in (new, ref):
        doc = store.read_meta(root / name if root.is_dir() else root)
        if doc and Path(str(doc.get("segment", ""))).is_dir():
          out[name] = Segment(Path(doc["segment"]))
          break
  return out


def _save(fig, path: Path) -> None:
  with replacing(path, ".png") as tmp:
    fig.savefig(tmp, dpi=80)


def _distributions(plt, values: dict[str, FieldValues], fields: list[FieldDiff], out: Path) -> Path | None:
  shown = [f for f in fields if f.path in values and (f.failed or f.max_abs > 0)][:N_FIELDS]
  if not shown:
    return None
  cols = 3
  rows = (len(shown) + cols - 1) // cols
  fig, axes = plt.subplots(rows, cols, figsize=(15, 3.0 * rows), squeeze=False)
  for ax in axes.ravel()[len(shown):]:
    ax.axis("off")
  for ax, f in zip(axes.ravel(), shown):
    d, b = np.concatenate(values[f.path].diffs), np.concatenate(values[f.path].bad)
    finite = np.isfinite(d)
    nz = d[finite & (d > 0)]
    lo, hi = (np.log10(nz.min()), np.log10(nz.max())) if nz.size else (-12.0, 0.0)
    bins = np.logspace(lo - 0.1, hi + 0.1 if hi > lo else lo + 0.2, 30)
    ok_vals, bad_vals = d[finite & (d > 0) & ~b], d[finite & (d > 0) & b]
    ax.hist([ok_vals, bad_vals], bins=bins, stacked=True, color=["#4c8c4a", "#c0392b"], label=["within tolerance", "outside"])
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(plt.NullFormatter())  # minor labels of a narrow log range overprint each other
    zeros = int((d == 0).sum())
    ax.set_title(f"{f.path}\n{d.size} values, {zeros} equal, {int(b.sum())} outside", fontsize=8)
    ax.set_xlabel("|NEW - REF|", fontsize=8)
    ax.tick_params(labelsize=7)
  axes.ravel()[0].legend(fontsize=7)
  fig.tight_layout()
  path = out / "distributions.png"
  _save(fig, path)
  plt.close(fig)
  return path


def _camera_frames(seg: Segment, frame_ids: set[int]) -> tuple[dict[int, tuple[int, np.ndarray]], dict]:
  """frameId -> (video frame index, RGB image) of the road camera, through the segment's encode index (as replay paired
  them); plus the geometry to project onto it."""
  import av

  plan = plan_segment(seg)
  want = {}
  for pos, vidx in plan.road.frame_of.items():
    fid = int(plan.events[pos].roadCameraState.frameId)
    if fid in frame_ids:
      want[vidx] = fid
  geom = {"size": plan.size, "rpy": [0.0, 0.0, 0.0], "sensor": str(plan.events[plan.road_steps[0]].roadCameraState.sensor), "device": "unknown"}
  for ev in plan.events:
    w = ev.which()
    if w == "liveCalibration" and len(ev.liveCalibration.rpyCalib) == 3:
      geom["rpy"] = list(ev.liveCalibration.rpyCalib)
      break
  ds = next((ev for ev in plan.events if ev.which() == "deviceState"), None)
  if ds is not None:
    geom["device"] = str(ds.deviceState.deviceType)
  images: dict[int, tuple[int, np.ndarray]] = {}
  if want:
    with av.open(str(plan.road.path), format=_container_format(plan.road.path)[0]) as c:
      for k, frame in enumerate(c.decode(video=0)):
        if k in want:
          images[want[k]] = (k, frame.to_ndarray(format="rgb24"))
        if k >= max(want):
          break
  return images, geom


def _projector(geom: dict):
  fcam: CameraConfig | None
  try:
    fcam = device_camera_config(geom["device"], geom["sensor"]).fcam
  except UserError:
    fcam = next((d.fcam for d in DEVICE_CAMERAS.values() if d.fcam.size == tuple(geom["size"])), None)
  if fcam is None:
    return None
  m = fcam.intrinsics @ view_frame_from_device_frame @ rot_from_euler(geom["rpy"])

  def project(x, y, z):
    p = m @ np.stack([np.asarray(x, float), np.asarray(y, float), np.asarray(z, float)])
    keep = (np.asarray(x, float) > 1.0) & (p[2] > 1e-6)
    return p[0, keep] / p[2, keep], p[1, keep] / p[2, keep]
  return project


def _lines(flat: dict) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
  """(kind, x, y, z) of what the UI draws: lane lines, road edges, the planned path (at the road, camera height below)."""
  out = []
  for kind, key, n, dz in (("lane", "modelV2.laneLines", 4, 0.0), ("edge", "modelV2.roadEdges", 2, 0.0)):
    for k in range(n):
      xs, ys, zs = (flat.get(f"{key}[{k}].{c}") for c in "xyz")
      if isinstance(xs, np.ndarray) and isinstance(ys, np.ndarray) and isinstance(zs, np.ndarray) and xs.size:
        out.append((kind, xs, ys, zs + dz))
  xs, ys, zs = (flat.get(f"modelV2.position.{c}") for c in "xyz")
  if isinstance(xs, np.ndarray) and isinstance(ys, np.ndarray) and isinstance(zs, np.ndarray) and xs.size:
    out.append(("path", xs, ys, zs + CAMERA_HEIGHT))
  return out


def _draw_frame(plt, image: np.ndarray | None, geom: dict | None, new: dict, ref: dict, title: str, path: Path) -> None:
  colors = {"lane": "#ffd400", "edge": "#ff5050", "path": "#3cb4ff"}
  w, h = geom["size"] if geom else (1928, 1208)
  fig, ax = plt.subplots(figsize=(10, 10 * h / w))
  ax.imshow(image if image is not None else np.full((h, w, 3), 40, np.uint8))
  project = _projector(geom) if geom else None
  if project is not None:
    for flat, style, run in ((ref, "-", "REF"), (new, "--", "NEW")):
      for kind, x, y, z in _lines(flat):
        u, v = project(x, y, z)
        ax.plot(u, v, style, color=colors[kind], lw=2.2 if run == "REF" else 1.6, label=f"{run} {kind}")
  handles, labels = ax.get_legend_handles_labels()
  uniq = dict(zip(labels, handles))
  if uniq:
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="lower right", ncol=2)
  ax.set_xlim(0, w)
  ax.set_ylim(h, 0)
  ax.set_axis_off()
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  _save(fig, path)
  plt.close(fig)


def write_html(report_dir: Path, new: Path, ref: Path, results: list[CompareResult], messages: dict, tolerance: float, abs_tolerance: float,
               ignore: tuple[str, ...], gate: str | None, segments: list[Segment], series_pngs: dict[str, Path],
               accuracy_html: str = "") -> list[Path]:
  """report.html plus distributions.png and frame_<k>.png; every file written atomically. -> the files written.
  accuracy_html: the ground-truth table of synthetic segments (offcar.replay_accuracy.regress_html), before the worst frames."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ign = set(ignore)
  fields = merged_fields(results)
  values: dict[str, FieldValues] = {}
  scores: list[tuple[int, float, str, int]] = []  # (values outside, sum |diff|, log name, frameId)
  for name, (mn, mr) in messages.items():
    per_frame: dict[int, list[float]] = {}
    for i, which, fname, diff, bad in _pairs(mn, mr, ign, tolerance, abs_tolerance):
      fv = values.setdefault(fname, FieldValues([], []))
      fv.diffs.append(diff)
      fv.bad.append(bad)
      fid = mr[i][1].get(f"{which}.frameId")
      if fid is not None and (bad.any() or diff.any()):
        s = per_frame.setdefault(int(fid), [0, 0.0])
        s[0] += int(bad.sum())
        s[1] += float(np.nan_to_num(diff, posinf=1e300).sum())
    scores += [(int(s[0]), s[1], name, fid) for fid, s in per_frame.items() if s[0]]
  scores.sort(key=lambda s: (-s[0], -s[1], s[2], s[3]))
  worst = scores[:N_FRAMES]

  written: list[Path] = []
  dist = _distributions(plt, values, fields, report_dir)
  if dist is not None:
    written.append(dist)
  seg_of = find_segments(sorted(messages), segments, new, ref)
  frames_html = []
  notes = []
  by_log: dict[str, set[int]] = {}
  for _, _, name, fid in worst:
    by_log.setdefault(name, set()).add(fid)
  cams: dict[str, tuple[dict[int, tuple[int, np.ndarray]], dict | None]] = {}
  for name, fids in by_log.items():
    seg = seg_of.get(name)
    if seg is None:
      notes.append(f"{name}: no segment known, predictions drawn without the camera image (pass --segment DIR)")
      cams[name] = ({}, None)
      continue
    try:
      cams[name] = _camera_frames(seg, fids)
    except UserError as e:
      notes.append(f"{name}: camera frames of {seg.path} unavailable: {e}")
      cams[name] = ({}, None)
  for k, (nbad, _, name, fid) in enumerate(worst):
    mn, mr = messages[name]
    pick = [j for j, (w, f) in enumerate(mr) if w == "modelV2" and f.get("modelV2.frameId") == fid]
    if not pick:
      continue
    j = pick[0]
    images, geom = cams[name]
    vidx, image = images.get(fid, (None, None))
    png = report_dir / f"frame_{k}.png"
    title = f"{name}: frame {fid}, {nbad} value(s) outside tolerance" + ("" if image is not None else " (no camera image)")
    _draw_frame(plt, image, geom, mn[j][1], mr[j][1], title, png)
    written.append(png)
    cam = f"road camera: video frame {vidx} of {seg_of[name].path / 'fcamera.hevc'}" if image is not None else "no camera image"
    frames_html.append(f'<figure><img src="{png.name}" alt="{html.escape(title)}"><figcaption>{html.escape(title)}; '
                       f'{html.escape(cam)}</figcaption></figure>')

  verdict = "REGRESSION" if any(r.regression for r in results) else "PASS"
  rule = (f"a value fails when |NEW - REF| &gt; max({abs_tolerance:g}, {tolerance:g} &middot; max(|NEW|, |REF|))"
          + (" (exact: any difference fails)" if tolerance == 0 and abs_tolerance == 0 else ""))
  anchor = {"openpilot-device": "openpilot's model_replay on the device: tolerance = float epsilon, nothing but timings ignored",
            "openpilot-pc": "openpilot's model_replay on a PC: tolerance 0.3, the trajectory-like outputs not compared",
            None: "for the same device and build (a different device or build: --gate openpilot-device / openpilot-pc, "
                  "openpilot's model_replay settings)"}[gate]
  rows = []
  for f in fields:
    status = "FAIL" if f.failed else "PASS"
    rows.append(f'<tr class="{status.lower()}"><td>{status}</td><td>{html.escape(f.path)}</td><td>{f.failed}/{f.compared}</td>'
                f"<td>{f.max_abs:.4g}</td><td>{f.max_rel:.3g}</td></tr>")
  structural = [f"<li>{html.escape(Path(r.new).name)}: {html.escape(s)}</li>" for r in results for s in r.structural]
  structural += [f"<li>damaged: {html.escape(d)}</li>" for r in results for d in r.damage]
  structural += [f"<li>different drives, compared anyway: {html.escape(d)}</li>" for r in results for d in dict.fromkeys(r.different_drives)]
  n_fail = sum(1 for f in fields if f.failed)
  differing = {Path(r.new).name for r in results if r.regression}
  series = "".join(f'<figure><img src="{p.name}" alt="{html.escape(n)}"><figcaption>{html.escape(n)}</figcaption></figure>'
                   for n, p in sorted(series_pngs.items(), key=lambda np_: (Path(np_[0]).name not in differing, np_[0])))
  doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>regress: {verdict}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; max-width: 1500px; }}
h1.PASS {{ color: #2e7d32; }} h1.REGRESSION {{ color: #c62828; }}
table {{ border-collapse: collapse; font-size: 13px; }} td, th {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
td:nth-child(2) {{ text-align: left; font-family: monospace; }}
tr.fail td:first-child {{ background: #c62828; color: white; font-weight: bold; }} tr.pass td:first-child {{ background: #2e7d32; color: white; }}
figure {{ display: inline-block; margin: 0.5em; }} img {{ max-width: 100%; }}
</style></head><body>
<h1 class="{verdict}">{verdict}</h1>
<p>NEW: <code>{html.escape(str(new))}</code><br>REF: <code>{html.escape(str(ref))}</code></p>
<p>{len(results)} log(s), {sum(r.messages_new for r in results)} messages in NEW, {sum(r.messages_ref for r in results)} in REF;
{n_fail} of {len(fields)} fields outside tolerance.</p>
<h2>Tolerance</h2>
<p>{rule}. Anchor: {html.escape(anchor)}.<br>Not compared: <code>{html.escape(", ".join(ignore))}</code></p>
{"<h2>Structure</h2><ul>" + "".join(structural) + "</ul>" if structural else ""}
{accuracy_html}
<h2>Worst frames</h2>
<p>REF solid, NEW dashed: lane lines (yellow), road edges (red), planned path (blue).</p>
{"".join(frames_html) or "<p>No frame has a value outside tolerance.</p>"}
{"<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>" if notes else ""}
<h2>Difference distributions</h2>
{f'<img src="{dist.name}" alt="distributions">' if dist is not None else "<p>NEW and REF are identical in every compared value.</p>"}
<h2>Fields</h2>
<table><tr><th>status</th><th>field</th><th>outside / compared</th><th>max |diff|</th><th>max rel</th></tr>
{"".join(rows)}
</table>
<h2>Over time</h2>
{series}
</body></html>
"""
  page = report_dir / "report.html"
  write_atomic(page, doc)
  return [*written, page]
