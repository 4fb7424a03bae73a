"""Plan -> action: the desired acceleration and curvature controls should reach after the actuator delay.

The plan is sampled at the delay (plus one model step and half a step for the time until the next output), the
acceleration is the constant-jerk one that reaches the planned speed there, and the curvature comes from the planned
heading change. Values are rounded to float32 as they would be after a round trip through the capnp Action struct,
because the next frame smooths against that stored value.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from modeld_msm.constants import DT_MDL, IDX_N, PLAN_WIDTH, T_IDXS, Plan
from selfdrive_glue.errors import UserError

LAT_SMOOTH_SECONDS = 0.0
LONG_SMOOTH_SECONDS = 0.3
MIN_LAT_CONTROL_SPEED = 0.3  # m/s; below this curvature is meaningless, keep the last one
MIN_STABLE_DELAY = 0.3  # s; shorter horizons interpolate from t=0 to here instead of trusting the first plan steps
MIN_SPEED = 1.0  # m/s floor for curvature = yaw / distance
ACTION_T_OFFSET = DT_MDL + DT_MDL / 2  # one model step of latency + half a step until the next action
STOP_SPEED = 0.3  # m/s
STOP_ACCEL = 0.1  # m/s^2


class Action(NamedTuple):
  desiredCurvature: float = 0.
  desiredAcceleration: float = 0.
  shouldStop: bool = False


def _f32(x) -> float:
  return float(np.float32(x))


def smooth_value(val: float, prev_val: float, tau: float, dt: float = DT_MDL) -> float:
  """One step of an exponential filter with time constant tau; tau == 0 passes val through."""
  alpha = 1 - np.exp(-dt / tau) if tau > 0 else 1
  return alpha * val + (1 - alpha) * prev_val


def get_accel_from_plan(speeds: np.ndarray, accels: np.ndarray, t_idxs=T_IDXS, action_t: float = DT_MDL) -> tuple[float, bool]:
  """Acceleration that, held with constant jerk from (v0, a0), reaches the planned speed at action_t.

  Returns (a_target, should_stop): stop when the plan starts (nearly) stationary and does not ask to pull away.
  """
  if len(speeds) != len(t_idxs) or len(accels) != len(t_idxs):
    raise UserError(f"plan speeds/accels have {len(speeds)}/{len(accels)} points, expected {len(t_idxs)}")
  if not action_t > 0:
    raise UserError(f"longitudinal action time must be > 0 s, got {action_t}")
  v_now, a_now = speeds[0], accels[0]
  if action_t < MIN_STABLE_DELAY:
    v_target = v_now + (action_t / MIN_STABLE_DELAY) * (np.interp(MIN_STABLE_DELAY, t_idxs, speeds) - v_now)
  else:
    v_target = np.interp(action_t, t_idxs, speeds)
  a_target = 2 * (v_target - v_now) / action_t - a_now
  should_stop = bool(v_now < STOP_SPEED and a_target < STOP_ACCEL)
  return float(a_target), should_stop


def curv_from_psis(psi_target: float, psi_rate: float, v_ego: float, action_t: float) -> float:
  v = max(v_ego, MIN_SPEED)
  # heading psi reached at action_t under a linearly changing yaw rate starting from psi_rate
  return float(2 * (psi_target / (v * action_t)) - psi_rate / v)


def get_curvature_from_plan(yaws: np.ndarray, yaw_rates: np.ndarray, t_idxs=T_IDXS, v_ego: float = 0., action_t: float = DT_MDL) -> float:
  if len(yaws) != len(t_idxs) or len(yaw_rates) != len(t_idxs):
    raise UserError(f"plan yaws/yaw rates have {len(yaws)}/{len(yaw_rates)} points, expected {len(t_idxs)}")
  if not action_t > 0:
    raise UserError(f"lateral action time must be > 0 s, got {action_t}")
  if action_t < MIN_STABLE_DELAY:
    psi_target = (action_t / MIN_STABLE_DELAY) * np.interp(MIN_STABLE_DELAY, t_idxs, yaws)
  else:
    psi_target = np.interp(action_t, t_idxs, yaws)
  return curv_from_psis(psi_target, yaw_rates[0], v_ego, action_t)


def plan_curvature(plan: np.ndarray, v_ego: float, lat_t: float) -> float:
  """Curvature of a parsed (33, 15) plan at lat_t, before smoothing: the heading it reaches there and its first yaw rate."""
  return get_curvature_from_plan(plan[:, Plan.T_FROM_CURRENT_EULER][:, 2], plan[:, Plan.ORIENTATION_RATE][:, 2], T_IDXS, v_ego, lat_t)


def action_times(long_actuator_delay: float, lateral_delay: float) -> tuple[float, float]:
  """(long_action_t, lat_action_t) from CarParams.longitudinalActuatorDelay and liveDelay.lateralDelay."""
  return long_actuator_delay + LONG_SMOOTH_SECONDS + ACTION_T_OFFSET, lateral_delay + LAT_SMOOTH_SECONDS + ACTION_T_OFFSET


def model_action_t(long_delay: float, lat_delay: float) -> np.ndarray:
  """master's combined model's action_t input: [[lat_action_t, long_action_t]], s (docs/openpilot-master-and-dm.md §A.6)."""
  long_t, lat_t = action_times(long_delay, lat_delay)
  return np.array([[lat_t, long_t]], np.float32)


def get_action(plan: np.ndarray, prev_action: Action, long_delay: float, lat_delay: float, v_ego: float,
               head: np.ndarray | None = None) -> Action:
  """Action for this frame.

  plan: parsed plan head, (1, 33, 15) or (33, 15). long_delay: CarParams.longitudinalActuatorDelay, lat_delay:
  liveDelay.lateralDelay (the smoothing and step offsets are added here). v_ego: max(carState.vEgo, 0).
  head: master's combined model's `action` output, (1, >=2): [lateral acceleration, acceleration], read directly
  instead of the plan (master's rule, §A.7); the same smoothing follows either way.
  """
  plan = np.asarray(plan)
  if plan.ndim == 3:
    plan = plan[0]
  if plan.shape != (IDX_N, PLAN_WIDTH):
    raise UserError(f"plan must be ({IDX_N}, {PLAN_WIDTH}) (optionally with a batch axis), got {plan.shape}")
  long_t, lat_t = action_times(long_delay, lat_delay)

  if head is not None:
    head = np.asarray(head, np.float32).reshape(-1)
    accel = float(head[1])
    should_stop = bool(v_ego < STOP_SPEED and accel < STOP_ACCEL)
    curvature = float(head[0]) / max(MIN_SPEED, v_ego) ** 2
  else:
    accel, should_stop = get_accel_from_plan(plan[:, Plan.VELOCITY][:, 0], plan[:, Plan.ACCELERATION][:, 0], T_IDXS, long_t)
    curvature = plan_curvature(plan, v_ego, lat_t)
  accel = smooth_value(accel, prev_action.desiredAcceleration, LONG_SMOOTH_SECONDS)

  if v_ego > MIN_LAT_CONTROL_SPEED:
    curvature = smooth_value(curvature, prev_action.desiredCurvature, LAT_SMOOTH_SECONDS)
  else:
    curvature = prev_action.desiredCurvature

  return Action(_f32(curvature), _f32(accel), should_stop)
