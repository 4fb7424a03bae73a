"""Lane-change state machine that turns blinker + steering torque into the model's desire input.

`update()` reads plain attributes (vEgo, leftBlinker, rightBlinker, steeringPressed, steeringTorque, leftBlindspot,
rightBlindspot), so a capnp CarState reader and a test object both work. States, directions and desires are the ints
of the cereal enums (LaneChangeState, LaneChangeDirection, Desire).
"""
from __future__ import annotations

from enum import IntEnum

from selfdrive_glue.model_grids import DT_MDL

MPH_TO_MS = 0.44704
LANE_CHANGE_SPEED_MIN = 20 * MPH_TO_MS  # m/s
LANE_CHANGE_TIME_MAX = 10.  # s in starting/finishing before giving up
LANE_CHANGE_PROB_DONE = 0.02  # model's lane-change desire below this = the car is in the new lane
LL_PROB_FADE_OUT_RATE = 2 * DT_MDL  # lane lines hidden within 0.5 s of starting
LL_PROB_FADE_IN_RATE = DT_MDL  # and back within 1 s of finishing


class LaneChangeState(IntEnum):
  off = 0
  preLaneChange = 1
  laneChangeStarting = 2
  laneChangeFinishing = 3


class LaneChangeDirection(IntEnum):
  none = 0
  left = 1
  right = 2


class Desire(IntEnum):
  none = 0
  turnLeft = 1
  turnRight = 2
  laneChangeLeft = 3
  laneChangeRight = 4
  keepLeft = 5
  keepRight = 6


class DesireHelper:
  def __init__(self):
    self.lane_change_state = int(LaneChangeState.off)
    self.lane_change_direction = int(LaneChangeDirection.none)
    self.lane_change_timer = 0.
    self.lane_change_ll_prob = 1.
    self.prev_one_blinker = False
    self.desire = int(Desire.none)

  def update(self, carstate, lateral_active: bool, lane_change_prob: float) -> None:
    v_ego = carstate.vEgo
    left, right = bool(carstate.leftBlinker), bool(carstate.rightBlinker)
    one_blinker = left != right
    below_lane_change_speed = v_ego < LANE_CHANGE_SPEED_MIN
    state = self.lane_change_state

    if not lateral_active or self.lane_change_timer > LANE_CHANGE_TIME_MAX:
      state = LaneChangeState.off
      self.lane_change_direction = LaneChangeDirection.none
    elif state == LaneChangeState.off:
      # only a fresh blinker arms a lane change, so holding it through one change does not start the next
      if one_blinker and not self.prev_one_blinker and not below_lane_change_speed:
        state = LaneChangeState.preLaneChange
        self.lane_change_ll_prob = 1.
    elif state == LaneChangeState.preLaneChange:
      self.lane_change_direction = LaneChangeDirection.left if left else LaneChangeDirection.right
      going_left = self.lane_change_direction == LaneChangeDirection.left
      torque = carstate.steeringTorque
      # positive torque steers left
      torque_applied = bool(carstate.steeringPressed) and ((torque > 0 and going_left) or (torque < 0 and not going_left))
      # cars without blind-spot monitoring (and schemas without the fields) report no blind-spot car
      blindspot = bool(getattr(carstate, "leftBlindspot" if going_left else "rightBlindspot", False))
      if not one_blinker or below_lane_change_speed:
        state = LaneChangeState.off
        self.lane_change_direction = LaneChangeDirection.none
      elif torque_applied and not blindspot:
        state = LaneChangeState.laneChangeStarting
    elif state == LaneChangeState.laneChangeStarting:
      self.lane_change_ll_prob = max(self.lane_change_ll_prob - LL_PROB_FADE_OUT_RATE, 0.)
      if lane_change_prob < LANE_CHANGE_PROB_DONE and self.lane_change_ll_prob < 0.01:
        state = LaneChangeState.laneChangeFinishing
    elif state == LaneChangeState.laneChangeFinishing:
      self.lane_change_ll_prob = min(self.lane_change_ll_prob + LL_PROB_FADE_IN_RATE, 1.)
      if self.lane_change_ll_prob > 0.99:
        self.lane_change_direction = LaneChangeDirection.none
        state = LaneChangeState.preLaneChange if one_blinker else LaneChangeState.off

    if state in (LaneChangeState.off, LaneChangeState.preLaneChange):
      self.lane_change_timer = 0.
    else:
      self.lane_change_timer += DT_MDL

    self.prev_one_blinker = one_blinker
    self.lane_change_state = int(state)
    self.lane_change_direction = int(self.lane_change_direction)

    changing = state in (LaneChangeState.laneChangeStarting, LaneChangeState.laneChangeFinishing)
    if changing and self.lane_change_direction == LaneChangeDirection.left:
      self.desire = int(Desire.laneChangeLeft)
    elif changing and self.lane_change_direction == LaneChangeDirection.right:
      self.desire = int(Desire.laneChangeRight)
    else:
      self.desire = int(Desire.none)
