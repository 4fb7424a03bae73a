"""Every number a model process reads from a message (or from CarParams) goes through here before it is used.

One bad publisher must neither stop the process nor leave a mark once it is gone. So each value is checked against a
stated range: a value that is not a finite number inside it is replaced by the last good value of that field (the
default before any good one), counted, and logged once per burst (again only after a good value came in between). A
later good value is used as soon as it arrives: nothing about a bad value is kept. The ranges are wider than anything
openpilot's own publishers send; they exist to keep NaN, infinities and absurd magnitudes out of the step.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Bound:
  lo: float
  hi: float
  default: float
  unit: str = ""

  def describe(self) -> str:
    return f"a finite number in [{self.lo:g}, {self.hi:g}]{' ' + self.unit if self.unit else ''}"


# the ranges, one per field read (docs/hostile-input.md says why each is what it is)
LATERAL_DELAY = Bound(0.0, 2.0, 0.2, "s")             # liveDelay.lateralDelay; openpilot's default estimate is 0.2 s
LONG_ACTUATOR_DELAY = Bound(0.0, 2.0, 0.15, "s")      # CarParams.longitudinalActuatorDelay (the demo default 0.15 s)
V_EGO = Bound(-100.0, 100.0, 0.0, "m/s")              # carState.vEgo (slightly negative when rolling back)
STEERING_TORQUE = Bound(-1e5, 1e5, 0.0)               # carState.steeringTorque: only its sign is read
CALIB_ANGLE = Bound(-0.5, 0.5, 0.0, "rad")            # each of rpyCalib's roll, pitch, yaw; calibrationd stops near 0.15 rad


class Counted(Protocol):
  bad_inputs: int


class InputCheck:
  """The last good value of every field and the once-per-burst log of one process; each refused value is counted in
  stats.bad_inputs (the process's counter of everything bad it was fed)."""

  def __init__(self, log: logging.Logger, stats: Counted):
    self.log, self.stats = log, stats
    self._good: dict[str, object] = {}
    self._burst: set[str] = set()

  def _bad(self, name: str, why: str) -> None:
    self.stats.bad_inputs += 1
    if name not in self._burst:
      self._burst.add(name)
      self.log.error("ignoring %s: %s; using the last good value until a good one comes", name, why)

  def _ok(self, name: str, value: object) -> None:
    self._good[name] = value
    self._burst.discard(name)

  def number(self, name: str, raw, bound: Bound) -> float:
    """raw as a float when it is finite and inside bound, else the last good value of name (bound.default before any)."""
    try:
      v = float(raw)
    except (TypeError, ValueError, OverflowError):
      v = math.nan
    if math.isfinite(v) and bound.lo <= v <= bound.hi:
      self._ok(name, v)
      return v
    self._bad(name, f"{raw!r} is not {bound.describe()}")
    return float(self._good.get(name, bound.default))   # type: ignore[arg-type]

  def vector(self, name: str, raw, n: int, bound: Bound) -> np.ndarray | None:
    """raw as n float64 values when each is finite and inside bound, else None (the caller keeps what it had: a
    calibration is applied, not re-read every frame)."""
    try:
      v = np.array(list(raw), dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
      v = np.full(0, np.nan)
    if v.shape == (n,) and np.isfinite(v).all() and ((bound.lo <= v) & (v <= bound.hi)).all():
      self._ok(name, v)
      return v
    self._bad(name, f"{[float(x) for x in v.reshape(-1)[:8]]} is not {n} values each {bound.describe()}")
    return None
