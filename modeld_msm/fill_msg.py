"""Fill modelV2, drivingModelData and cameraOdometry Events from the parsed model outputs.

Builders are Event builders from `messaging.new_message(service)`; the functions set `.valid` and the union member.
`PublishState` carries what spans frames: the disengage-confidence buffer and the hard-brake (FCW) histories.
"""
from __future__ import annotations

import numpy as np

from modeld_msm import constants as C
from modeld_msm.constants import Meta, Plan

# times along lane lines/road edges are not used by consumers; openpilot publishes them empty
LINE_T_IDXS: list[float] = []
X_IDXS = np.array(C.X_IDXS)
CONFIDENCE_CLASSES = ("red", "yellow", "green")


class PublishState:
  def __init__(self):
    self.disengage_buffer = np.zeros(C.CONFIDENCE_BUFFER_LEN * C.DISENGAGE_WIDTH, dtype=np.float32)
    self.prev_brake_5ms2_probs = np.zeros(C.FCW_5MS2_PROBS_WIDTH, dtype=np.float32)
    self.prev_brake_3ms2_probs = np.zeros(C.FCW_3MS2_PROBS_WIDTH, dtype=np.float32)


def _member(event, service: str):
  if event.which() != service:
    event.init(service)
  return getattr(event, service)


def _fill_xyzt(builder, t, x, y, z, x_std=None, y_std=None, z_std=None) -> None:
  builder.t = list(t)
  builder.x = x.tolist()
  builder.y = y.tolist()
  builder.z = z.tolist()
  if x_std is not None:
    builder.xStd = x_std.tolist()
    builder.yStd = y_std.tolist()
    builder.zStd = z_std.tolist()


def _fill_xyvat(builder, t, x, y, v, a, x_std, y_std, v_std, a_std) -> None:
  builder.t = list(t)
  builder.x, builder.y, builder.v, builder.a = x.tolist(), y.tolist(), v.tolist(), a.tolist()
  builder.xStd, builder.yStd, builder.vStd, builder.aStd = x_std.tolist(), y_std.tolist(), v_std.tolist(), a_std.tolist()


def _fill_action(builder, action) -> None:
  builder.desiredCurvature = float(action.desiredCurvature)
  builder.desiredAcceleration = float(action.desiredAcceleration)
  builder.shouldStop = bool(action.shouldStop)


def _fill_poly_path(builder, x, y, z) -> None:
  # drivingModelData is the small message: the path travels as degree-4 polynomials over time instead of 3x33 points
  coeffs = np.polynomial.polynomial.polyfit(C.T_IDXS, np.stack([x, y, z], axis=1), deg=C.POLY_PATH_DEGREE)
  builder.xCoefficients = coeffs[:, 0].tolist()
  builder.yCoefficients = coeffs[:, 1].tolist()
  builder.zCoefficients = coeffs[:, 2].tolist()


def hard_brake_predicted(publish_state: PublishState, meta: np.ndarray) -> bool:
  """Shift the 2 s hard-brake probabilities into the histories; FCW when every kept value is over its threshold."""
  s = publish_state
  s.prev_brake_5ms2_probs[:-1] = s.prev_brake_5ms2_probs[1:]
  s.prev_brake_5ms2_probs[-1] = meta[Meta.HARD_BRAKE_5][0]
  s.prev_brake_3ms2_probs[:-1] = s.prev_brake_3ms2_probs[1:]
  s.prev_brake_3ms2_probs[-1] = meta[Meta.HARD_BRAKE_3][0]
  return bool((s.prev_brake_5ms2_probs > C.FCW_THRESHOLDS_5MS2).all() and (s.prev_brake_3ms2_probs > C.FCW_THRESHOLDS_3MS2).all())


