"""openpilot's on-disk drive layout: a route is a run of 60 s segments, each a directory `<route>--<n>` holding
rlog / qlog (.zst, .bz2 or uncompressed) and the camera files fcamera.hevc (road), ecamera.hevc (wide),
dcamera.hevc (driver) and qcamera.ts."""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from selfdrive_glue.errors import UserError

SEGMENT_SECONDS = 60
ROAD_CAMERA, WIDE_CAMERA, DRIVER_CAMERA, QCAMERA = "fcamera.hevc", "ecamera.hevc", "dcamera.hevc", "qcamera.ts"
LOG_NAMES = ("rlog", "qlog")
_LOG_SUFFIXES = (".zst", ".bz2", "")
_SEGMENT_RE = re.compile(r"^(?P<route>.+)--(?P<n>\d+)$")


def route_name(seed: int) -> str:
  """A route name in openpilot's newer style (`<8 hex counter>--<10 hex>`), derived from a seed so synth is reproducible."""
  return f"{seed & 0xffffffff:08x}--{hashlib.sha1(f'modeld-msm synth {seed}'.encode()).hexdigest()[:10]}"


def segment_name(route: str, n: int) -> str:
  return f"{route}--{n}"


def find_log(segdir: Path, kind: str = "rlog") -> Path | None:
  for suffix in _LOG_SUFFIXES:
    p = segdir / f"{kind}{suffix}"
    if p.is_file():
      return p
  return None


@dataclass(frozen=True)
class Segment:
  path: Path

  @property
  def name(self) -> str:
    return self.path.name

  @property
  def route(self) -> str | None:
    m = _SEGMENT_RE.match(self.path.name)
    return m.group("route") if m else None

  @property
  def number(self) -> int | None:
    m = _SEGMENT_RE.match(self.path.name)
    return int(m.group("n")) if m else None

  def log(self, kind: str = "rlog") -> Path | None:
    return find_log(self.path, kind)

  def camera(self, name: str) -> Path | None:
    p = self.path / name
    return p if p.is_file() else None


def open_segment(path: str | os.PathLike) -> Segment:
  """A segment directory that has an rlog (or at least a qlog); UserError otherwise."""
  p = Path(path)
  if not p.exists():
    raise UserError(f"segment {p} not found")
  if not p.is_dir():
    raise UserError(f"{p} is not a segment directory (expected a folder with rlog.zst and fcamera.hevc)")
  seg = Segment(p)
  if seg.log("rlog") is None and seg.log("qlog") is None:
    raise UserError(f"segment {p} has no rlog or qlog (.zst, .bz2 or uncompressed)")
  return seg


def expand_segments(paths: list[str]) -> list[Segment]:
  """Arguments -> segments: a segment directory, or a route directory whose children are `<route>--<n>` segments."""
  out: list[Segment] = []
  for a in paths:
    p = Path(a)
    if p.is_dir() and find_log(p, "rlog") is None and find_log(p, "qlog") is None:
      kids = sorted((c for c in p.iterdir() if c.is_dir() and _SEGMENT_RE.match(c.name)), key=_segment_sort_key)
      if kids:
        out.extend(open_segment(k) for k in kids)
        continue
    out.append(open_segment(p))
  return out


def _segment_sort_key(p: Path):
  m = _SEGMENT_RE.match(p.name)
  return (m.group("route"), int(m.group("n"))) if m else (p.name, 0)
