"""Field-by-field comparison of two lists of logged messages: the rule `regress` applies and its report draws.

Every leaf field is compared: exactly by default, or within a relative tolerance (|a-b| <= tol * max(|a|,|b|), the
dictdiffer rule openpilot uses) plus an optional absolute one. Ignored fields match by name at any depth, or by dotted
prefix (`modelV2.leadsV3`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from selfdrive_glue.logs import LogReader

DEFAULT_IGNORE = ("logMonoTime", "frameDropPerc", "modelExecutionTime", "gpuExecutionTime")


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
  name: str = ""  # the key of this pair in regress()'s messages
  drives: tuple = ()  # (DriveId of NEW, DriveId of REF) when both logs were read
  different_drives: list[str] = field(default_factory=list)  # mismatches compared anyway (allow_different_drives)

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


def ignored(path: str, ignore: set[str]) -> bool:
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


def as_array(v) -> np.ndarray | None:
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
      if ignored(path, ign):
        continue
      name = field_name(path, wn)
      fd = res.fields.get(name)
      if fd is None:
        fd = res.fields[name] = FieldDiff(name)
      a, b = fn.get(path), fr.get(path)
      aa, bb = as_array(a), as_array(b)
      if aa is None or bb is None or aa.shape != bb.shape:
        fd.compared += 1
        if not (aa is None and bb is None and a == b):  # text, enums, lists of text; or a shape change
          _fail(fd, i, 1, np.inf, np.inf, a, b)
        continue
      fd.compared += aa.size
      if aa.size == 0:
        continue
      diff, bad = numeric_diff(aa, bb, tolerance, abs_tolerance)
      scale = np.maximum(np.abs(aa), np.abs(bb))
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


def field_name(path: str, which: str) -> str:
  """A field as results name it: Event-level fields (valid, logMonoTime) get their service, so each is counted per service."""
  return path if path.startswith(which + ".") else f"{path} ({which})"


def numeric_diff(aa: np.ndarray, bb: np.ndarray, tolerance: float, abs_tolerance: float) -> tuple[np.ndarray, np.ndarray]:
  """(|a - b|, outside tolerance) per value: NaN on both sides is equal, on one side an infinite difference."""
  diff = np.abs(aa - bb)
  diff = np.where(np.isnan(aa) & np.isnan(bb), 0.0, np.where(np.isnan(diff), np.inf, diff))
  return diff, diff > np.maximum(tolerance * np.maximum(np.abs(aa), np.abs(bb)), abs_tolerance)


def merged_fields(results: list[CompareResult]) -> list[FieldDiff]:
  """Per-field results over all logs (the reduce of docs/replay-at-scale.md), failing first, worst first; a field's example
  is its first failure in the first log that has one."""
  fields: dict[str, FieldDiff] = {}
  for r in results:
    for f in r.fields.values():
      g = fields.setdefault(f.path, FieldDiff(f.path))
      g.compared += f.compared
      g.failed += f.failed
      g.max_abs, g.max_rel = max(g.max_abs, f.max_abs), max(g.max_rel, f.max_rel)
      if g.first_message is None and f.first_message is not None:
        g.first_message, g.example = f.first_message, f.example
  return sorted(fields.values(), key=lambda f: (not f.failed, -f.max_rel if f.failed else 0, -f.max_abs, f.path))
