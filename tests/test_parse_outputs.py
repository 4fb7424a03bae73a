import math

import numpy as np
import pytest

from modeld_msm.parse_outputs import parse_policy_outputs, parse_vision_outputs, safe_exp, sigmoid, slice_outputs, softmax
from selfdrive_glue.errors import UserError

# current split models (contract §5)
VISION_SLICES = {
  "meta": slice(0, 55), "desire_pred": slice(55, 87), "pose": slice(87, 99), "wide_from_device_euler": slice(99, 105),
  "road_transform": slice(105, 117), "lane_lines": slice(117, 645), "lane_lines_prob": slice(645, 653),
  "road_edges": slice(653, 917), "lead": slice(917, 1061), "lead_prob": slice(1061, 1064), "hidden_state": slice(1064, 1576),
}
POLICY_SLICES = {"plan": slice(0, 990), "desire_state": slice(990, 998), "pad": slice(998, 1000)}


def _vision(seed=0):
  return np.random.default_rng(seed).standard_normal(1576).astype(np.float32)


def _policy(seed=1):
  return np.random.default_rng(seed).standard_normal(1000).astype(np.float32)


def test_slice_outputs_views_with_batch_axis():
  flat = _vision()
  d = slice_outputs(flat, VISION_SLICES)
  assert set(d) == set(VISION_SLICES)
  assert d["hidden_state"].shape == (1, 512)
  np.testing.assert_array_equal(d["lead_prob"][0], flat[1061:1064])
  assert np.shares_memory(d["meta"], flat)


def test_slice_outputs_rejects_mismatched_metadata():
  with pytest.raises(UserError, match="'hidden_state'.*1500-wide"):
    slice_outputs(np.zeros(1500, np.float32), VISION_SLICES)
  with pytest.raises(UserError, match="flat"):
    slice_outputs(np.zeros((1, 1576), np.float32), VISION_SLICES)


def test_full_vision_and_policy_shapes_and_dtypes():
  v = parse_vision_outputs(slice_outputs(_vision(), VISION_SLICES))
  p = parse_policy_outputs(slice_outputs(_policy(), POLICY_SLICES))
  shapes = {
    "pose": (1, 6), "pose_stds": (1, 6), "wide_from_device_euler": (1, 3), "road_transform": (1, 6),
    "lane_lines": (1, 4, 33, 2), "lane_lines_stds": (1, 4, 33, 2), "road_edges": (1, 2, 33, 2), "road_edges_stds": (1, 2, 33, 2),
    "lane_lines_prob": (1, 8), "meta": (1, 55), "lead_prob": (1, 3), "desire_pred": (1, 4, 8),
    "lead": (1, 3, 6, 4), "lead_stds": (1, 3, 6, 4), "hidden_state": (1, 512),
  }
  for k, s in shapes.items():
    assert v[k].shape == s, k
    assert v[k].dtype == np.float32, k
  assert "lead_weights" not in v  # 144-wide lead is single-hypothesis
  assert p["plan"].shape == (1, 33, 15) and p["plan_stds"].shape == (1, 33, 15) and p["plan"].dtype == np.float32
  assert p["desire_state"].shape == (1, 8)
  assert "plan_weights" not in p


def test_parse_does_not_modify_inputs():
  flat_v, flat_p = _vision(3), _policy(4)
  before_v, before_p = flat_v.copy(), flat_p.copy()
  parse_vision_outputs(slice_outputs(flat_v, VISION_SLICES))
  parse_policy_outputs(slice_outputs(flat_p, POLICY_SLICES))
  np.testing.assert_array_equal(flat_v, before_v)
  np.testing.assert_array_equal(flat_p, before_p)


