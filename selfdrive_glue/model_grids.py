"""The grids modeld's outputs are sampled on (openpilot's ModelConstants), in the lowest layer that needs them: the
renderer's truth is expressed on them here, and modeld_msm/constants.py re-exports them for the model side.

Built with the same Python float expressions as openpilot, so the numbers on the wire match bit for bit.
"""
from __future__ import annotations

IDX_N = 33
DT_MDL = 0.05  # s, one model step at 20 Hz (the desire helper's timers count in it too)


def _quadratic_grid(end: float) -> list[float]:
  # denser near the car, where precision matters most
  return [end * (i / (IDX_N - 1)) ** 2 for i in range(IDX_N)]


T_IDXS: list[float] = _quadratic_grid(10.0)   # s
X_IDXS: list[float] = _quadratic_grid(192.0)  # m
LEAD_T_IDXS: list[float] = [0., 2., 4., 6., 8., 10.]
LEAD_T_OFFSETS: list[float] = [0., 2., 4.]
META_T_IDXS: list[float] = [2., 4., 6., 8., 10.]
