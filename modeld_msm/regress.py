"""Compare two replay output logs field by field, like openpilot's model_replay / process_replay compare_logs.

Messages are paired in log order and must be the same service. Every leaf field is compared: exactly by default (same
device and build must give identical bytes), or within a relative tolerance (|a-b| <= tol * max(|a|,|b|), the
dictdiffer rule openpilot uses) plus an optional absolute one. Ignored fields (default logMonoTime, frameDropPerc,
modelExecutionTime) match by name at any depth, or by dotted prefix (`modelV2.leadsV3`).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from selfdrive_glue.errors import UserError
from selfdrive_glue.files import replacing, write_atomic
from selfdrive_glue.logs import LOG_SUFFIXES, LogReader

DEFAULT_IGNORE = ("logMonoTime", "frameDropPerc", "modelExecutionTime")


@dataclass
class FieldDiff:
  path: str
  compared: int = 0  # values compared over all messages
  failed: int = 0  # values outside tolerance
  max_abs: float = 0.0
  max_rel: float = 0.0
  first_message: int | None = None  # index of the first failing message
  example: tuple = ()  # (new, ref) at the first failure


@dataclass
class CompareResult:
  new: str
  ref: str
  messages_new: int = 0
  messages_ref: int = 0
  structural: list[str] = field(default_factory=list)  # missing files, count or service mismatches
  fields: dict[str, FieldDiff] = field(default_factory=dict)
  damage: list[str] = field(default_factory=list)

  @property
  def regression(self) -> bool:
    return bool(self.structural) or any(f.failed for f in self.fields.values())

  def worst(self, n: int = 10) -> list[FieldDiff]:
    bad = [f for f in self.fields.values() if f.failed]
    bad.sort(key=lambda f: (-f.max_rel, -f.max_abs, f.path))
    return bad[:n]


def _flatten(prefix: str, v, out: dict) -> None:
  if isinstance(v, dict):
    for k, x in v.items():
      if k.startswith("unused"):
        continue
      _flatten(f"{prefix}.{k}" if prefix else k, x, out)
  elif isinstance(v, list):
    if v and all(isinstance(x, dict) for x in v):
      for i, x in enumerate(v):
        _flatten(f"{prefix}[{i}]", x, out)
    elif all(isinstance(x, (int, float, bool)) for x in v):
      out[prefix] = np.asarray(v, dtype=np.float64)
    else:
      out[prefix] = list(v)
  else:
    out[prefix] = v


def _ignored(path: str, ignore: set[str]) -> bool:
  parts = [p.split("[")[0] for p in path.split(".")]
  if any(p in ignore for p in parts):
    return True
  bare = ".".join(parts)
  return any(bare == i or bare.startswith(i + ".") for i in ignore if "." in i)


def read_messages(path: Path, damage: list[str]) -> list[tuple[str, dict]]:
  reader = LogReader(path)
  out = []
  for ev in reader:
    flat: dict = {}
    _flatten("", ev.to_dict(), flat)
    out.append((ev.which(), flat))
  if reader.damage:
    damage.append(f"{path}: {reader.damage}")
  return out


def _as_array(v) -> np.ndarray | None:
  if isinstance(v, np.ndarray):
    return v
  if isinstance(v, (bool, int, float)):
    return np.asarray([v], dtype=np.float64)
  return None


def compare_messages(new: list[tuple[str, dict]], ref: list[tuple[str, dict]], res: CompareResult, tolerance: float = 0.0,
                     abs_tolerance: float = 0.0, ignore: tuple[str, ...] = DEFAULT_IGNORE) -> CompareResult:
  ign = set(ignore)
  res.messages_new, res.messages_ref = len(new), len(ref)
  if len(new) != len(ref):
    res.structural.append(f"{len(new)} messages in NEW vs {len(ref)} in REF")
  for i, ((wn, fn), (wr, fr)) in enumerate(zip(new, ref)):
    if wn != wr:
      res.structural.append(f"message {i}: NEW is {wn}, REF is {wr}")
      break
    for path in sorted(set(fn) | set(fr)):
      if _ignored(path, ign):
        continue
      name = path if path.startswith(wn + ".") else f"{path} ({wn})"  # Event-level fields (valid) per service
      fd = res.fields.get(name)
      if fd is None:
        fd = res.fields[name] = FieldDiff(name)
      a, b = fn.get(path), fr.get(path)
      aa, bb = _as_array(a), _as_array(b)
      if aa is None or bb is None or aa.shape != bb.shape:
        fd.compared += 1
        if not (aa is None and bb is None and a == b):  # text, enums, lists of text; or a shape change
          _fail(fd, i, 1, np.inf, np.inf, a, b)
        continue
      fd.compared += aa.size
      if aa.size == 0:
        continue
      diff = np.abs(aa - bb)
      both_nan = np.isnan(aa) & np.isnan(bb)
      diff = np.where(both_nan, 0.0, np.where(np.isnan(diff), np.inf, diff))
      scale = np.maximum(np.abs(aa), np.abs(bb))
      allowed = np.maximum(tolerance * scale, abs_tolerance)
      bad = diff > allowed
      with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.where(scale > 0, scale, 1e-300))
      fd.max_abs = max(fd.max_abs, float(diff.max()))
      fd.max_rel = max(fd.max_rel, float(rel.max()))
      nbad = int(bad.sum())
      if nbad:
        j = int(np.argmax(bad))
        _fail(fd, i, nbad, None, None, float(aa[j]), float(bb[j]))
  return res


def _fail(fd: FieldDiff, i: int, n: int, dabs, drel, a, b) -> None:
  fd.failed += n
  if dabs is not None:
    fd.max_abs, fd.max_rel = max(fd.max_abs, dabs), max(fd.max_rel, drel)
  if fd.first_message is None:
    fd.first_message = i
    fd.example = (_jsonable(a), _jsonable(b))


def _jsonable(v):
  if isinstance(v, np.ndarray):
    return v.tolist()
  return v


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
            ignore: tuple[str, ...] = DEFAULT_IGNORE) -> tuple[list[CompareResult], dict[str, tuple[list, list]]]:
  """Compare; returns per-file results and the messages (for plotting) keyed by file name."""
  if tolerance < 0 or abs_tolerance < 0:
    raise UserError("tolerances must be >= 0")
  results, messages = [], {}
  for name, pn, pr in pairs(Path(new), Path(ref)):
    res = CompareResult(str(pn) if pn else f"(missing) {name}", str(pr) if pr else f"(missing) {name}")
    if pn is None or pr is None:
      res.structural.append(f"{name} is only in {'REF' if pn is None else 'NEW'}")
      results.append(res)
      continue
    mn, mr = read_messages(pn, res.damage), read_messages(pr, res.damage)
    compare_messages(mn, mr, res, tolerance, abs_tolerance, ignore)
    results.append(res)
    messages[name] = (mn, mr)
  return results, messages


def summary_lines(results: list[CompareResult], n: int = 10) -> list[str]:
  lines = []
  fields: dict[str, FieldDiff] = {}
  for r in results:
    for s in r.structural:
      lines.append(f"STRUCTURE {Path(r.new).name}: {s}")
    for d in r.damage:
      lines.append(f"DAMAGED   {d}")
    for f in r.fields.values():
      g = fields.setdefault(f.path, FieldDiff(f.path))
      g.compared += f.compared
      g.failed += f.failed
      g.max_abs, g.max_rel = max(g.max_abs, f.max_abs), max(g.max_rel, f.max_rel)
      if g.first_message is None and f.first_message is not None:
        g.first_message, g.example = f.first_message, f.example
  bad = sorted((f for f in fields.values() if f.failed), key=lambda f: (-f.max_rel, -f.max_abs, f.path))
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
]


def _series(msgs: list[tuple[str, dict]], path: str, idx: int) -> tuple[np.ndarray, np.ndarray]:
  t, v = [], []
  for which, flat in msgs:
    if which != path.split(".", 1)[0] or path not in flat:
      continue
    arr = _as_array(flat[path])
    if arr is None or arr.size == 0:
      continue
    t.append(flat.get("logMonoTime", 0) / 1e9)
    v.append(float(arr[idx]))
  return np.asarray(t), np.asarray(v)


def write_report(report_dir: str | os.PathLike, results: list[CompareResult], messages: dict, tolerance: float, ignore, abs_tolerance: float = 0.0,
                 new: str | os.PathLike = "", ref: str | os.PathLike = "", gate: str | None = None, segments=(), accuracy=()) -> list[Path]:
  """report.txt, report.json, one PNG per compared log (plan, lane lines, lead of both runs over time) and report.html
  (modeld_msm.report: pass/fail per field, difference distributions, the worst frames drawn on the camera image).
  accuracy: replay_accuracy.regress_accuracy's rows (ground truth of synthetic segments), reported beside the comparison."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from modeld_msm.replay_accuracy import regress_html, regress_json, regress_lines
  out = Path(report_dir)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  series_pngs: dict[str, Path] = {}
  txt = summary_lines(results, 30)
  verdict = "REGRESSION" if any(r.regression for r in results) else "PASS"
  txt += regress_lines(list(accuracy))
  write_atomic(out / "report.txt", "\n".join([f"{verdict} (tolerance {tolerance}, ignoring {', '.join(ignore)})", *txt]) + "\n")
  data = [{"new": r.new, "ref": r.ref, "regression": r.regression, "messages_new": r.messages_new, "messages_ref": r.messages_ref,
           "structural": r.structural, "damage": r.damage, "worst": [asdict(f) for f in r.worst(30)]} for r in results]
  write_atomic(out / "report.json", json.dumps({"verdict": verdict, "tolerance": tolerance, "ignore": list(ignore), "files": data,
                                               "accuracy": regress_json(list(accuracy))}, indent=1))
  written += [out / "report.txt", out / "report.json"]
  for name, (mn, mr) in messages.items():
    fig, axes = plt.subplots(2, 4, figsize=(18, 7.5), sharex=True)
    for ax, (title, series) in zip(axes.ravel(), _PANELS):
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
  from modeld_msm.report import write_html
  written += write_html(out, Path(new), Path(ref), results, messages, tolerance, abs_tolerance, tuple(ignore), gate, list(segments), series_pngs,
                        regress_html(list(accuracy)))
  return written


