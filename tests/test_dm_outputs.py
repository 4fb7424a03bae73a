"""The driver-monitoring model's parse and driverStateV2 fill (modeld_msm/dm_outputs.py), against values written by hand.

The end-to-end test in test_dmonitoring.py compares the car's step with onnxruntime through the same parser, so a bug in
the parser would cancel out there; here every expected number comes from the output vector and the formulas openpilot's
dmonitoringmodeld applies (mean as is, std = exp(log-std) with the exponent capped at 11, probabilities through the
logistic function), in two slice layouts, so a parser that reads by position instead of by name is caught too."""
from __future__ import annotations

import math

import numpy as np
import pytest

from compile.refmodels.dmonitoring import DM_SLICES, FACE_DESCS, SIGMOID_HEADS
from modeld_msm.dm_outputs import fill_driver_state, parse_dm_outputs
from selfdrive_glue import messaging

# head name in the model -> DriverData field (openpilot's dmonitoringmodeld names)
FIELDS = {"face_prob": "faceProb", "left_eye_prob": "leftEyeProb", "right_eye_prob": "rightEyeProb", "left_blink_prob": "leftBlinkProb",
          "right_blink_prob": "rightBlinkProb", "sunglasses_prob": "sunglassesProb", "using_phone_prob": "phoneProb", "sleep_prob": "sleepProb"}


def _logistic(x: float) -> float:
  return 1.0 / (1.0 + math.exp(-x))


def _reversed_layout(without: tuple[str, ...] = ()) -> dict[str, slice]:
  """The same slices in the opposite order (rhd before lhd, heads before descriptors): names, not places, must be read."""
  out, off = {}, 0
  for name in reversed([n for n in DM_SLICES if n not in without]):
    width = DM_SLICES[name].stop - DM_SLICES[name].start
    out[name], off = slice(off, off + width), off + width
  return out


def _values(slices: dict[str, slice]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """A raw vector with a distinct value in every place, and each slice's values by name."""
  width = max(s.stop for s in slices.values())
  rng = np.random.default_rng(7)
  raw = rng.uniform(-2.5, 2.5, width).astype(np.float32)
  by_name = {n: raw[s].astype(np.float64) for n, s in slices.items()}
  return raw, by_name


@pytest.mark.parametrize("layout", ["openpilot's", "reversed", "0.11.0 (no sleep_prob)"])
def test_every_field_is_the_named_slice_through_openpilots_formula(layout):
  slices = {"openpilot's": DM_SLICES, "reversed": _reversed_layout()}.get(layout) or _reversed_layout(("sleep_prob_lhd", "sleep_prob_rhd"))
  raw, v = _values(slices)
  got = parse_dm_outputs(raw, slices)
  assert got["wheelOnRightProb"] == pytest.approx(_logistic(v["wheel_on_right"][0]), rel=1e-6)
  for side, field in (("lhd", "leftDriverData"), ("rhd", "rightDriverData")):
    d, descs = got[field], v[f"face_descs_{side}"]
    assert len(descs) == FACE_DESCS
    np.testing.assert_allclose(d["faceOrientation"], descs[0:3], rtol=1e-6)
    np.testing.assert_allclose(d["facePosition"], descs[3:5], rtol=1e-6)
    np.testing.assert_allclose(d["faceOrientationStd"], [math.exp(x) for x in descs[6:9]], rtol=1e-5)
    np.testing.assert_allclose(d["facePositionStd"], [math.exp(x) for x in descs[9:11]], rtol=1e-5)
    heads = {h for h in SIGMOID_HEADS if f"{h}_{side}" in slices}
    assert set(d) == {"faceOrientation", "faceOrientationStd", "facePosition", "facePositionStd"} | {FIELDS[h] for h in heads}
    for h in heads:
      assert d[FIELDS[h]] == pytest.approx(_logistic(v[f"{h}_{side}"][0]), rel=1e-6), (side, h)
  assert ("sleepProb" in got["leftDriverData"]) is (layout != "0.11.0 (no sleep_prob)")


def test_huge_log_stds_saturate_at_exp_11_and_logits_stay_probabilities():
  raw = np.zeros(max(s.stop for s in DM_SLICES.values()), np.float32)
  raw[DM_SLICES["face_descs_lhd"]] = [0, 0, 0, 0, 0, 0, 50, 11, 10, 1e4, -3, 0]
  raw[DM_SLICES["face_prob_lhd"]] = 1e4      # a logit fp16 cannot hold: probability 1, not NaN or overflow
  raw[DM_SLICES["face_prob_rhd"]] = -1e4
  d = parse_dm_outputs(raw, DM_SLICES)
  np.testing.assert_allclose(d["leftDriverData"]["faceOrientationStd"], [math.exp(11), math.exp(11), math.exp(10)], rtol=1e-5)
  np.testing.assert_allclose(d["leftDriverData"]["facePositionStd"], [math.exp(11), math.exp(-3)], rtol=1e-5)
  assert d["leftDriverData"]["faceProb"] == 1.0 and 0 <= d["rightDriverData"]["faceProb"] < 1e-4


def test_a_2d_or_fp16_output_is_read_flat():
  raw, v = _values(DM_SLICES)
  got = parse_dm_outputs(raw.astype(np.float16).reshape(1, -1), DM_SLICES)
  assert got["rightDriverData"]["faceProb"] == pytest.approx(_logistic(v["face_prob_rhd"][0]), abs=2e-3)


@pytest.mark.parametrize("with_raw", [False, True])
def test_driver_state_carries_every_parsed_value_and_the_timings(with_raw):
  slices = _reversed_layout(("sleep_prob_rhd",))
  raw, v = _values(slices)
  msg = messaging.new_message("driverStateV2")
  fill_driver_state(msg, parse_dm_outputs(raw, slices), 4321, 0.0125, 0.0075, raw if with_raw else None)
  ds = messaging.log_from_bytes(msg.to_bytes()).driverStateV2
  assert (ds.frameId, ds.modelExecutionTime, ds.gpuExecutionTime) == (4321, pytest.approx(0.0125), pytest.approx(0.0075))
  assert ds.wheelOnRightProb == pytest.approx(_logistic(v["wheel_on_right"][0]), rel=1e-6)
  assert ds.rawPredictions == (raw.tobytes() if with_raw else b"")
  for side, field in (("lhd", "leftDriverData"), ("rhd", "rightDriverData")):
    d, descs = getattr(ds, field), v[f"face_descs_{side}"]
    np.testing.assert_allclose(list(d.faceOrientation), descs[0:3], rtol=1e-6)
    np.testing.assert_allclose(list(d.facePosition), descs[3:5], rtol=1e-6)
    np.testing.assert_allclose(list(d.faceOrientationStd), np.exp(descs[6:9]), rtol=1e-5)
    np.testing.assert_allclose(list(d.facePositionStd), np.exp(descs[9:11]), rtol=1e-5)
    for h, name in FIELDS.items():
      want = _logistic(v[f"{h}_{side}"][0]) if f"{h}_{side}" in slices else 0.0   # a slice the model lacks: the field's default
      assert getattr(d, name) == pytest.approx(want, rel=1e-6), (side, h)
