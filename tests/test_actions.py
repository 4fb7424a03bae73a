import math

import numpy as np
import pytest

from modeld_msm.actions import (
  Action,
  action_times,
  get_accel_from_plan,
  get_action,
  get_curvature_from_plan,
  model_action_t,
  smooth_value,
)
from modeld_msm.constants import DT_MDL, T_IDXS, Plan
from selfdrive_glue.errors import UserError
from selfdrive_glue.filters import FirstOrderFilter, FrameDropFilter

T = np.array(T_IDXS)
ALPHA_LONG = 1 - math.exp(-0.05 / 0.3)


def make_plan(v=None, a=None, yaw=None, yaw_rate=None) -> np.ndarray:
  plan = np.zeros((1, 33, 15), np.float32)
  for cols, val in ((Plan.VELOCITY, v), (Plan.ACCELERATION, a), (Plan.T_FROM_CURRENT_EULER, yaw), (Plan.ORIENTATION_RATE, yaw_rate)):
    if val is not None:
      col = cols.start + (0 if cols in (Plan.VELOCITY, Plan.ACCELERATION) else 2)
      plan[0, :, col] = val
  return plan


def test_grids():
  assert len(T_IDXS) == 33 and T_IDXS[0] == 0 and T_IDXS[-1] == 10.0
  assert T_IDXS[1] == pytest.approx(10 / 32 ** 2)


def test_action_times():
  long_t, lat_t = action_times(0.15, 0.2)
  assert long_t == pytest.approx(0.15 + 0.3 + 0.075)
  assert lat_t == pytest.approx(0.2 + 0.075)


def test_accel_linear_speed_plan():
  # v = 5 + 2t, a = 2: constant acceleration is reproduced at any horizon
  for t in (0.15, 0.5, 1.2):
    a, stop = get_accel_from_plan(5 + 2 * T, np.full(33, 2.0), T, t)
    assert a == pytest.approx(2.0, abs=1e-9)
    assert not stop
  # same speeds but the plan claims a0 = 0: constant-jerk inversion gives 2 * 2 - 0
  a, _ = get_accel_from_plan(5 + 2 * T, np.zeros(33), T, 0.6)
  assert a == pytest.approx(4.0, abs=1e-9)


def test_accel_short_horizon_interpolates_from_now():
  # the plan jumps from 0 to 1 m/s within its first step; below 0.3 s the target is scaled along 0 -> v(0.3)
  v = np.ones(33)
  v[0] = 0
  a_short, _ = get_accel_from_plan(v, np.zeros(33), T, 0.15)
  assert a_short == pytest.approx(2 * 0.5 / 0.15)
  a_long, _ = get_accel_from_plan(v, np.zeros(33), T, 0.4)
  assert a_long == pytest.approx(2 * 1 / 0.4)


@pytest.mark.parametrize("v0,slope,expected", [
  (0.2, 0.0, True),     # standing, plan stays
  (0.2, -0.5, True),    # creeping, plan brakes
  (0.2, 1.0, False),    # standing, plan pulls away (a_target 1.0 >= 0.1)
  (0.5, -0.5, False),   # still moving
  (0.0, 0.04, True),    # a_target 0.04 < 0.1
])
def test_should_stop(v0, slope, expected):
  v = np.maximum(v0 + slope * T, 0)
  a = np.full(33, slope if v0 > 0 or slope > 0 else 0.0)
  _, stop = get_accel_from_plan(v, a, T, 0.5)
  assert stop is expected


def test_curvature_constant_yaw_rate():
  r = 0.1  # rad/s
  for v_ego in (10.0, 25.0):
    k = get_curvature_from_plan(r * T, np.full(33, r), T, v_ego, 0.5)
    assert k == pytest.approx(r / v_ego, rel=1e-9)
  # below 1 m/s the speed is floored
  assert get_curvature_from_plan(r * T, np.full(33, r), T, 0.5, 0.5) == pytest.approx(r / 1.0)
  # heading builds up from a zero rate: curvature is twice the average
  assert get_curvature_from_plan(0.3 * T, np.zeros(33), T, 10.0, 0.5) == pytest.approx(2 * 0.3 / 10)


def test_curvature_short_horizon_scales_from_zero_heading():
  yaw = np.full(33, 0.01)
  yaw[0] = 0
  k = get_curvature_from_plan(yaw, np.zeros(33), T, 10.0, 0.15)
  assert k == pytest.approx(2 * (0.5 * 0.01) / (10.0 * 0.15))


def test_get_action_from_plan():
  plan = make_plan(v=5 + 2 * T, a=2.0, yaw=0.05 * T, yaw_rate=0.05)
  act = get_action(plan, Action(), long_delay=0.15, lat_delay=0.2, v_ego=5.0)
  assert isinstance(act, tuple) and len(act) == 3
  curv, accel, stop = act
  assert accel == pytest.approx(ALPHA_LONG * 2.0, rel=1e-6)
  assert curv == pytest.approx(0.05 / 5.0, rel=1e-6)  # lateral is not smoothed
  assert stop is False
  # stored as float32, like the capnp Action the next frame smooths against
  assert np.float32(accel) == accel and np.float32(curv) == curv
  # the long filter converges geometrically
  prev = Action()
  for n in range(1, 30):
    prev = get_action(plan, prev, 0.15, 0.2, 5.0)
    assert prev.desiredAcceleration == pytest.approx(2.0 * (1 - (1 - ALPHA_LONG) ** n), rel=1e-5)
  # a (33, 15) plan without batch axis works too
  assert get_action(plan[0], Action(), 0.15, 0.2, 5.0) == act


