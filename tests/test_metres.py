"""Differences between two runs of a model, in metres on the road."""
from __future__ import annotations

import numpy as np

from compile.metres import describe, metres_apart
from compile.refmodels.driving import POLICY_SLICES, VISION_SLICES, VISION_WIDTH
from selfdrive_glue.road_truth import X_IDXS


def test_lane_line_gap_at_20m_is_reported_in_metres_and_z_is_not_lateral():
  rng = np.random.default_rng(0)
  ref = rng.standard_normal((1, VISION_WIDTH)).astype(np.float32)
  got = ref.copy()
  sl = VISION_SLICES["lane_lines"]
  mu = got[0, sl][:4 * 33 * 2].reshape(4, 33, 2)   # a view into got
  mu[2, :, 0] += 0.5                                 # line 2 moved 0.5 m right everywhere
  mu[1, :, 1] += 3.0                                 # line 1's height: not a lateral error
  got[0, sl.start + 264:sl.stop] += 1.0              # log stds: not a position
  apart = metres_apart(got, ref, VISION_SLICES)
  assert abs(apart["lane_lines_m"] - 0.5) < 1e-5 and apart["road_edges_m"] == 0
  assert "plan_position_m" not in apart
  assert "lane lines at 20 m 50 cm" in describe(apart)


def test_gap_only_near_20m_is_interpolated_and_the_plan_uses_positions():
  ref = np.zeros((1, VISION_WIDTH), np.float32)
  got = ref.copy()
  sl = VISION_SLICES["road_edges"]
  k = int(np.searchsorted(X_IDXS, 20.0))                         # grid points around 20 m: 18.75 and 22.69
  got[0, sl.start + (0 * 33 + k) * 2] = 1.0                      # edge 0, 22.69 m: 1 m off
  w = (20.0 - X_IDXS[k - 1]) / (X_IDXS[k] - X_IDXS[k - 1])
  assert abs(metres_apart(got, ref, VISION_SLICES)["road_edges_m"] - w) < 1e-6
  plan_ref = np.zeros((1, 1000), np.float32)
  plan_got = plan_ref.copy()
  plan_got[0, 5 * 15 + 1] = 0.25                                  # y of plan point 5
  plan_got[0, 5 * 15 + 9] = 9.0                                   # an angle: not a position
  assert metres_apart(plan_got, plan_ref, POLICY_SLICES) == {"plan_position_m": 0.25}
  assert metres_apart(plan_got, plan_ref, {"plan": slice(0, 998)}) == {}   # not the single-hypothesis layout: nothing claimed
