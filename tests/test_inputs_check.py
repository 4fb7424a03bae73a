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


# the stated ranges (docs/hostile-input.md), written out here rather than read from the module: a wrong bound in the code
# must not move the expectation with it
STATED = {
  "LATERAL_DELAY": (0.0, 2.0, 0.2),
  "LONG_ACTUATOR_DELAY": (0.0, 2.0, 0.15),
  "V_EGO": (-100.0, 100.0, 0.0),
  "STEERING_TORQUE": (-1e5, 1e5, 0.0),
}


@pytest.mark.parametrize("name", list(STATED))
def test_each_stated_range_and_default(name):
  import modeld_msm.inputs_check as ic
  lo, hi, default = STATED[name]
  b = getattr(ic, name)
  for v in (lo, hi, (lo + hi) / 2):
    check, stats = _check()
    assert check.number(name, v, b) == v and stats.bad_inputs == 0, v
  for v in (math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)):
    check, stats = _check()
    assert check.number(name, v, b) == default and stats.bad_inputs == 1, v


@pytest.mark.parametrize("edge,ok", [(-0.5, True), (0.5, True), (math.nextafter(-0.5, -1), False), (math.nextafter(0.5, 1), False)])
def test_calibration_angles_are_held_to_half_a_radian(edge, ok):
  for i in range(3):
    check, _ = _check()
    v = [0.0, 0.0, 0.0]
    v[i] = edge
    assert (check.vector("c", v, 3, CALIB_ANGLE) is not None) == ok, (i, edge)


def test_the_log_line_shows_what_came(caplog):
  check, _ = _check()
  with caplog.at_level("ERROR", logger=LOG.name):
    check.vector("a", 7, 3, CALIB_ANGLE)          # not a list at all: shown as no values
    check.vector("b", [0.0, math.nan], 3, CALIB_ANGLE)
  assert "ignoring a: [] is not 3 values" in caplog.records[0].message
  assert "ignoring b: [0.0, nan] is not 3 values each a finite number in [-0.5, 0.5] rad" in caplog.records[1].message
