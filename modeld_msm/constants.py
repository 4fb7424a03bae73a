"""Model I/O constants of the split driving model (vision + policy): time/distance grids, head widths, index layouts.

Values are the ones openpilot's modeld publishes with; the grids (selfdrive_glue/model_grids.py) are built with the same
Python float expressions so that the numbers on the wire match bit for bit.
"""
from __future__ import annotations

import os

import numpy as np

# the output grids live with the renderer's truth, the lowest layer that uses them
from selfdrive_glue.model_grids import DT_MDL, IDX_N, LEAD_T_IDXS, LEAD_T_OFFSETS, META_T_IDXS, T_IDXS, X_IDXS  # noqa: F401 (re-exported)

# inputs
N_FRAMES = 2
MODEL_RUN_FREQ = 20
MODEL_CONTEXT_FREQ = 5
MODEL_FREQ = MODEL_RUN_FREQ
FEATURE_LEN = 512
DESIRE_LEN = 8
TRAFFIC_CONVENTION_LEN = 2
LATERAL_CONTROL_PARAMS_LEN = 2
PREV_DESIRED_CURV_LEN = 1
INPUT_HISTORY_BUFFER_LEN = 25
FRAME_SKIP = MODEL_RUN_FREQ // MODEL_CONTEXT_FREQ  # 4

# output widths
POSE_WIDTH = 6
WIDE_FROM_DEVICE_WIDTH = 3
LEAD_WIDTH = 4
LANE_LINES_WIDTH = 2
ROAD_EDGES_WIDTH = 2
PLAN_WIDTH = 15
DESIRE_PRED_WIDTH = 8
DESIRED_CURV_WIDTH = 1

NUM_LANE_LINES = 4
NUM_ROAD_EDGES = 2
LEAD_TRAJ_LEN = 6
DESIRE_PRED_LEN = 4

PLAN_MHP_N = 5
PLAN_MHP_SELECTION = 1
LEAD_MHP_N = 2
LEAD_MHP_SELECTION = 3

# forward collision warning: the 2 s hard-brake probability must stay above these for the last N frames
FCW_THRESHOLDS_5MS2 = np.array([.05, .05, .15, .15, .15], dtype=np.float32)
FCW_THRESHOLDS_3MS2 = np.array([.7, .7], dtype=np.float32)
FCW_5MS2_PROBS_WIDTH = len(FCW_THRESHOLDS_5MS2)
FCW_3MS2_PROBS_WIDTH = len(FCW_THRESHOLDS_3MS2)

# confidence (red/yellow/green) from disengage predictions
DISENGAGE_WIDTH = 5
CONFIDENCE_BUFFER_LEN = 5
CONFIDENCE_EVERY_N_FRAMES = 2 * MODEL_FREQ  # 2 s: one disengage-horizon step
RYG_GREEN = 0.01165
RYG_YELLOW = 0.06157

POLY_PATH_DEGREE = 4

# sbigmodel/medmodel outputs land in the 512x256 model frame
MODEL_WIDTH = 512
MODEL_HEIGHT = 256


class Plan:
  """Columns of one plan step (15 wide)."""
  POSITION = slice(0, 3)
  VELOCITY = slice(3, 6)
  ACCELERATION = slice(6, 9)
  T_FROM_CURRENT_EULER = slice(9, 12)
  ORIENTATION_RATE = slice(12, 15)


class Meta:
  """Indices into the 55-wide meta head. The disengage groups are interleaved per 2/4/6/8/10 s horizon."""
  ENGAGED = slice(0, 1)
  # 5 horizons (2..10 s), stride 6
  GAS_DISENGAGE = slice(1, 31, 6)
  BRAKE_DISENGAGE = slice(2, 31, 6)
  STEER_OVERRIDE = slice(3, 31, 6)
  HARD_BRAKE_3 = slice(4, 31, 6)
  HARD_BRAKE_4 = slice(5, 31, 6)
  HARD_BRAKE_5 = slice(6, 31, 6)
  # 6 horizons (0..10 s), stride 4
  GAS_PRESS = slice(31, 55, 4)
  BRAKE_PRESS = slice(32, 55, 4)
  LEFT_BLINKER = slice(33, 55, 4)
  RIGHT_BLINKER = slice(34, 55, 4)


META_WIDTH = 55



def send_raw_pred(env=os.environ) -> bool:
  """openpilot's switch for publishing the raw output vector (rawPredictions) beside the parsed one, in both model
  processes: openpilot tests the variable's truth, so any non-empty value turns it on ("0" too), as there."""
  return bool(env.get("SEND_RAW_PRED"))


SEND_RAW_PRED = send_raw_pred()