def test_single_hypothesis_mdn_values():
  flat = _vision(5)
  flat[87 + 6] = 20.0  # a pose log-std far past the clip
  v = parse_vision_outputs(slice_outputs(flat, VISION_SLICES))
  np.testing.assert_array_equal(v["pose"][0], flat[87:93])
  assert v["pose_stds"][0, 0] == np.float32(math.exp(11))
  np.testing.assert_allclose(v["pose_stds"][0, 1:], np.exp(flat[94:99].astype(np.float64)), rtol=1e-6)
  # lane lines: first 264 values are means, in (line, step, [y, z]) order
  ll = flat[117:645]
  np.testing.assert_array_equal(v["lane_lines"][0, 2, 5], ll[2 * 66 + 5 * 2: 2 * 66 + 5 * 2 + 2])
  np.testing.assert_allclose(v["lane_lines_stds"][0, 3, 32, 1], math.exp(ll[264 + 263]), rtol=1e-6)
  # lead (non-MHP): 72 means then 72 log-stds, as (selection, step, [x, y, v, a])
  lead = flat[917:1061]
  assert v["lead"][0, 1, 4, 2] == lead[1 * 24 + 4 * 4 + 2]
  assert v["lead_stds"][0, 2, 0, 3] == pytest.approx(math.exp(lead[72 + 2 * 24 + 3]), rel=1e-6)
  p_flat = _policy(6)
  p = parse_policy_outputs(slice_outputs(p_flat, POLICY_SLICES))
  assert p["plan"][0, 10, 4] == p_flat[10 * 15 + 4]
  assert p["plan_stds"][0, 32, 14] == pytest.approx(math.exp(p_flat[495 + 32 * 15 + 14]), rel=1e-6)


def test_probability_heads():
  flat = _vision(7)
  flat[645] = -100.0  # would overflow exp without the clip
  flat[646] = 100.0
  flat[55:87] = 0.0
  flat[55 + 8 + 3] = math.log(3.0)  # desire_pred row 1: class 3 three times as likely as each other class
  with np.errstate(over="raise"):
    v = parse_vision_outputs(slice_outputs(flat, VISION_SLICES))
  assert v["lane_lines_prob"][0, 0] == pytest.approx(1 / (1 + math.exp(11)), rel=1e-5)
  assert v["lane_lines_prob"][0, 1] == pytest.approx(1.0)
  for i in range(2, 8):
    assert v["lane_lines_prob"][0, i] == pytest.approx(1 / (1 + math.exp(-float(flat[645 + i]))), rel=1e-6)
  assert v["meta"][0, 17] == pytest.approx(1 / (1 + math.exp(-float(flat[17]))), rel=1e-6)
  np.testing.assert_allclose(v["desire_pred"][0, 0], np.full(8, 1 / 8), rtol=1e-6)
  assert v["desire_pred"][0, 1, 3] == pytest.approx(3 / 10, rel=1e-6)
  assert v["desire_pred"][0, 1, 0] == pytest.approx(1 / 10, rel=1e-6)
  np.testing.assert_allclose(v["desire_pred"].sum(-1), 1.0, rtol=1e-6)


def test_softmax_sigmoid_helpers_are_stable():
  x = np.array([[1000.0, 1000.0, 999.0]], np.float32)
  e = math.exp(-1)
  np.testing.assert_allclose(softmax(x)[0], [1 / (2 + e), 1 / (2 + e), e / (2 + e)], rtol=1e-6)
  assert safe_exp(np.float32(50.0)) == np.float32(math.exp(11))
  assert sigmoid(np.float32(0.0)) == 0.5


def _policy_with_mhp_plan(best: int, seed=8):
  """5 hypotheses x (495 means + 495 log-stds + 1 weight logit), then desire_state."""
  rng = np.random.default_rng(seed)
  hyps = rng.standard_normal((5, 991)).astype(np.float32)
  hyps[:, 990] = [0.0, 1.0, -1.0, 0.5, 0.2]
  hyps[best, 990] = 3.0
  desire = rng.standard_normal(8).astype(np.float32)
  flat = np.concatenate([hyps.reshape(-1), desire])
  return flat, hyps, {"plan": slice(0, 4955), "desire_state": slice(4955, 4963)}


