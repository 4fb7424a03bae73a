"""How far apart two runs of one model are where it matters on the road, in metres.

max |diff| over an output vector says two targets compute the same numbers; it does not say whether a difference
moves a lane line by a millimetre or by a lane. This reads the geometric heads of both outputs the way modeld parses
them (single-hypothesis MDN means: lane lines and road edges (n, 33, [y, z]) on X_IDXS, plan (33, 15) with position
first) and reports the largest lateral gap at 20 m and the largest plan position gap.
"""
from __future__ import annotations

import numpy as np

from selfdrive_glue.model_grids import X_IDXS

AT_M = 20.0


def _lateral_at(head: np.ndarray, lines: int) -> np.ndarray:
  mu = head[..., :lines * len(X_IDXS) * 2].reshape(*head.shape[:-1], lines, len(X_IDXS), 2)[..., 0]
  return np.stack([np.interp(AT_M, X_IDXS, row) for row in mu.reshape(-1, len(X_IDXS))]).reshape(mu.shape[:-1])


def metres_apart(got: np.ndarray, ref: np.ndarray, slices: dict[str, slice]) -> dict[str, float]:
  """{'lane_lines_m', 'road_edges_m', 'plan_position_m'}: max |got - ref| of what the model's heads mean, for the heads it
  has (each needs the single-hypothesis width: 2 x lines x 33 x 2 for lines, 2 x 33 x 15 for the plan)."""
  out: dict[str, float] = {}
  for name, lines in (("lane_lines", 4), ("road_edges", 2)):
    sl = slices.get(name)
    if sl is not None and sl.stop - sl.start == 2 * lines * len(X_IDXS) * 2:
      out[f"{name}_m"] = float(np.max(np.abs(_lateral_at(got[..., sl], lines) - _lateral_at(ref[..., sl], lines))))
  sl = slices.get("plan")
  if sl is not None and sl.stop - sl.start == 2 * len(X_IDXS) * 15:
    pos = lambda a: a[..., sl][..., :len(X_IDXS) * 15].reshape(*a.shape[:-1], len(X_IDXS), 15)[..., :3]  # noqa: E731
    out["plan_position_m"] = float(np.max(np.abs(pos(got) - pos(ref))))
  # the driver-monitoring model: face orientation (pitch, yaw, roll in radians, the first 3 face descriptors) in degrees
  for side in ("lhd", "rhd"):
    if (sl := slices.get(f"face_descs_{side}")) is not None and sl.stop - sl.start >= 3:
      deg = float(np.degrees(np.max(np.abs(got[..., sl][..., :3] - ref[..., sl][..., :3]))))
      out["face_orientation_deg"] = max(out.get("face_orientation_deg", 0.0), deg)
  return out


def describe(apart: dict[str, float]) -> str:
  names = {"lane_lines_m": "lane lines at 20 m", "road_edges_m": "road edges at 20 m", "plan_position_m": "plan positions"}
  return ", ".join(f"face orientation {v:.2g} deg" if k == "face_orientation_deg" else f"{names[k]} {v * 100:.2g} cm"
                   for k, v in apart.items())
