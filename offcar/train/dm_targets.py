"""The rendered cabin's truth as per-column training targets for the driver-monitoring model's outputs.

The driver sits on the left (lhd): its face descriptors (pitch, yaw, roll in the car's frame, the head's position in the
warped image; the size column has no truth) are mixture-density blocks, its sigmoid heads logits under a BCE: a face is
there, its eyes are visible (a face without sunglasses), closed (only judged where visible), sunglasses (where there
is a face), no phone and no sleep. The right seat is empty: rhd's faceProb is trained to 0 and the rest of that side
carries no loss, as wheel_on_right is trained to 0. The 512 features carry none.
"""
from __future__ import annotations

import numpy as np

from compile.refmodels.dmonitoring import DM_SLICES, DM_WIDTH, FACE_DESCS
from offcar.train.dm_data import Cabins
from offcar.train.targets import Targets, mdn


def _logit(t: Targets, head: str, value: np.ndarray, weight: np.ndarray | float) -> None:
  sl = DM_SLICES[head]
  t.y[:, sl.start] = value
  t.w[:, sl.start] = weight
  t.bce.append((sl.start, 1))


def dm_targets(c: Cabins) -> Targets:
  n = len(c)
  t = Targets(np.zeros((n, DM_WIDTH), np.float32), np.zeros((n, DM_WIDTH), np.float32))
  face = np.array([tr.face for tr in c.truths], np.float32)
  glasses = np.array([tr.sunglasses for tr in c.truths], np.float32)
  closed = np.array([tr.eyes_closed for tr in c.truths], np.float32)
  eyes = face * (1 - glasses)
  descs = np.zeros((n, FACE_DESCS // 2), np.float32)
  descs[:, :3] = [(tr.pitch, tr.yaw, tr.roll) for tr in c.truths]
  descs[:, 3:5] = c.position
  weight = face[:, None] * np.array([1.0, 1.0, 1.0, 0.3, 0.3, 0.0], np.float32)
  mdn(t, DM_SLICES["face_descs_lhd"], descs, weight, np.array([1e-2, 1e-2, 1e-2, 1e-3, 1e-3, 1e-3]))
  _logit(t, "face_prob_lhd", face, 1.0)
  for side in ("left", "right"):
    _logit(t, f"{side}_eye_prob_lhd", eyes, 0.5)
    _logit(t, f"{side}_blink_prob_lhd", closed, eyes)
  _logit(t, "sunglasses_prob_lhd", glasses, 0.5 * face)
  _logit(t, "using_phone_prob_lhd", np.zeros(n), 0.1)
  _logit(t, "sleep_prob_lhd", np.zeros(n), 0.1)
  _logit(t, "face_prob_rhd", np.zeros(n), 1.0)
  _logit(t, "wheel_on_right", np.zeros(n), 0.3)
  return t
