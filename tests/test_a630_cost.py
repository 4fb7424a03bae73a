"""The a630 cost model (backend/a630_cost.py): waves, SP share, the band, and a fit that finds known constants."""
import random
from dataclasses import replace

import pytest

from backend import a630_cost as ac


def _work(name, alu=0.0, sfu=0.0, tex=0.0, nbytes=0.0, groups=64, group_size=256, fibers=None):
  return ac.Work(name, alu, sfu, tex, nbytes, groups * group_size if fibers is None else fibers, groups, group_size)


def test_a_partial_wave_issues_for_all_64_lanes():
  # the same work per active lane: 2-fiber groups issue 32x the ALU time of 64-fiber groups
  full = _work("full", alu=64 * 1000 * 100, groups=1000, group_size=64)
  thin = _work("thin", alu=64 * 1000 * 100, groups=32000, group_size=2)
  c = replace(ac.DEFAULT, launch_us=0.0)
  (a_full, _, _), (a_thin, _, _) = ac.terms_us([full, thin], c)
  assert a_thin == pytest.approx(32 * a_full)
  assert ac.bounds([thin], c) == ["ALU"]


def test_registers_limit_the_waves_that_hide_the_fetches():
  # Mesa's a630 register file: 96 vec4 registers per fiber at 2 waves, so 56 registers leave 2 waves on an SP, 16 leave 12
  assert [ac.reg_waves(r) for r in (0, 16, 24, 33, 48, 56)] == [16, 12, 8, 4, 4, 2]
  lean, fat = (replace(_work("k", tex=1e7, groups=1024, group_size=64), regs=r) for r in (16, 56))
  c = replace(ac.DEFAULT, launch_us=0.0)
  assert ac.frame_us([fat], c) == ac.frame_us([lean], c)   # 2 waves are enough at the shipped hide_waves
  assert ac.frame_us([fat], replace(c, hide_waves=8.0)) == pytest.approx(4 * ac.frame_us([lean], replace(c, hide_waves=8.0)))


def test_one_workgroup_leaves_the_second_sp_idle():
  c = replace(ac.DEFAULT, launch_us=0.0, hide_waves=1.0)
  one = _work("one", tex=1e7, groups=1, group_size=1024)
  two = _work("two", tex=1e7, groups=2, group_size=512)
  assert ac.frame_us([one], c) == pytest.approx(2 * ac.frame_us([two], c))


def test_bound_names_the_largest_term_or_the_launch():
  ws = [_work("a", alu=1e9), _work("d", nbytes=1e9), _work("t", tex=1e9), _work("l", alu=10.0)]
  assert ac.bounds(ws) == ["ALU", "DRAM", "TEX", "launch"]


def test_frame_is_the_sum_of_every_dispatch_and_the_band_brackets_it():
  ws = [_work(f"k{i}", alu=1e6 * i, tex=3e5 * i, nbytes=1e5 * i, groups=1 + i) for i in range(1, 20)]
  per = ac.dispatch_us(ws)
  assert ac.frame_us(ws) == pytest.approx(sum(per))
  lo, hi = ac.band_us(ws)
  assert lo < ac.frame_us(ws) < hi
  # a narrower range gives a narrower band, still around the estimate
  lo2, hi2 = ac.band_us(ws, ranges={"tex_rate": ac.UNSOURCED["tex_rate"]})
  assert lo <= lo2 < ac.frame_us(ws) < hi2 <= hi


def _synthetic(truth, n=40, seed=0):
  rng = random.Random(seed)
  pts = []
  for i in range(n):
    kind = i % 5
    groups = rng.choice([1, 2, 3, 8, 64, 300])
    size = rng.choice([2, 32, 64, 128, 256])
    w = _work(f"k{i}", alu=rng.uniform(1e5, 1e9) if kind in (0, 4) else rng.uniform(0, 1e6),
              sfu=rng.uniform(0, 1e7) if kind == 4 else 0.0,
              tex=rng.uniform(1e5, 1e9) if kind == 1 else rng.uniform(0, 1e5),
              nbytes=rng.uniform(1e5, 1e9) if kind == 2 else rng.uniform(0, 1e4),
              groups=groups, group_size=size)
    if kind == 3:   # tiny kernels: the launch overhead decides
      w = _work(f"k{i}", alu=rng.uniform(0, 1e4), groups=1, group_size=64)
    pts.append(ac.Point(w.name, ac.frame_us([w], truth), (w,)))
  return pts


def test_the_fit_recovers_known_constants_from_per_kernel_timings():
  truth = replace(ac.DEFAULT, tex_rate=8.1e9, issue_eff=0.63, dram_eff=0.71, launch_us=12.5, sfu_ratio=0.2)
  pts = _synthetic(truth)
  params = ["tex_rate", "issue_eff", "dram_eff", "launch_us", "sfu_ratio"]
  got = ac.fit(pts, params)
  for n in params:
    assert getattr(got, n) == pytest.approx(getattr(truth, n), rel=0.02), n
  assert all(abs(m - e) / m < 0.01 for _, m, e in ac.residuals(pts, got))
  # the shipped constants do not fit those timings: the fit did the work
  assert max(abs(m - e) / m for _, m, e in ac.residuals(pts, ac.DEFAULT)) > 0.2


def test_the_fit_stays_inside_the_ranges_and_the_prior_holds_unidentified_constants():
  truth = replace(ac.DEFAULT, tex_rate=ac.UNSOURCED["tex_rate"][1] * 3)   # beyond the range
  pts = [p for p in _synthetic(truth) if ac.bounds(list(p.work), truth) == ["TEX"]]
  got = ac.fit(pts, ["tex_rate", "launch_us"], prior=0.0)
  assert got.tex_rate == pytest.approx(ac.UNSOURCED["tex_rate"][1], rel=1e-3)
  # with one aggregate point and a prior, a constant the point says nothing about stays where it was
  agg = [ac.Point("frame", ac.frame_us([w for p in pts for w in p.work], truth), tuple(w for p in pts for w in p.work))]
  held = ac.fit(agg, ["tex_rate", "sfu_ratio"], prior=1.0)
  assert held.sfu_ratio == pytest.approx(ac.DEFAULT.sfu_ratio, rel=1e-3)


def test_constants_round_trip_and_unknown_names_are_refused():
  c = replace(ac.DEFAULT, tex_rate=1.0e10)
  assert ac.constants_from(ac.constants_dict(c)) == c
  with pytest.raises(ValueError):
    ac.constants_from({"tex_rte": 1})
  with pytest.raises(ValueError):
    ac.fit([], ["nope"])
