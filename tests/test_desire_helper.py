from dataclasses import dataclass

import pytest

from selfdrive_glue.desire_helper import LANE_CHANGE_SPEED_MIN, Desire, DesireHelper, LaneChangeDirection, LaneChangeState

OFF, PRE, STARTING, FINISHING = 0, 1, 2, 3
NONE, LEFT, RIGHT = 0, 1, 2
FAST = 25.0


@dataclass
class CS:
  vEgo: float = FAST
  leftBlinker: bool = False
  rightBlinker: bool = False
  steeringPressed: bool = False
  steeringTorque: float = 0.0
  leftBlindspot: bool = False
  rightBlindspot: bool = False


def step(dh, cs=None, lat_active=True, lc_prob=1.0, n=1):
  for _ in range(n):
    dh.update(cs or CS(), lat_active, lc_prob)
  return dh.lane_change_state, dh.lane_change_direction, dh.desire


def to_pre(dh, left=True):
  step(dh)  # blinker off first so the next frame is a rising edge
  blink = CS(leftBlinker=left, rightBlinker=not left)
  assert step(dh, blink) == (PRE, NONE, 0)
  assert step(dh, blink) == (PRE, LEFT if left else RIGHT, 0)


def to_starting(dh, left=True):
  to_pre(dh, left)
  cs = CS(leftBlinker=left, rightBlinker=not left, steeringPressed=True, steeringTorque=1.0 if left else -1.0)
  assert step(dh, cs) == (STARTING, LEFT if left else RIGHT, 3 if left else 4)
  return cs


def test_enums_match_schema_values():
  assert [int(x) for x in LaneChangeState] == [0, 1, 2, 3]
  assert [int(x) for x in LaneChangeDirection] == [0, 1, 2]
  assert (Desire.none, Desire.turnLeft, Desire.laneChangeLeft, Desire.laneChangeRight, Desire.keepRight) == (0, 1, 3, 4, 6)
  dh = DesireHelper()
  assert (dh.lane_change_state, dh.lane_change_direction, dh.desire) == (0, 0, 0)
  assert type(dh.desire) is int


def test_off_to_pre_on_blinker_rising_edge():
  dh = DesireHelper()
  dh.lane_change_ll_prob = 0.3
  assert step(dh, CS(rightBlinker=True)) == (PRE, NONE, 0)  # direction is set on the next frame, in pre
  assert dh.lane_change_ll_prob == 1.0
  assert step(dh, CS(rightBlinker=True)) == (PRE, RIGHT, 0)


@pytest.mark.parametrize("cs", [
  CS(vEgo=LANE_CHANGE_SPEED_MIN - 0.01, leftBlinker=True),  # too slow
  CS(leftBlinker=True, rightBlinker=True),  # hazards
  CS(),  # no blinker
])
def test_off_stays_off(cs):
  dh = DesireHelper()
  assert step(dh, cs) == (OFF, NONE, 0)


def test_held_blinker_does_not_arm_again():
  dh = DesireHelper()
  step(dh, CS(vEgo=5.0, leftBlinker=True))  # blinker comes on while too slow
  assert step(dh, CS(leftBlinker=True), n=5) == (OFF, NONE, 0)  # no new edge once fast
  step(dh)
  assert step(dh, CS(leftBlinker=True))[0] == PRE
  assert LANE_CHANGE_SPEED_MIN == pytest.approx(20 * 0.44704)
  dh2 = DesireHelper()
  assert step(dh2, CS(vEgo=LANE_CHANGE_SPEED_MIN, leftBlinker=True))[0] == PRE  # at the minimum counts


def test_pre_back_to_off():
  dh = DesireHelper()
  to_pre(dh)
  assert step(dh, CS()) == (OFF, NONE, 0)  # blinker released
  dh = DesireHelper()
  to_pre(dh)
  assert step(dh, CS(vEgo=5.0, leftBlinker=True)) == (OFF, NONE, 0)  # slowed down
  dh = DesireHelper()
  to_pre(dh)
  assert step(dh, CS(leftBlinker=True, rightBlinker=True)) == (OFF, NONE, 0)


@pytest.mark.parametrize("left", [True, False])
def test_pre_to_starting_needs_matching_torque_and_clear_blindspot(left):
  blink = dict(leftBlinker=left, rightBlinker=not left)
  good = 1.0 if left else -1.0
  dh = DesireHelper()
  to_pre(dh, left)
  d = LEFT if left else RIGHT
  assert step(dh, CS(**blink, steeringPressed=True, steeringTorque=-good)) == (PRE, d, 0)  # wrong way
  assert step(dh, CS(**blink, steeringPressed=False, steeringTorque=good)) == (PRE, d, 0)  # not pressed
  assert step(dh, CS(**blink, steeringPressed=True, steeringTorque=0.0)) == (PRE, d, 0)
  spot = dict(leftBlindspot=True) if left else dict(rightBlindspot=True)
  assert step(dh, CS(**blink, **spot, steeringPressed=True, steeringTorque=good)) == (PRE, d, 0)
  other = dict(rightBlindspot=True) if left else dict(leftBlindspot=True)
  assert step(dh, CS(**blink, **other, steeringPressed=True, steeringTorque=good)) == (STARTING, d, 3 if left else 4)


