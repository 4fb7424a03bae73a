"""driverStateV2 held to the rendered cabin's truth (selfdrive_glue/cabin_render.py): face orientation in degrees, how well
faceProb tells a face from none (ROC AUC), and blink accuracy. The driver sits on the left (lhd), so leftDriverData is
the one compared.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from selfdrive_glue.cabin_render import CabinScene, CabinTruth


@dataclass
class DMPrediction:
  frame_id: int
  t: float                      # scene time of the frame
  orientation: tuple[float, float, float]   # pitch, yaw, roll (rad)
  face_prob: float
  blink_prob: float             # the mean of left and right blink probabilities
  eye_prob: float


@dataclass
class DMAccuracy:
  frames: int
  face_orientation_err_deg_p50: float | None
  face_orientation_err_deg_p90: float | None
  face_prob_auc: float | None
  blink_accuracy: float | None
  truths: list[CabinTruth] = field(default_factory=list, repr=False)

  def summary(self) -> dict:
    return {"dm_frames": self.frames, "face_orientation_err_deg_p50": self.face_orientation_err_deg_p50,
            "face_orientation_err_deg_p90": self.face_orientation_err_deg_p90, "face_prob_auc": self.face_prob_auc,
            "blink_accuracy": self.blink_accuracy}


def prediction(msg, t: float) -> DMPrediction:
  d = msg.leftDriverData
  o = list(d.faceOrientation) + [float("nan")] * 3
  return DMPrediction(int(msg.frameId), t, (o[0], o[1], o[2]), float(d.faceProb), (float(d.leftBlinkProb) + float(d.rightBlinkProb)) / 2,
                      (float(d.leftEyeProb) + float(d.rightEyeProb)) / 2)


def auc(scores: list[float], labels: list[bool]) -> float | None:
  """ROC AUC by ranks (ties share their rank); None without both classes."""
  pos = sum(labels)
  neg = len(labels) - pos
  if not pos or not neg:
    return None
  order = np.argsort(scores, kind="stable")
  ranks = np.empty(len(scores))
  s = np.asarray(scores)[order]
  i = 0
  while i < len(s):
    j = i
    while j + 1 < len(s) and s[j + 1] == s[i]:
      j += 1
    ranks[order[i:j + 1]] = (i + j) / 2 + 1
    i = j + 1
  return float((ranks[np.asarray(labels)].sum() - pos * (pos + 1) / 2) / (pos * neg))


def evaluate(scene: CabinScene, preds: list[DMPrediction]) -> DMAccuracy:
  truths = [scene.truth(p.t) for p in preds]
  err = [math.degrees(max(abs(a - b) for a, b in zip(p.orientation, (tr.pitch, tr.yaw, tr.roll))))
         for p, tr in zip(preds, truths) if tr.face and all(math.isfinite(x) for x in p.orientation)]
  blink = [(p.blink_prob > 0.5) == tr.eyes_closed for p, tr in zip(preds, truths) if tr.face and not tr.sunglasses]

  def pct(q: float) -> float | None:
    return float(np.percentile(err, q)) if err else None
  return DMAccuracy(len(preds), pct(50), pct(90), auc([p.face_prob for p in preds], [tr.face for tr in truths]),
                    float(np.mean(blink)) if blink else None, truths)