def update_confidence(publish_state: PublishState, meta: np.ndarray, vipc_frame_id: int) -> str:
  """Every 2 s push this frame's per-slice disengage probabilities; score = mean over the diagonal that lines up
  each past prediction's slice with now. Returns 'green', 'yellow' or 'red'."""
  buf, w = publish_state.disengage_buffer, C.DISENGAGE_WIDTH
  if vipc_frame_id % C.CONFIDENCE_EVERY_N_FRAMES == 0:
    any_disengage = 1 - ((1 - meta[Meta.BRAKE_DISENGAGE]) * (1 - meta[Meta.GAS_DISENGAGE]) * (1 - meta[Meta.STEER_OVERRIDE]))
    # P(disengage in slice i | none before it)
    per_slice = np.r_[any_disengage[0], np.diff(any_disengage) / (1 - any_disengage[:-1])]
    buf[:-w] = buf[w:]
    buf[-w:] = per_slice
  score = 0.
  for i in range(w):
    score += buf[i * w + w - 1 - i].item() / w
  if score < C.RYG_GREEN:
    return "green"
  if score < C.RYG_YELLOW:
    return "yellow"
  return "red"


def fill_model_msg(modelv2_builder, drivingdata_builder, net_output_data: dict[str, np.ndarray], action,
                   publish_state: PublishState, vipc_frame_id: int, vipc_frame_id_extra: int, frame_id: int, frame_drop: float,
                   timestamp_eof: int, model_execution_time: float, valid: bool) -> None:
  """Fill both Events. frame_id is roadCameraState.frameId (for frameAge); frame_drop is the ratio (0..1)."""
  out = net_output_data
  frame_age = frame_id - vipc_frame_id if frame_id > vipc_frame_id else 0
  frame_drop_perc = frame_drop * 100
  modelv2_builder.valid = bool(valid)
  drivingdata_builder.valid = bool(valid)
  plan, plan_stds = out["plan"][0], out["plan_stds"][0]
  meta = out["meta"][0]

  dmd = _member(drivingdata_builder, "drivingModelData")
  dmd.frameId = vipc_frame_id
  dmd.frameIdExtra = vipc_frame_id_extra
  dmd.frameDropPerc = frame_drop_perc
  dmd.modelExecutionTime = model_execution_time
  # master's `big`: whether the Chestnut eGPU model drove; never on the comma GPU (a false Bool writes no bytes: 0.11 reads it the same)
  dmd.big = False
  _fill_action(dmd.action, action)

  m = _member(modelv2_builder, "modelV2")
  m.frameId = vipc_frame_id
  m.frameIdExtra = vipc_frame_id_extra
  m.frameAge = frame_age
  m.frameDropPerc = frame_drop_perc
  m.timestampEof = timestamp_eof
  m.modelExecutionTime = model_execution_time
  m.big = False

  _fill_xyzt(m.position, C.T_IDXS, *plan[:, Plan.POSITION].T, *plan_stds[:, Plan.POSITION].T)
  _fill_xyzt(m.velocity, C.T_IDXS, *plan[:, Plan.VELOCITY].T)
  _fill_xyzt(m.acceleration, C.T_IDXS, *plan[:, Plan.ACCELERATION].T)
  _fill_xyzt(m.orientation, C.T_IDXS, *plan[:, Plan.T_FROM_CURRENT_EULER].T)
  _fill_xyzt(m.orientationRate, C.T_IDXS, *plan[:, Plan.ORIENTATION_RATE].T)
  _fill_poly_path(dmd.path, *plan[:, Plan.POSITION].T)
  _fill_action(m.action, action)

  lane_lines, road_edges = out["lane_lines"][0], out["road_edges"][0]
  m.init("laneLines", C.NUM_LANE_LINES)
  for i in range(C.NUM_LANE_LINES):
    _fill_xyzt(m.laneLines[i], LINE_T_IDXS, X_IDXS, lane_lines[i, :, 0], lane_lines[i, :, 1])
  m.laneLineStds = out["lane_lines_stds"][0, :, 0, 0].tolist()
  m.laneLineProbs = out["lane_lines_prob"][0, 1::2].tolist()  # [not-visible, visible] pairs per line

  llm = dmd.laneLineMeta
  llm.leftY = m.laneLines[1].y[0]
  llm.leftProb = m.laneLineProbs[1]
  llm.rightY = m.laneLines[2].y[0]
  llm.rightProb = m.laneLineProbs[2]

  m.init("roadEdges", C.NUM_ROAD_EDGES)
  for i in range(C.NUM_ROAD_EDGES):
    _fill_xyzt(m.roadEdges[i], LINE_T_IDXS, X_IDXS, road_edges[i, :, 0], road_edges[i, :, 1])
  m.roadEdgeStds = out["road_edges_stds"][0, :, 0, 0].tolist()

  # both contracts fill leads as 0.11 does (every std, probTime). Master's fill_model_msg dropped aStd and probTime for a
  # while (@93159c4f, still on liveCalibration) and fills both again at its newest (@0b6bf541, on extrinsicsCalibration)
  lead, lead_stds, lead_prob = out["lead"][0], out["lead_stds"][0], out["lead_prob"][0]
  m.init("leadsV3", C.LEAD_MHP_SELECTION)
  for i in range(C.LEAD_MHP_SELECTION):
    ld = m.leadsV3[i]
    _fill_xyvat(ld, C.LEAD_T_IDXS, *lead[i].T, *lead_stds[i].T)
    ld.prob = lead_prob[i].item()
    ld.probTime = C.LEAD_T_OFFSETS[i]

  md = m.meta
  md.desireState = out["desire_state"][0].reshape(-1).tolist()
  md.desirePrediction = out["desire_pred"][0].reshape(-1).tolist()
  md.engagedProb = meta[Meta.ENGAGED].item()
  dp = md.init("disengagePredictions")
  dp.t = C.META_T_IDXS
  dp.brakeDisengageProbs = meta[Meta.BRAKE_DISENGAGE].tolist()
  dp.gasDisengageProbs = meta[Meta.GAS_DISENGAGE].tolist()
  dp.steerOverrideProbs = meta[Meta.STEER_OVERRIDE].tolist()
  dp.brake3MetersPerSecondSquaredProbs = meta[Meta.HARD_BRAKE_3].tolist()
  dp.brake4MetersPerSecondSquaredProbs = meta[Meta.HARD_BRAKE_4].tolist()
  dp.brake5MetersPerSecondSquaredProbs = meta[Meta.HARD_BRAKE_5].tolist()
  dp.gasPressProbs = meta[Meta.GAS_PRESS].tolist()
  dp.brakePressProbs = meta[Meta.BRAKE_PRESS].tolist()
  md.hardBrakePredicted = hard_brake_predicted(publish_state, meta)

  m.confidence = update_confidence(publish_state, meta, vipc_frame_id)

  if "raw_pred" in out:  # present only when the loop runs with SEND_RAW_PRED
    m.rawPredictions = np.ascontiguousarray(out["raw_pred"]).tobytes()


