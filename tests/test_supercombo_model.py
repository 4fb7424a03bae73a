"""Master's combined driving model (driving_supercombo.onnx) as we make it from a 0.11 pair (compile/refmodels/supercombo.py),
and its contract check (compile/onnx_model.py): the fused graph computes exactly what the split pair computes when the policy
is given the 24 past features plus this frame's hidden state, its action head follows the plan and action_t, and files off
either contract are refused by name, in one line."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from compile.onnx_model import encode_output_slices, load_model_info
from compile.refmodels.driving import POLICY_SLICES, TARGET_VISION_MACS, VISION_SLICES, build_model, count_macs, count_params, stand_in_model
from compile.refmodels.supercombo import (
  LAT_T_GAIN,
  LONG_T_GAIN,
  MASTER_FILE_BYTES,
  PLAN_A0,
  PLAN_V0,
  PLAN_YAW_RATE0,
  fuse,
  slices,
  write_supercombo_model,
)
from selfdrive_glue.errors import UserError
from tests.conftest import run_cli


def _session(model) -> ort.InferenceSession:
  return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _inputs(rng, action_t=(0.2, 0.45)) -> dict[str, np.ndarray]:
  return {"img": rng.integers(0, 256, (1, 12, 128, 256), dtype=np.uint8), "big_img": rng.integers(0, 256, (1, 12, 128, 256), dtype=np.uint8),
          "features_buffer": rng.standard_normal((1, 24, 512)).astype(np.float16),
          "desire_pulse": (rng.random((1, 25, 8)) > 0.9).astype(np.float16), "traffic_convention": np.array([[1, 0]], np.float16),
          "action_t": np.array([action_t], np.float16)}


@pytest.mark.parametrize("pair", ["reference", "stand-in"])
def test_fused_model_is_the_split_pair_with_this_frames_feature_appended(pair):
  vision, policy = (build_model(k, "tiny", 3) for k in ("vision", "policy")) if pair == "reference" else map(stand_in_model, ("vision", "policy"))
  combined, sv, sp = _session(fuse(vision, policy)), _session(vision), _session(policy)
  rng = np.random.default_rng(1)
  for _ in range(3):
    x = _inputs(rng)
    out = combined.run(None, x)[0]
    assert out.shape == (1, 2580) and out.dtype == np.float16
    v = sv.run(None, {"img": x["img"], "big_img": x["big_img"]})[0]
    feats = np.concatenate([x["features_buffer"], v[:, None, VISION_SLICES["hidden_state"]]], axis=1)   # the 25th row: h(t)
    p = sp.run(None, {"features_buffer": feats, "desire_pulse": x["desire_pulse"], "traffic_convention": x["traffic_convention"]})[0]
    for name, s in slices().items():
      if name == "action":
        continue
      src, where = (v, VISION_SLICES) if name in VISION_SLICES else (p, POLICY_SLICES)
      assert np.array_equal(out[:, s], src[:, where[name]]), name
    plan0 = p[0, :15].astype(np.float32)
    lat, long = out[0, slices()["action"]][:2].astype(np.float32)
    at = x["action_t"][0].astype(np.float32)
    assert lat == pytest.approx(plan0[PLAN_V0] * plan0[PLAN_YAW_RATE0] + LAT_T_GAIN * at[0], abs=2e-3)
    assert long == pytest.approx(plan0[PLAN_A0] + LONG_T_GAIN * at[1], abs=2e-3)


def test_the_features_fed_and_action_t_each_change_what_comes_out():
  """So a pipeline that feeds the wrong rows, or action_t swapped, cannot agree with the split pair by accident."""
  combined = _session(fuse(*(build_model(k, "tiny", 0) for k in ("vision", "policy"))))
  x = _inputs(np.random.default_rng(2), action_t=(0.1, 0.6))
  out = combined.run(None, x)[0]
  shifted = {**x, "features_buffer": np.roll(x["features_buffer"], 1, axis=1)}
  assert not np.array_equal(combined.run(None, shifted)[0][:, slices()["plan"]], out[:, slices()["plan"]])
  swapped = {**x, "action_t": x["action_t"][:, ::-1].copy()}
  assert not np.array_equal(combined.run(None, swapped)[0][:, slices()["action"]], out[:, slices()["action"]])


def test_layout_is_masters():
  s = slices()
  assert list(s)[:3] == ["lane_lines", "lane_lines_prob", "road_edges"] and s["plan"] == slice(917, 1907)
  assert s["action"] == slice(2062, 2066) and s["hidden_state"] == slice(2066, 2578) and s["pad"] == slice(2578, 2580)
  assert "action" not in slices(action_head=False) and slices(action_head=False)["pad"].stop == 2576


def test_contract_check_reads_it_and_the_cli_writes_it_reproducibly(tmp_path):
  for d in ("a", "b"):
    r = run_cli("models", "--contract", "supercombo", "-o", tmp_path / d, "--seed", "4", timeout=120)
    assert r.returncode == 0, r.stderr
  a, b = (tmp_path / d / "driving_supercombo.onnx" for d in ("a", "b"))
  assert a.read_bytes() == b.read_bytes() and sorted(p.name for p in (tmp_path / "a").iterdir()) == ["driving_supercombo.onnx"]
  info = load_model_info(a, "supercombo")
  assert info.input_shapes["features_buffer"] == (1, 24, 512) and info.input_shapes["action_t"] == (1, 2) and info.output_width == 2580
  assert info.output_slices == slices()
  # no action head: still master's contract (modeld falls back to the plan)
  no_action = tmp_path / "no_action"
  write_supercombo_model(no_action, "tiny", 0, action_head=False)
  assert "action" not in load_model_info(no_action / "driving_supercombo.onnx", "supercombo").output_slices


def test_full_is_masters_file_size_with_011s_vision_and_runs_sane(tmp_path):
  """--size full: master's 96.6 MB file (the weights modeld uploads and keeps), the vision still 0.11.1's compute."""
  r = run_cli("models", "--contract", "supercombo", "--size", "full", "-o", tmp_path, timeout=300)
  assert r.returncode == 0, r.stderr
  path = tmp_path / "driving_supercombo.onnx"
  assert path.stat().st_size == pytest.approx(MASTER_FILE_BYTES, rel=0.02)
  model = onnx.load(str(path))
  assert count_macs(build_model("vision", "full", 0)) == pytest.approx(TARGET_VISION_MACS, rel=0.10)
  assert count_params(model) * 2 == pytest.approx(MASTER_FILE_BYTES, rel=0.02)   # fp16: the file is its weights
  assert load_model_info(path, "supercombo").output_slices == slices()
  out = _session(model).run(None, _inputs(np.random.default_rng(5)))[0].astype(np.float32)
  # random weights scaled to keep activations O(1): a wider layer must not saturate or blow up the heads
  assert np.isfinite(out).all() and 0.1 < float(np.abs(out).mean()) < 10, float(np.abs(out).mean())


def _edited(tmp_path, *, features_rows: int = 24, out_slices: dict | None = None):
  m = fuse(*(build_model(k, "tiny", 0) for k in ("vision", "policy")))
  if features_rows != 24:
    for i in m.graph.input:
      if i.name == "features_buffer":
        i.CopyFrom(helper.make_tensor_value_info("features_buffer", TensorProto.FLOAT16, (1, features_rows, 512)))
  if out_slices is not None:
    kept = {p.key: p.value for p in m.metadata_props if p.key != "output_slices"}
    del m.metadata_props[:]
    helper.set_model_props(m, {**kept, "output_slices": encode_output_slices(out_slices)})
  path = tmp_path / "driving_supercombo.onnx"
  onnx.save(m, str(path))
  return path


@pytest.mark.parametrize("case,needle", [
  ("25 past features", "'features_buffer' has shape (1, 25, 512), expected (1, 24, 512)"),
  ("no plan", "lack 'plan'"),
  ("action 1 wide", "action slice"),
  ("hidden 511 wide", "hidden_state slice"),
])
def test_off_contract_combined_models_are_refused_by_name(tmp_path, case, needle):
  s = slices()
  if case == "no plan":
    del s["plan"]
  elif case == "action 1 wide":
    s["action"] = slice(2062, 2063)
  elif case == "hidden 511 wide":
    s["hidden_state"] = slice(2066, 2577)
  path = _edited(tmp_path, features_rows=25 if case == "25 past features" else 24, out_slices=None if case == "25 past features" else s)
  with pytest.raises(UserError) as e:
    load_model_info(path, "supercombo")
  assert needle in str(e.value), str(e.value)


def test_a_model_given_for_the_other_contract_is_named(tmp_path):
  combined = write_supercombo_model(tmp_path / "m", "tiny", 0).path
  r = run_cli("compile", "--vision", combined, "--policy", combined, "-o", tmp_path / "out", timeout=120)
  err = r.stderr.strip()
  assert r.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
  assert "is the supercombo model" in err and "PR #38173" in err and not (tmp_path / "out").exists()
  with pytest.raises(UserError, match="is the vision model.*; pass it as --vision"):
    load_model_info(_vision_file(tmp_path), "policy")


def _vision_file(tmp_path):
  path = tmp_path / "driving_vision.onnx"
  path.write_bytes(build_model("vision", "tiny", 0).SerializeToString())
  return path


def test_masters_later_stateful_layout_is_named_not_taken_for_junes(tmp_path):
  """After 2026-09-16 master's queues live in the ONNX (state_* inputs, next_state_* outputs): such a file given as June's
  model is named as the stateful one (tests/test_stateful_model.py holds that contract), and checked as one it says what is off."""
  f16 = TensorProto.FLOAT16
  names = {"new_img": (1, 6, 128, 256), "desire": (1, 8), "traffic_convention": (1, 2), "action_t": (1, 2), "state_feat_q": (1, 96, 512)}
  inputs = [helper.make_tensor_value_info(n, TensorProto.UINT8 if n == "new_img" else f16, s) for n, s in names.items()]
  graph = helper.make_graph([helper.make_node("Identity", ["traffic_convention"], ["outputs"])], "stateful", inputs,
                            [helper.make_tensor_value_info("outputs", f16, (1, 2))])
  m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
  m.ir_version = 8
  path = tmp_path / "driving_supercombo.onnx"
  onnx.save(m, str(path))
  with pytest.raises(UserError, match="is the stateful model"):
    load_model_info(path, "supercombo")
  with pytest.raises(UserError, match=r"input 'new_img' has shape \(1, 6, 128, 256\), expected \(2, 6, 128, 256\)"):
    load_model_info(path, "stateful")


def test_a_fused_model_that_does_not_append_this_frames_feature_fails_the_equivalence():
  """Planted: the policy reads a zero row where this frame's hidden state belongs; the split-pair comparison catches it."""
  vision, policy = (build_model(k, "tiny", 0) for k in ("vision", "policy"))
  bad = fuse(vision, policy)
  node = next(n for n in bad.graph.node if n.name == "c/features")
  bad.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((1, 1, 512), np.float16), "c/zero_row"))
  node.input[1] = "c/zero_row"
  x = _inputs(np.random.default_rng(3))
  out = _session(bad).run(None, x)[0]
  v = _session(vision).run(None, {"img": x["img"], "big_img": x["big_img"]})[0]
  feats = np.concatenate([x["features_buffer"], v[:, None, VISION_SLICES["hidden_state"]]], axis=1)
  p = _session(policy).run(None, {"features_buffer": feats, "desire_pulse": x["desire_pulse"], "traffic_convention": x["traffic_convention"]})[0]
  assert not np.array_equal(out[:, slices()["plan"]], p[:, POLICY_SLICES["plan"]])


def test_a_plan_the_cars_parser_cannot_read_is_refused_by_the_runtime_parse(tmp_path):
  """Issue 40.6: a plan slice 900 wide passed every contract check; modeld died on its first frame. The compile now
  parses one reference output with the car's own code (compile/runtime_parse.py), which refuses it by name."""
  from artifact import kinds
  from compile.runtime_parse import check_runtime_parses
  s = slices()
  s["plan"] = slice(917, 917 + 900)
  path = _edited(tmp_path, out_slices=s)
  info = load_model_info(path, "supercombo")   # the slice checks before the runtime parse let it through
  raw = np.random.default_rng(0).normal(0, 0.1, info.output_width).astype(np.float32)
  kind = kinds.KINDS["supercombo"]
  assert "parsed by the car's own code" in check_runtime_parses(kind, path.name, {"outputs": raw}, {"outputs": slices()})
  with pytest.raises(UserError, match="driving_supercombo.onnx: the car's parser refuses its outputs .*'plan' is 900 wide"):
    check_runtime_parses(kind, path.name, {"outputs": raw}, {"outputs": info.output_slices})