def test_get_action_holds_curvature_when_slow():
  plan = make_plan(v=np.zeros(33), a=0.0, yaw=0.5 * T, yaw_rate=0.5)
  prev = Action(desiredCurvature=0.0123, desiredAcceleration=-1.0, shouldStop=False)
  act = get_action(plan, prev, 0.1, 0.1, v_ego=0.3)
  assert act.desiredCurvature == np.float32(0.0123)
  assert act.shouldStop is True
  assert act.desiredAcceleration == pytest.approx((1 - ALPHA_LONG) * -1.0, rel=1e-6)
  act = get_action(plan, prev, 0.1, 0.1, v_ego=0.31)
  assert act.desiredCurvature == pytest.approx(0.5 / 1.0, rel=1e-6)


def test_get_action_from_masters_action_head():
  """master's combined model (docs §A.7): accel = action[0,1], curvature = action[0,0] / max(1, v)^2, shouldStop = v < 0.3
  and accel < 0.1, then the plan's smoothing; the plan itself is not read."""
  plan = make_plan(v=5 + 2 * T, a=2.0, yaw=0.05 * T, yaw_rate=0.05)   # a plan that would give other numbers
  head = np.array([[0.9, -0.4, -2.0, -2.0]], np.float32)
  curv, accel, stop = get_action(plan, Action(), 0.15, 0.2, v_ego=3.0, head=head)
  assert accel == pytest.approx(ALPHA_LONG * -0.4, rel=1e-6) and curv == pytest.approx(0.9 / 9.0, rel=1e-6) and stop is False
  assert get_action(plan, Action(), 0.15, 0.2, v_ego=0.5, head=head).desiredCurvature == pytest.approx(0.9, rel=1e-6)   # max(1, v)
  # slow: the curvature is held, and a braking head below STOP_SPEED stops (on the raw accel, before smoothing)
  slow = get_action(plan, Action(0.01, 0.0, False), 0.15, 0.2, v_ego=0.29, head=np.array([[0.9, 0.09]], np.float32))
  assert slow.desiredCurvature == np.float32(0.01) and slow.shouldStop is True
  assert get_action(plan, Action(), 0.15, 0.2, v_ego=0.3, head=np.array([[0.0, 0.09]], np.float32)).shouldStop is False
  assert get_action(plan, Action(), 0.15, 0.2, v_ego=0.2, head=np.array([[0.0, 0.1]], np.float32)).shouldStop is False


def test_model_action_t_is_lateral_then_longitudinal():
  lat_t, long_t = model_action_t(long_delay=0.15, lat_delay=0.2)[0]
  assert lat_t == pytest.approx(0.2 + 0.0 + 0.075) and long_t == pytest.approx(0.15 + 0.3 + 0.075)


def test_bad_plans_are_user_errors():
  with pytest.raises(UserError, match=r"\(33, 15\)"):
    get_action(np.zeros((1, 32, 15), np.float32), Action(), 0.1, 0.1, 1.0)
  with pytest.raises(UserError):
    get_accel_from_plan(np.zeros(10), np.zeros(10), T, 0.5)


def test_smooth_value():
  assert smooth_value(1.0, 0.0, 0.0) == 1.0
  assert smooth_value(1.0, 0.0, 0.3) == pytest.approx(ALPHA_LONG)
  assert smooth_value(1.0, 0.0, 0.3, dt=0.1) == pytest.approx(1 - math.exp(-0.1 / 0.3))


def test_first_order_filter():
  f = FirstOrderFilter(0., 10., DT_MDL)
  assert f.k == pytest.approx(0.004975, abs=1e-6)
  assert f.update(1.0) == pytest.approx(f.k)
  assert f.update(1.0) == pytest.approx(f.k + (1 - f.k) * f.k)
  g = FirstOrderFilter(0., 10., DT_MDL, initialized=False)
  assert g.update(3.0) == 3.0 and g.initialized
  assert g.update(0.0) == pytest.approx(3.0 * (1 - g.k))


def test_frame_drop_filter_warmup_and_clip():
  f = FrameDropFilter()
  for _ in range(10):
    assert f.update(5) == 0.0
  k = (0.05 / 10) / (1 + 0.05 / 10)
  assert f.update(1) == pytest.approx(k / (1 + k))
  g = FrameDropFilter()
  for _ in range(10):
    g.update(0)
  h = FrameDropFilter()
  for _ in range(10):
    h.update(0)
  assert g.update(50) == h.update(10)  # drops are clipped at 10 per frame
  # steady 1 dropped per frame -> filter tends to 1 -> ratio 0.5
  for _ in range(5000):
    r = f.update(1)
  assert r == pytest.approx(0.5, rel=1e-6)