def fill_lane_change(modelv2_builder, drivingdata_builder, lane_change_state: int, lane_change_direction: int) -> None:
  """Copy the DesireHelper state (updated after fill_model_msg) into both meta structs."""
  for meta in (_member(modelv2_builder, "modelV2").meta, _member(drivingdata_builder, "drivingModelData").meta):
    meta.laneChangeState = int(lane_change_state)
    meta.laneChangeDirection = int(lane_change_direction)


def fill_pose_msg(odometry_builder, net_output_data: dict[str, np.ndarray], vipc_frame_id: int, vipc_dropped_frames: int,
                  timestamp_eof: int, live_calib_seen: bool) -> None:
  out = net_output_data
  # odometry across a dropped frame spans two frame intervals: consumers must not integrate it as one
  odometry_builder.valid = bool(live_calib_seen) and vipc_dropped_frames < 1
  co = _member(odometry_builder, "cameraOdometry")
  co.frameId = vipc_frame_id
  co.timestampEof = timestamp_eof
  pose, pose_stds = out["pose"][0], out["pose_stds"][0]
  co.trans = pose[:3].tolist()
  co.rot = pose[3:].tolist()
  co.transStd = pose_stds[:3].tolist()
  co.rotStd = pose_stds[3:].tolist()
  co.wideFromDeviceEuler = out["wide_from_device_euler"][0, :].tolist()
  co.wideFromDeviceEulerStd = out["wide_from_device_euler_stds"][0, :].tolist()
  co.roadTransformTrans = out["road_transform"][0, :3].tolist()
  co.roadTransformTransStd = out["road_transform_stds"][0, :3].tolist()


def lane_change_prob(modelv2_builder) -> float:
  """DesireHelper's input: P(laneChangeLeft) + P(laneChangeRight) as published in meta.desireState."""
  desire_state = _member(modelv2_builder, "modelV2").meta.desireState
  return desire_state[3] + desire_state[4]
