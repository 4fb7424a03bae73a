"""Accuracy against the road the renderer drew: lane-line error in metres at 20 m and the correlation of desiredCurvature
with the curvature the ego path really has at the action time. Used by training, `demo`, `replay` and `regress`.

Both read modelV2-level quantities (lane line y on X_IDXS, action.desiredCurvature), so a geometry bug anywhere between
the camera buffer and the published message — intrinsics, calibration, warp, output slicing, parsing, filling — shows
up here, where comparing two runtimes on the same inputs cannot see it.
"""
from __future__ import annotations

import numpy as np

from modeld_msm.constants import X_IDXS
from selfdrive_glue.road_truth import Truth

LANE_ERROR_DISTANCE = 20.0   # m: far enough that a wrong calibration or intrinsic moves the lines, near enough to be seen well
# what the stand-in model reaches on held-out drives is ~0.1-0.2 m / >0.95; these are the bars a run must clear
LANE_ERROR_LIMIT_M = 0.3
CURVATURE_CORR_LIMIT = 0.9


def lane_errors(lane_y: np.ndarray, truth: Truth, distance: float = LANE_ERROR_DISTANCE) -> np.ndarray:
  """(4,) |predicted - true| lateral position of each lane line `distance` m ahead; lane_y: (4, 33) on X_IDXS."""
  lane_y = np.asarray(lane_y, np.float64)
  pred = np.array([np.interp(distance, X_IDXS, ll) for ll in lane_y])
  return np.abs(pred - truth.lane_y_at(distance))


def summarize(errors: list[np.ndarray], curv_pred: list[float], curv_true: list[float]) -> dict[str, float]:
  """Medians over frames and lines, and Pearson's r of predicted against true desiredCurvature (nan if either is constant)."""
  e = np.concatenate([np.ravel(x) for x in errors]) if errors else np.zeros(0)
  cp, ct = np.asarray(curv_pred, np.float64), np.asarray(curv_true, np.float64)
  ok = np.isfinite(cp) & np.isfinite(ct)
  corr = float(np.corrcoef(cp[ok], ct[ok])[0, 1]) if ok.sum() > 2 and np.std(cp[ok]) > 0 and np.std(ct[ok]) > 0 else float("nan")
  return {"frames": int(len(errors)),
          "lane_error_m_p50": float(np.median(e)) if len(e) else float("nan"),
          "lane_error_m_p90": float(np.percentile(e, 90)) if len(e) else float("nan"),
          "curvature_corr": corr,
          "curvature_mae": float(np.mean(np.abs(cp[ok] - ct[ok]))) if ok.any() else float("nan")}


def passes(summary: dict[str, float]) -> bool:
  return bool(summary["lane_error_m_p50"] <= LANE_ERROR_LIMIT_M and summary["curvature_corr"] >= CURVATURE_CORR_LIMIT)
