"""The a630's time for one dispatch from the work it executed, with every constant named, its plausible range, and a fit.

A dispatch is `Work` (what emulator level B counted: lane-instructions, texel fetches, bytes, plus its launch shape). Its
time under `Constants` is
  launch_us + max(alu, dram, tex) + overlap * (alu + dram + tex - max(...))
  - alu: cat1-3 and cat4 instructions issued per 64-lane wave (a partial wave issues for all 64 lanes), at the MAD rate
    over issue_eff, cat4 at sfu_ratio of it;
  - tex: texel fetches of active lanes at tex_rate; dram: ldg/stg bytes at dram_rate * dram_eff;
  - all three over the share of SPs the launch can fill (a workgroup runs on one SP: one group leaves the other idle, three
    load them 2:1) and over an occupancy factor min(1, resident waves on the busiest SP / hide_waves): too few waves cannot
    hide fetch latency. The waves resident on an SP are those launched to it, at most what its register file holds for the
    kernel's register footprint (a larger register tile costs registers, so fewer waves hide the fetches).
Sourced (docs/anchors.md §4): the 710 MHz clock, the THREAD64 MAD peak (345.6 GFLOPS = 172.8 G lane-MADs/s), the
LPDDR4X-3733 rate (29.9 GB/s), the 64-lane wave tinygrad launches; the register file (Mesa's a630 entry: 96 vec4
registers per 128 fibers, waves allotted two at a time, at most 16 per SP; docs/a630-time.md). Every other constant is in UNSOURCED with the range
the estimate's band is taken over; `fit` moves them to match measured times (docs/a630-time.md).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

WAVE = 64            # fibers per wave: tinygrad's QCOM queue launches with THREAD64
N_SP = 2             # shader processors of the a630 (Mesa's a6xx table: 2 CCUs, one per SP)
CLOCK_HZ = 710e6
MAD_LANES_PER_S = 345.6e9 / 2   # measured THREAD64 peak (tinygrad#16229), 2 FLOP per MAD
DRAM_PEAK = 29.9e9              # LPDDR4X-3733, 4 x 16 bit
REG_FILE_VEC4 = 96   # Mesa's a6xx gen1 (a615/a618/a630) reg_size_vec4: vec4 registers per fiber at 128 fibers per pair of waves
WAVE_GRANULARITY = 2   # waves are given registers two at a time (Mesa's ir3 compiler, a6xx)
MAX_WAVES = 16         # resident waves per SP whatever the footprint (Mesa: fibers_per_sp 128 x 16 over 128-fiber pairs)


@dataclass(frozen=True)
class Work:
  """One dispatch as executed: active lane counts and its launch shape."""
  name: str
  alu: float        # cat1-3 lane-instructions (active lanes)
  sfu: float        # cat4 lane-instructions
  tex: float        # texel fetches
  nbytes: float     # ldg + stg bytes
  fibers: int       # active fibers
  groups: int       # workgroups launched
  group_size: int   # fibers per workgroup (the local size)
  flops: float = 0.0   # tinygrad's estimate, for GFLOPS columns only
  regs: int = 0        # vec4 registers per fiber (full + half/2, as the launch's SP_CS_CNTL_0 footprints); 0: unknown, no limit


def reg_waves(regs: int) -> int:
  """Waves one SP holds at once for a kernel of `regs` vec4 registers per fiber (Mesa's register-dependent wave limit)."""
  return MAX_WAVES if regs <= 0 else max(WAVE_GRANULARITY, min(MAX_WAVES, REG_FILE_VEC4 // regs * WAVE_GRANULARITY))


@dataclass(frozen=True)
class Constants:
  issue_eff: float = 0.8       # share of the MAD rate the issued cat1-3 mix achieves
  sfu_ratio: float = 0.25      # cat4 rate over the ALU rate
  tex_rate: float = 2 * 4 * CLOCK_HZ   # texels/s: 2 TPs x 4 texels/clock (not in our sources)
  dram_eff: float = 0.5        # share of DRAM_PEAK a kernel gets (the CPU, camera and display share it)
  launch_us: float = 5.0       # per dispatch: CP_WAIT_FOR_IDLE + cache flush + state load around CP_EXEC_CS
  overlap: float = 0.0         # 0: ALU, DRAM and texture overlap fully (max); 1: not at all (sum)
  hide_waves: float = 2.0      # waves per SP needed to hide fetch latency


DEFAULT = Constants()
# the plausible range of each unsourced constant (docs/a630-time.md says why each bound)
UNSOURCED: dict[str, tuple[float, float]] = {
  "issue_eff": (0.5, 1.0),
  "sfu_ratio": (0.125, 0.5),
  "tex_rate": (DEFAULT.tex_rate / 2, DEFAULT.tex_rate * 2),
  "dram_eff": (0.35, 1.0),
  "launch_us": (1.0, 20.0),
  "overlap": (0.0, 1.0),
  "hide_waves": (1.0, 8.0),
}
TERMS = ("ALU", "DRAM", "TEX")


def _arrays(work: list[Work]) -> dict[str, np.ndarray]:
  a = {f: np.array([getattr(w, f) for w in work], np.float64) for f in ("alu", "sfu", "tex", "nbytes", "fibers", "groups", "group_size")}
  a["reg_waves"] = np.array([reg_waves(w.regs) for w in work], np.float64)
  waves_per_group = np.ceil(np.maximum(a["group_size"], 1) / WAVE)
  a["waves"] = a["groups"] * waves_per_group
  a["pad"] = a["waves"] * WAVE / np.maximum(a["fibers"], 1)   # issued lanes per active lane
  groups = np.maximum(a["groups"], 1)
  a["sp_share"] = groups / (N_SP * np.ceil(groups / N_SP))   # the busiest SP gets ceil(groups / N_SP) workgroups
  return a


# *** a launch shape alone: what the local-size choice ranks (backend/local_size.py) ***

GROUP_OVERHEAD_WAVES = 0.25   # per workgroup on an SP: its start and the state it loads, in waves of issue
MAX_GROUP_FIBERS = 256        # bigger workgroups gain nothing here and, on the chip, fewer of them fit an SP at once


def busiest_sp_waves(groups: int, group_size: int) -> int:
  """Waves the busiest SP issues: workgroups go whole to one SP, and a partial wave issues for all 64 lanes."""
  return math.ceil(max(groups, 1) / N_SP) * math.ceil(max(group_size, 1) / WAVE)


def shape_cost(groups: int, group_size: int, c: Constants = DEFAULT) -> float:
  """A launch's relative time by its shape, for the same work per fiber: the busiest SP's issued waves, at least
  hide_waves (below that the model's occupancy factor makes latency the bound), so this is proportional to the ALU term
  `_terms` gives such a dispatch; plus a per-workgroup overhead on that SP, more for oversized groups, which ranks shapes
  the terms tie. Only the ranking between shapes of one launch means anything."""
  per_group = GROUP_OVERHEAD_WAVES + max(0, group_size - MAX_GROUP_FIBERS) / WAVE
  return max(busiest_sp_waves(groups, group_size), c.hide_waves) + math.ceil(max(groups, 1) / N_SP) * per_group


def _terms(a: dict[str, np.ndarray], c: Constants) -> np.ndarray:
  """[3, n] seconds: ALU, DRAM, TEX of each dispatch, before launch overhead and overlap."""
  sp = np.maximum(a["sp_share"], 1e-9)
  resident = np.minimum(a["waves"] / (sp * N_SP), a["reg_waves"])   # on the busiest SP, as its registers allow
  occ = np.minimum(1.0, resident / c.hide_waves)
  alu = (a["alu"] + a["sfu"] / c.sfu_ratio) * a["pad"] / (MAD_LANES_PER_S * c.issue_eff)
  dram = a["nbytes"] / (DRAM_PEAK * c.dram_eff)
  tex = a["tex"] / c.tex_rate
  return np.stack([alu / sp, dram, tex / sp]) / np.maximum(occ, 1e-9)


def _us(a: dict[str, np.ndarray], c: Constants) -> np.ndarray:
  t = _terms(a, c)
  m = t.max(0)
  return c.launch_us + (m + c.overlap * (t.sum(0) - m)) * 1e6


def dispatch_us(work: list[Work], c: Constants = DEFAULT) -> list[float]:
  return [float(x) for x in _us(_arrays(work), c)] if work else []


def bounds(work: list[Work], c: Constants = DEFAULT) -> list[str]:
  """What bounds each dispatch: the largest term, or 'launch' where the fixed overhead is more than all of them."""
  if not work:
    return []
  t = _terms(_arrays(work), c) * 1e6
  return ["launch" if c.launch_us >= t[:, i].max() else TERMS[int(t[:, i].argmax())] for i in range(t.shape[1])]


def terms_us(work: list[Work], c: Constants = DEFAULT) -> list[tuple[float, float, float]]:
  t = _terms(_arrays(work), c) * 1e6
  return [(float(x), float(y), float(z)) for x, y, z in t.T] if work else []


def frame_us(work: list[Work], c: Constants = DEFAULT) -> float:
  return float(_us(_arrays(work), c).sum()) if work else 0.0


def band_us(work: list[Work], c: Constants = DEFAULT, ranges: dict[str, tuple[float, float]] | None = None) -> tuple[float, float]:
  """(lowest, highest) frame time over every corner of the unsourced constants' ranges. The time grows or falls
  monotonically with each constant, so the corners bound it, and the estimate at `c` (inside every range) lies between."""
  ranges = UNSOURCED if ranges is None else ranges
  if not work:
    return (0.0, 0.0)
  a = _arrays(work)
  names = list(ranges)
  totals = [float(_us(a, replace(c, **dict(zip(names, corner)))).sum()) for corner in itertools.product(*(ranges[n] for n in names))]
  return (min(totals), max(totals))


# *** the fit ***

@dataclass(frozen=True)
class Point:
  """A measured time for a set of dispatches (one kernel, or a whole frame): what the fit matches."""
  source: str
  measured_us: float
  work: tuple[Work, ...]
  weight: float = 1.0


def _objective(points, arrays, c: Constants, prior: float, params, ranges) -> float:
  err = sum(p.weight * math.log(float(_us(a, c).sum()) / p.measured_us) ** 2 for p, a in zip(points, arrays))
  if prior:   # pull each constant towards its shipped value, in units of its log range, so sparse data moves them little
    for n in params:
      lo, hi = ranges[n]
      span = math.log(hi / lo) if lo > 0 else hi - lo
      d = (math.log(getattr(c, n) / getattr(DEFAULT, n)) if lo > 0 else getattr(c, n) - getattr(DEFAULT, n)) / span
      err += prior * d * d
  return err


def fit(points: list[Point], params: list[str], start: Constants = DEFAULT, prior: float = 0.0, sweeps: int = 60,
        ranges: dict[str, tuple[float, float]] | None = None) -> Constants:
  """Constants in `params` (each kept inside its range) minimising the squared log error of every point's estimate, by
  coordinate descent with a golden-section search per constant (log scale for positive ranges); prior > 0 adds a pull to
  the shipped values. Deterministic."""
  ranges = UNSOURCED if ranges is None else ranges
  if unknown := [n for n in params if n not in ranges]:
    raise ValueError(f"no range for {unknown}")
  arrays = [_arrays(list(p.work)) for p in points]
  c = start
  g = (math.sqrt(5) - 1) / 2
  for _ in range(sweeps):
    before = _objective(points, arrays, c, prior, params, ranges)
    for n in params:
      lo, hi = ranges[n]
      logs = lo > 0
      to = (lambda x: math.exp(x)) if logs else (lambda x: x)
      a, b = (math.log(lo), math.log(hi)) if logs else (lo, hi)

      def f(x, n=n, to=to, c=c):
        return _objective(points, arrays, replace(c, **{n: to(x)}), prior, params, ranges)
      x1, x2 = b - g * (b - a), a + g * (b - a)
      f1, f2 = f(x1), f(x2)
      for _ in range(48):
        if f1 < f2:
          b, x2, f2 = x2, x1, f1
          x1 = b - g * (b - a)
          f1 = f(x1)
        else:
          a, x1, f1 = x1, x2, f2
          x2 = a + g * (b - a)
          f2 = f(x2)
      best = to((a + b) / 2)
      if f(math.log(best) if logs else best) < _objective(points, arrays, c, prior, params, ranges):
        c = replace(c, **{n: best})
    if before - _objective(points, arrays, c, prior, params, ranges) < 1e-12:
      break
  return c


def residuals(points: list[Point], c: Constants) -> list[tuple[str, float, float]]:
  """(source, measured ms, estimated ms) per point."""
  return [(p.source, p.measured_us / 1e3, frame_us(list(p.work), c) / 1e3) for p in points]


def constants_dict(c: Constants) -> dict[str, float]:
  return asdict(c)


def constants_from(d: dict) -> Constants:
  names = {f.name for f in fields(Constants)}
  if bad := sorted(set(d) - names):
    raise ValueError(f"unknown constants {bad}")
  return replace(DEFAULT, **{k: float(v) for k, v in d.items()})
