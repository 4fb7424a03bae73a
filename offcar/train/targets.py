"""The renderer's truth as per-column training targets for the vision and policy outputs, and the losses on them.

Mixture-density heads (lane lines, road edges, lead, pose, plan) are [mu..., log_std...] blocks: mu is trained with an L1
in units of the column's spread over the data; log_std with a Laplace likelihood of the (detached) mu error, so the
reported stds mean something. Probability heads are logits under a binary cross-entropy. Columns without a truth (meta,
desire predictions, wide_from_device_euler, road_transform, desire_state) carry no loss and keep their initial function.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from compile.refmodels.driving import POLICY_SLICES, POLICY_WIDTH, VISION_SLICES, VISION_WIDTH
from selfdrive_glue.road_truth import CAM_HEIGHT, Truth

# weights of plan columns (Plan layout: position, velocity, acceleration, euler, euler rate, 3 each)
_PLAN_WEIGHT = np.full(15, 0.1)
_PLAN_WEIGHT[[0, 1, 3, 6, 11, 14]] = 1.0   # x, y, vx, ax, yaw, yaw rate: what actions and the UI read
# smallest spread per plan column: the first row of the plan is exactly 0 for most columns
_PLAN_FLOOR = np.array([.05, .05, .05, .05, .05, .05, .05, .05, .05, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3])


@dataclass
class Targets:
  y: np.ndarray                 # (N, W) float32: the target of every trained column (mu columns and probability logits)
  w: np.ndarray                 # (N, W) float32: loss weight per sample and column (0: no loss)
  mdn: list[tuple[int, int, int]] = field(default_factory=list)   # (mu start, log_std start, n) blocks
  bce: list[tuple[int, int]] = field(default_factory=list)        # (start, n) logit blocks
  floor: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))   # smallest spread per mu column

  def __post_init__(self):
    if len(self.floor) != self.y.shape[1]:
      self.floor = np.full(self.y.shape[1], 1e-2, np.float32)

  def affine(self) -> tuple[np.ndarray, np.ndarray]:
    """Per output column (scale, offset) for the output fold: mu -> the targets' spread and mean (weighted), log_std ->
    offset at the log of a fifth of the spread; probability logits and untrained columns stay (1, 0)."""
    width = self.y.shape[1]
    scale, offset = np.ones(width, np.float32), np.zeros(width, np.float32)
    for mu, ls, n in self.mdn:
      sl = slice(mu, mu + n)
      w = self.w[:, sl]
      tot = np.maximum(w.sum(0), 1e-9)
      mean = (self.y[:, sl] * w).sum(0) / tot
      std = np.sqrt(((self.y[:, sl] - mean) ** 2 * w).sum(0) / tot)
      scale[sl] = np.maximum(std, self.floor[sl])
      offset[sl] = mean
      offset[ls:ls + n] = np.log(scale[sl] / 5)
    return scale, offset


def mdn(t: Targets, sl: slice, values: np.ndarray, weights: np.ndarray, floor: np.ndarray | float) -> None:
  n = (sl.stop - sl.start) // 2
  t.y[:, sl.start:sl.start + n] = values.reshape(len(values), n)
  t.w[:, sl.start:sl.start + n] = weights.reshape(len(values), n)
  t.floor[sl.start:sl.start + n] = floor
  t.mdn.append((sl.start, sl.start + n, n))


def vision_targets(truths: list[Truth]) -> Targets:
  n = len(truths)
  t = Targets(np.zeros((n, VISION_WIDTH), np.float32), np.zeros((n, VISION_WIDTH), np.float32))
  ones = np.ones((n, 4, 33, 2))
  lanes = np.stack([np.stack([tr.lane_lines_y, np.full_like(tr.lane_lines_y, CAM_HEIGHT)], axis=-1) for tr in truths])
  mdn(t, VISION_SLICES["lane_lines"], lanes, ones * [1.0, 0.1], np.tile([.05, .05], 4 * 33))
  edges = np.stack([np.stack([tr.road_edges_y, np.full_like(tr.road_edges_y, CAM_HEIGHT)], axis=-1) for tr in truths])
  mdn(t, VISION_SLICES["road_edges"], edges, np.ones((n, 2, 33, 2)) * [1.0, 0.1], np.tile([.05, .05], 2 * 33))
  has_lead = np.array([tr.lead_prob[0] for tr in truths])
  mdn(t, VISION_SLICES["lead"], np.stack([tr.lead for tr in truths]), np.ones((n, 3, 6, 4)) * has_lead[:, None, None, None] * 0.3, .1)
  pose = np.stack([[tr.v_ego, 0, 0, 0, 0, tr.yaw_rate] for tr in truths])
  mdn(t, VISION_SLICES["pose"], pose, np.ones((n, 6)) * [1, .1, .1, .1, .1, 1], np.array([.05, .05, .05, 1e-3, 1e-3, 1e-3]))
  # lane_lines_prob: [not visible, visible] logit pairs per line; every rendered line is visible
  sl = VISION_SLICES["lane_lines_prob"]
  t.y[:, sl] = np.tile([0.0, 1.0], 4)
  t.w[:, sl] = 0.1
  t.bce.append((sl.start, sl.stop - sl.start))
  sl = VISION_SLICES["lead_prob"]
  t.y[:, sl] = np.stack([tr.lead_prob for tr in truths])
  t.w[:, sl] = 0.3
  t.bce.append((sl.start, sl.stop - sl.start))
  return t


def policy_targets(truths: list[Truth]) -> Targets:
  n = len(truths)
  t = Targets(np.zeros((n, POLICY_WIDTH), np.float32), np.zeros((n, POLICY_WIDTH), np.float32))
  plan = np.stack([tr.plan for tr in truths])
  mdn(t, POLICY_SLICES["plan"], plan, np.broadcast_to(_PLAN_WEIGHT, plan.shape).copy(), np.tile(_PLAN_FLOOR, 33))
  return t


def loss(out, y, w, scale, t: Targets):
  """Mean over the batch of the weighted L1 (mu, in spread units), Laplace NLL (log_std) and BCE (logits). Tensors in."""
  total = None
  for mu, ls, n in t.mdn:
    m, s = out[:, mu:mu + n], out[:, ls:ls + n]
    tgt, wt, sc = y[:, mu:mu + n], w[:, mu:mu + n], scale[mu:mu + n]
    term = ((m - tgt).abs() / sc * wt).sum() + 0.1 * (((m.detach() - tgt).abs() / s.exp() + s) * wt).sum()
    total = term if total is None else total + term
  for start, n in t.bce:
    x, tgt, wt = out[:, start:start + n], y[:, start:start + n], w[:, start:start + n]
    term = ((x.softplus() - tgt * x) * wt).sum()
    total = term if total is None else total + term
  assert total is not None
  return total / out.shape[0]
