"""driverStateV2 held to the rendered cabin's truth (selfdrive_glue/cabin_render.py): face orientation in degrees, how well
faceProb tells a face from none (ROC AUC), and blink accuracy. The driver sits on the left (lhd), so leftDriverData is
the one compared.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from selfdrive_glue.cabin_render import CabinScene, CabinTruth

# the bars a run must clear (what the shipped stand-in reaches on held-out cabins: docs/stand-in.md §2)
FACE_ORIENTATION_LIMIT_DEG = 5.0
FACE_PROB_AUC_LIMIT = 0.95
BLINK_ACCURACY_LIMIT = 0.9


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
  blink_recall: float | None      # of the frames with visibly closed eyes, those called closed (blinks are ~6 % of frames)
  truths: list[CabinTruth] = field(default_factory=list, repr=False)

  def passes(self) -> bool:
    return bool(self.face_orientation_err_deg_p50 is not None and self.face_orientation_err_deg_p50 <= FACE_ORIENTATION_LIMIT_DEG
                and self.face_prob_auc is not None and self.face_prob_auc >= FACE_PROB_AUC_LIMIT
                and self.blink_accuracy is not None and self.blink_accuracy >= BLINK_ACCURACY_LIMIT)

  def summary(self) -> dict:
    return {"dm_frames": self.frames, "dm_passes": self.passes(), "face_orientation_err_deg_p50": self.face_orientation_err_deg_p50,
            "face_orientation_err_deg_p90": self.face_orientation_err_deg_p90, "face_prob_auc": self.face_prob_auc,
            "blink_accuracy": self.blink_accuracy, "blink_recall": self.blink_recall}


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
  return evaluate_truths([scene.truth(p.t) for p in preds], preds)


def evaluate_truths(truths: list[CabinTruth], preds: list[DMPrediction]) -> DMAccuracy:
  err = [math.degrees(max(abs(a - b) for a, b in zip(p.orientation, (tr.pitch, tr.yaw, tr.roll))))
         for p, tr in zip(preds, truths) if tr.face and all(math.isfinite(x) for x in p.orientation)]
  blink = [(p.blink_prob > 0.5) == tr.eyes_closed for p, tr in zip(preds, truths) if tr.face and not tr.sunglasses]
  closed = [p.blink_prob > 0.5 for p, tr in zip(preds, truths) if tr.face and not tr.sunglasses and tr.eyes_closed]

  def pct(q: float) -> float | None:
    return float(np.percentile(err, q)) if err else None
  return DMAccuracy(len(preds), pct(50), pct(90), auc([p.face_prob for p in preds], [tr.face for tr in truths]),
                    float(np.mean(blink)) if blink else None, float(np.mean(closed)) if closed else None, truths)


def from_parsed(parsed: dict, frame_id: int, t: float) -> DMPrediction:
  """A prediction from modeld_msm.dm_outputs.parse_dm_outputs' dict (what driverStateV2 would carry)."""
  d = parsed["leftDriverData"]
  o = [float(x) for x in d["faceOrientation"]]
  return DMPrediction(frame_id, t, (o[0], o[1], o[2]), d["faceProb"], (d["leftBlinkProb"] + d["rightBlinkProb"]) / 2,
                      (d["leftEyeProb"] + d["rightEyeProb"]) / 2)
