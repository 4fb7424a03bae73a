"""The renderer's truth agrees with the pictures it draws, in modeld's output frames."""
from __future__ import annotations

import numpy as np
import pytest

from selfdrive_glue.road_render import CAM_HEIGHT, RoadScene
from selfdrive_glue.road_truth import X_IDXS, curvature_right, truth


def _painted(scene: RoadScene, luma: np.ndarray, y_of_distance, distances) -> list[bool]:
  """For each distance in frame: is there paint (luma well above the asphalt) within 2 px of where y projects?"""
  out = []
  for d in distances:
    col, row = scene._project("road", np.array([[d, y_of_distance(d), CAM_HEIGHT]]))[0]
    c, r = int(round(2 * col + 0.5)), int(round(2 * row + 0.5))
    if 2 <= c < scene.width - 2:
      line = luma[r].astype(int)
      out.append(bool((line[c - 2:c + 3] > np.median(line) + 40).any()))
  return out


@pytest.mark.parametrize("seed", [0, 3, 11])
def test_true_lane_lines_land_on_painted_lines(seed):
  scene = RoadScene(seed)
  t = 7.3
  tr = truth(scene, t)
  buf = scene.render(t, "road")
  luma = buf[:scene.info.stride * scene.info.y_height].reshape(scene.info.y_height, scene.info.stride)
  distances = np.arange(12.0, 60.0, 1.0)
  for k in range(4):
    hits = _painted(scene, luma, lambda d, k=k: np.interp(d, X_IDXS, tr.lane_lines_y[k]), distances)
    assert hits, f"line {k} never in frame"
    if k in (0, 3):   # solid outer lines: painted nearly everywhere in frame (a lead car may hide a few metres)
      assert sum(hits) >= 0.9 * len(hits), f"outer line {k}: paint found at {sum(hits)} of {len(hits)} distances"
    else:             # dashed inner lines: 3 m of paint every 12 m
      assert sum(hits) >= 0.15 * len(hits), f"inner line {k}: paint at {sum(hits)} of {len(hits)} distances"
    # half a lane off the truth there is no paint: a truth shifted by half a lane would fail the checks above
    off = _painted(scene, luma, lambda d, k=k: np.interp(d, X_IDXS, tr.lane_lines_y[k]) + scene.lane_width / 2, distances)
    assert sum(off) <= 0.05 * max(len(off), 1)


def test_frames_and_signs():
  scene = RoadScene(5)
  tr = truth(scene, 12.0, lat_action_t=0.275)
  # device frame: y right, so the outer left line is the most negative, and lines are one lane width apart
  assert np.all(np.diff(tr.lane_lines_y, axis=0) > 0)
  np.testing.assert_allclose(np.diff(tr.lane_lines_y, axis=0), scene.lane_width, atol=1e-9)
  assert tr.road_edges_y[0, 0] < tr.lane_lines_y[0, 0] and tr.road_edges_y[1, 0] > tr.lane_lines_y[3, 0]
  # the plan starts at the ego and moves forward at its speed
  assert tr.plan[0, 0] == 0 and abs(tr.plan[0, 1]) < 1e-9 and abs(tr.plan[0, 11]) < 1e-9
  assert tr.plan[-1, 0] == pytest.approx(sum(scene._speed(12.0 + dt) for dt in np.linspace(0, 10, 2001)[:-1]) * 10 / 2000, rel=1e-3)
  # right-positive curvature is carState's left-positive one negated, and the yaw rate is v * curvature at t
  assert tr.desired_curvature == pytest.approx(-scene.ego(12.275).curvature)
  assert tr.plan[0, 14] == pytest.approx(curvature_right(scene, 12.0) * scene.ego(12.0).v_ego)
  assert len(X_IDXS) == tr.lane_lines_y.shape[1] == 33


def test_heading_integrates_yaw_rate():
  """The plan's yaw is the integral of its yaw rate (both right positive): a sign slip in either would break this."""
  scene = RoadScene(2)
  tr = truth(scene, 30.0)
  t_idx = np.array([10.0 * (i / 32) ** 2 for i in range(33)])
  integral = np.concatenate([[0], np.cumsum(np.diff(t_idx) * (tr.plan[1:, 14] + tr.plan[:-1, 14]) / 2)])
  np.testing.assert_allclose(tr.plan[:, 11], integral, atol=2e-3 + 0.02 * np.abs(integral).max())
