"""modeld_msm/inputs_check.py: each number read from a message is used only when finite and in its stated range; else
the last good value (the default before any), counted, logged once per burst, and forgotten as soon as a good one comes."""
from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from modeld_msm.inputs_check import CALIB_ANGLE, LATERAL_DELAY, Bound, InputCheck

LOG = logging.getLogger("test_inputs_check")


def _check():
  stats = SimpleNamespace(bad_inputs=0)
  return InputCheck(LOG, stats), stats


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.1, -0.075, 2.01, 1e30, -1e308, "x", None, 10**400])
def test_a_bad_value_gives_the_default_before_any_good_one(bad):
  check, stats = _check()
  assert check.number("liveDelay.lateralDelay", bad, LATERAL_DELAY) == LATERAL_DELAY.default
  assert stats.bad_inputs == 1


def test_last_good_value_then_the_next_good_one_at_once(caplog):
  check, stats = _check()
  with caplog.at_level("ERROR", logger=LOG.name):
    assert check.number("d", 0.35, LATERAL_DELAY) == 0.35
    got = [check.number("d", v, LATERAL_DELAY) for v in (math.nan, -1.0, math.inf)]
    assert got == [0.35, 0.35, 0.35]   # the last good one, not the default
    assert check.number("d", 0.5, LATERAL_DELAY) == 0.5   # nothing sticky
    assert check.number("d", math.nan, LATERAL_DELAY) == 0.5
  assert stats.bad_inputs == 4
  msgs = [r.message for r in caplog.records]
  assert len(msgs) == 2 and all(m.startswith("ignoring d:") for m in msgs), msgs   # one line per burst


def test_each_field_has_its_own_burst_and_last_good_value(caplog):
  check, stats = _check()
  b = Bound(0.0, 10.0, 1.0)
  check.number("a", 3.0, b)
  with caplog.at_level("ERROR", logger=LOG.name):
    assert check.number("b", math.nan, b) == 1.0
    assert check.number("a", math.nan, b) == 3.0
  assert len(caplog.records) == 2 and stats.bad_inputs == 2


def test_range_edges_are_inside():
  check, stats = _check()
  assert check.number("d", 0.0, LATERAL_DELAY) == 0.0 and check.number("d", 2.0, LATERAL_DELAY) == 2.0
  assert stats.bad_inputs == 0


@pytest.mark.parametrize("bad", [[0.0, math.nan, 0.0], [0.0, 0.1], [0.0, 0.1, 0.0, 0.0], [0.0, 0.6, 0.0], [0.0, 0.0, -math.inf], [1e30] * 3, 7])
def test_a_bad_vector_is_refused_whole(bad):
  check, stats = _check()
  assert check.vector("liveCalibration.rpyCalib", bad, 3, CALIB_ANGLE) is None
  assert stats.bad_inputs == 1


def test_a_good_vector_comes_back_as_float64():
  check, stats = _check()
  v = check.vector("c", [0.0, 0.1, -0.1], 3, CALIB_ANGLE)
  assert v is not None and v.dtype.name == "float64" and list(v) == [0.0, 0.1, -0.1] and stats.bad_inputs == 0