def test_multi_hypothesis_plan_picks_the_heaviest():
  flat, hyps, slices = _policy_with_mhp_plan(best=3)
  p = parse_policy_outputs(slice_outputs(flat, slices))
  np.testing.assert_array_equal(p["plan"][0], hyps[3, :495].reshape(33, 15))
  np.testing.assert_allclose(p["plan_stds"][0], np.exp(hyps[3, 495:990].astype(np.float64)).reshape(33, 15), rtol=1e-6)
  logits = [0.0, 1.0, -1.0, 3.0, 0.2]
  z = sum(math.exp(x) for x in logits)
  # reported best-first
  order = [3, 1, 4, 0, 2]
  np.testing.assert_allclose(p["plan_weights"][0, :, 0], [math.exp(logits[i]) / z for i in order], rtol=1e-6)
  assert p["plan_hypotheses"].shape == (1, 5, 33, 15)
  for rank, h in enumerate(order):
    np.testing.assert_array_equal(p["plan_hypotheses"][0, rank], hyps[h, :495].reshape(33, 15))
    np.testing.assert_array_equal(p["plan_stds_hypotheses"][0, rank], np.exp(hyps[h, 495:990]).reshape(33, 15))


def test_multi_hypothesis_lead_selects_per_column():
  rng = np.random.default_rng(9)
  hyps = rng.standard_normal((2, 51)).astype(np.float32)
  # selection 0 and 2 prefer hypothesis 1, selection 1 prefers hypothesis 0
  hyps[:, 48:51] = [[0.0, 2.0, -1.0], [1.0, 0.0, 1.0]]
  flat = _vision(10)
  flat = np.concatenate([flat[:917], hyps.reshape(-1), flat[1061:]])
  slices = {k: (s if s.start < 917 else slice(s.start - 42, s.stop - 42)) for k, s in VISION_SLICES.items()}
  slices["lead"] = slice(917, 1019)
  v = parse_vision_outputs(slice_outputs(flat, slices))
  assert v["lead"].shape == (1, 3, 6, 4) and v["lead_stds"].shape == (1, 3, 6, 4)
  for sel, h in enumerate([1, 0, 1]):
    np.testing.assert_array_equal(v["lead"][0, sel], hyps[h, :24].reshape(6, 4))
    np.testing.assert_array_equal(v["lead_stds"][0, sel], np.exp(hyps[h, 24:48]).reshape(6, 4))
  w1 = 1 / (1 + math.exp(-1.0))
  np.testing.assert_allclose(v["lead_weights"][0], [[1 - w1, 1 / (1 + math.exp(-2.0)), 1 - 1 / (1 + math.exp(-2.0))],
                                                    [w1, 1 - 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-2.0))]], rtol=1e-6)
  # several selections: hypotheses stay in model order
  np.testing.assert_array_equal(v["lead_hypotheses"][0, 1], hyps[1, :24].reshape(6, 4))


def test_tied_weights_are_deterministic():
  # stable sorts all the way: the best-first listing puts the later of two tied hypotheses first, and the final pick,
  # taken from that listing, lands on the earlier one (what openpilot's double argsort gives when its sort is stable)
  flat, hyps, slices = _policy_with_mhp_plan(best=0)
  flat[4 * 991 + 990] = 3.0  # hypothesis 4 ties hypothesis 0
  p = parse_policy_outputs(slice_outputs(flat, slices))
  np.testing.assert_array_equal(p["plan_hypotheses"][0, 0], hyps[4, :495].reshape(33, 15))
  np.testing.assert_array_equal(p["plan_hypotheses"][0, 1], hyps[0, :495].reshape(33, 15))
  np.testing.assert_array_equal(p["plan"][0], hyps[0, :495].reshape(33, 15))


def test_missing_or_misshapen_heads_are_clear_errors():
  d = slice_outputs(_vision(), VISION_SLICES)
  del d["lead_prob"]
  with pytest.raises(UserError, match="no 'lead_prob' head"):
    parse_vision_outputs(d)
  with pytest.raises(UserError, match="no 'desire_state' head"):
    parse_policy_outputs(slice_outputs(_policy(), {"plan": slice(0, 990)}))
  with pytest.raises(UserError, match="'plan' is 980 wide"):
    parse_policy_outputs(slice_outputs(_policy(), {"plan": slice(0, 980), "desire_state": slice(990, 998)}))
