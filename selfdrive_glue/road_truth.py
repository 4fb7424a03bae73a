"""What the road renderer drew, in the frames and on the grids of modeld's outputs: the truth a trained model is held to.

Frames: openpilot's calibrated device frame at the camera — x forward, y right, z down — so lane lines on the ground
have z = CAM_HEIGHT and a left lane line has negative y. Angles follow the same right-handed, z-down frame: a yaw, a yaw
rate or a curvature to the right is positive (the opposite of carState's steering convention, where EgoState.curvature
is left positive). Everything is a pure function of (scene, t), like the pictures.

Approximations, all second order in the scene's small angles (heading errors of ~1e-2 rad): distance along the road is
distance along x, and the lateral offset of a point is its y.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from selfdrive_glue import model_grids
from selfdrive_glue.road_render import CAM_HEIGHT, MAX_DIST, RoadScene

X_IDXS = np.array(model_grids.X_IDXS)   # m, modeld's lane-line grid
T_IDXS = np.array(model_grids.T_IDXS)   # s, modeld's plan grid
LEAD_T_IDXS = np.array(model_grids.LEAD_T_IDXS)
LEAD_T_OFFSETS = np.array(model_grids.LEAD_T_OFFSETS)
IDX_N = model_grids.IDX_N
LANE_OFFSETS = (-1.5, -0.5, 0.5, 1.5)   # lane widths from the ego lane's centre: outer left, left, right, outer right
EDGE_MARGIN = 0.3                       # m of asphalt beyond the outer lines (the renderer's asphalt span)


@dataclass(frozen=True)
class Truth:
  t: float
  lane_lines_y: np.ndarray    # (4, 33) at X_IDXS; z is CAM_HEIGHT
  road_edges_y: np.ndarray    # (2, 33) at X_IDXS
  plan: np.ndarray            # (33, 15) at T_IDXS: position, velocity, acceleration, euler, euler rate (Plan layout)
  lead: np.ndarray            # (3, 6, 4): per LEAD_T_OFFSETS selection, (x, y, v, a) at LEAD_T_IDXS
  lead_prob: np.ndarray       # (3,): a lead exists at t + LEAD_T_OFFSETS
  v_ego: float
  yaw_rate: float             # rad/s, right positive
  desired_curvature: float    # 1/m, right positive: the ego path's curvature lat_action_t after t (what modeld's action aims at)

  def lane_y_at(self, distance: float) -> np.ndarray:
    """(4,) lateral positions of the lane lines `distance` m ahead (linear between grid points)."""
    return np.array([np.interp(distance, X_IDXS, ll) for ll in self.lane_lines_y])


def _ego_lateral(scene: RoadScene, t: float, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(x, y) of the ego at t + tau in the frame of t: along the road by arc length, across by lane centre + wander."""
  s0 = scene._arc(t)
  x = np.array([scene._arc(t + float(dt)) - s0 for dt in tau])
  y = scene._center_right(t, x) + scene._wander(t + tau)
  return x, y


def _heading_right(scene: RoadScene, t: float, tau: np.ndarray, x: np.ndarray) -> np.ndarray:
  """Ego heading at t + tau relative to its heading at t, right positive (slope of its path, rad)."""
  v0 = max(scene._speed(t), 1.0)
  vt = np.maximum(np.array([scene._speed(t + float(dt)) for dt in tau]), 1.0)
  lane_slope = -float(scene._wander.d(t)) / v0 - scene._kappa.integral_from(scene._arc(t), x)
  return lane_slope + scene._wander.d(t + tau) / vt


def curvature_right(scene: RoadScene, t: float) -> float:
  """Curvature of the ego's path at t, 1/m, right positive (openpilot's desiredCurvature frame)."""
  return -scene.ego(t).curvature


def truth(scene: RoadScene, t: float, lat_action_t: float = 0.0) -> Truth:
  lw = scene.lane_width
  center = scene._center_right(t, X_IDXS)
  lanes = np.stack([center + k * lw for k in LANE_OFFSETS])
  edges = np.stack([center - (1.5 * lw + EDGE_MARGIN), center + (1.5 * lw + EDGE_MARGIN)])

  x, y = _ego_lateral(scene, t, T_IDXS)
  yaw = _heading_right(scene, t, T_IDXS, x)
  v = np.array([scene._speed(t + float(dt)) for dt in T_IDXS])
  a = np.array([float(scene._dv.d(t + float(dt))) for dt in T_IDXS])
  yaw_rate = np.array([curvature_right(scene, t + float(dt)) for dt in T_IDXS]) * v
  plan = np.zeros((IDX_N, 15))
  plan[:, 0], plan[:, 1] = x, y
  plan[:, 3], plan[:, 4] = v * np.cos(yaw), v * np.sin(yaw)
  plan[:, 6] = a
  plan[:, 11] = yaw
  plan[:, 14] = yaw_rate

  lead = np.zeros((len(LEAD_T_OFFSETS), len(LEAD_T_IDXS), 4))
  prob = np.zeros(len(LEAD_T_OFFSETS))
  if scene.has_lead:
    for j, off in enumerate(LEAD_T_OFFSETS):
      d = scene._lead_distance(t + off)
      prob[j] = float(d is not None and 2.0 < d < MAX_DIST)
    for i, dt in enumerate(LEAD_T_IDXS):
      tt = t + float(dt)
      d = scene._lead_distance(tt) or 0.0
      ego = scene.ego(tt)
      lead[:, i] = (d, float(scene._center_right(t, np.array([d]))[0]), ego.v_ego + ego.lead_v_rel, ego.a_ego)
  ego = scene.ego(t)
  return Truth(t=t, lane_lines_y=lanes, road_edges_y=edges, plan=plan, lead=lead, lead_prob=prob, v_ego=ego.v_ego,
               yaw_rate=-ego.yaw_rate, desired_curvature=curvature_right(scene, t + lat_action_t))


__all__ = ["CAM_HEIGHT", "IDX_N", "LEAD_T_IDXS", "LEAD_T_OFFSETS", "T_IDXS", "X_IDXS", "Truth", "curvature_right", "truth"]