def test_starting_fades_lane_lines_then_finishes():
  dh = DesireHelper()
  cs = to_starting(dh)
  assert dh.lane_change_ll_prob == pytest.approx(1.0)  # fading starts on the next frame
  assert dh.lane_change_timer == pytest.approx(0.05)
  # model still sees the lane change: stays in starting, ll_prob floors at 0
  step(dh, cs, lc_prob=0.5, n=15)
  assert dh.lane_change_state == STARTING and dh.lane_change_ll_prob == 0.0
  assert step(dh, cs, lc_prob=0.019) == (FINISHING, LEFT, 3)


def test_starting_waits_for_lane_lines_to_fade():
  dh = DesireHelper()
  cs = to_starting(dh)
  for i in range(9):
    assert step(dh, cs, lc_prob=0.0)[0] == STARTING, i
    assert dh.lane_change_ll_prob == pytest.approx(1 - 0.1 * (i + 1))
  assert step(dh, cs, lc_prob=0.0)[0] == FINISHING


def _to_finishing(dh, left=True):
  cs = to_starting(dh, left)
  step(dh, cs, lc_prob=0.0, n=10)
  assert dh.lane_change_state == FINISHING
  return cs


@pytest.mark.parametrize("blinker_held,end_state", [(True, PRE), (False, OFF)])
def test_finishing_fades_in_and_ends(blinker_held, end_state):
  dh = DesireHelper()
  cs = _to_finishing(dh, left=False)
  if not blinker_held:
    cs = CS()
  prob = dh.lane_change_ll_prob
  for _ in range(19):
    assert step(dh, cs, lc_prob=0.0) == (FINISHING, RIGHT, 4)
    assert dh.lane_change_ll_prob == pytest.approx(min(prob + 0.05, 1.0))
    prob = dh.lane_change_ll_prob
  assert step(dh, cs, lc_prob=0.0) == (end_state, NONE, 0)
  assert dh.lane_change_timer == 0.0


def test_reset_when_lateral_inactive():
  for setup in (to_pre, to_starting, _to_finishing):
    dh = DesireHelper()
    setup(dh)
    assert step(dh, CS(leftBlinker=True), lat_active=False) == (OFF, NONE, 0)
    assert dh.lane_change_timer == 0.0


def test_reset_after_ten_seconds():
  dh = DesireHelper()
  cs = to_starting(dh)
  # the model never confirms the change: 10 s in starting, then give up
  n = 0
  while dh.lane_change_state == STARTING:
    step(dh, cs, lc_prob=0.9)
    n += 1
    assert n < 250
  assert dh.lane_change_state == OFF and dh.desire == 0
  assert 199 <= n + 1 <= 202  # timer counted from the transition frame, reset once it exceeds 10 s
  # the blinker is still held: no new lane change until it is released and set again
  assert step(dh, cs, n=3)[0] == OFF


def test_timer_runs_only_while_changing():
  dh = DesireHelper()
  to_pre(dh)
  step(dh, CS(leftBlinker=True), n=30)
  assert dh.lane_change_state == PRE and dh.lane_change_timer == 0.0
  cs = CS(leftBlinker=True, steeringPressed=True, steeringTorque=1.0)
  step(dh, cs, lc_prob=0.9, n=4)
  assert dh.lane_change_timer == pytest.approx(0.2)


def test_enums_match_the_cereal_schema():
  from selfdrive_glue import messaging
  for ours, theirs in ((LaneChangeState, messaging.log.LaneChangeState), (LaneChangeDirection, messaging.log.LaneChangeDirection),
                       (Desire, messaging.log.Desire)):
    assert {e.name: int(e) for e in ours} == dict(theirs.schema.enumerants)


def _capnp_carstate(**fields):
  from selfdrive_glue import messaging
  ev = messaging.new_message("carState")
  for k, v in fields.items():
    setattr(ev.carState, k, v)
  return messaging.log_from_bytes(ev.to_bytes()).carState


def test_reads_a_capnp_carstate():
  dh = DesireHelper()
  dh.update(_capnp_carstate(vEgo=FAST), True, 1.0)
  blink = _capnp_carstate(vEgo=FAST, leftBlinker=True)
  dh.update(blink, True, 1.0)
  dh.update(blink, True, 1.0)
  assert (dh.lane_change_state, dh.lane_change_direction) == (PRE, LEFT)
  dh.update(_capnp_carstate(vEgo=FAST, leftBlinker=True, steeringPressed=True, steeringTorque=2.0), True, 1.0)
  assert (dh.lane_change_state, dh.desire) == (STARTING, 3)


def test_blindspot_read_from_a_real_carstate_message():
  from selfdrive_glue import messaging

  def carstate(**kw):
    ev = messaging.new_message("carState", valid=True)
    for k, v in {"vEgo": FAST, "leftBlinker": True, **kw}.items():
      setattr(ev.carState, k, v)
    return messaging.log_from_bytes(ev.to_bytes()).carState
  dh = DesireHelper()
  step(dh)
  step(dh, carstate(), n=2)
  assert (dh.lane_change_state, dh.lane_change_direction) == (PRE, LEFT)
  step(dh, carstate(steeringPressed=True, steeringTorque=1.0, leftBlindspot=True))
  assert dh.lane_change_state == PRE          # a car in the left blind spot holds the change
  step(dh, carstate(steeringPressed=True, steeringTorque=1.0))
  assert dh.lane_change_state == STARTING
