"""Reference models: openpilot's I/O contract, seeded determinism, numerical sanity, and the full-size budget."""
from __future__ import annotations

import codecs
import pickle

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compile.refmodels import driving as refmodels
from compile.refmodels.driving import POLICY_SLICES, VISION_SLICES, build_model, count_macs, count_params, write_models
from selfdrive_glue.errors import UserError

ort = pytest.importorskip("onnxruntime")

VISION_IN = {"img": (TensorProto.UINT8, (1, 12, 128, 256)), "big_img": (TensorProto.UINT8, (1, 12, 128, 256))}
POLICY_IN = {"features_buffer": (TensorProto.FLOAT16, (1, 25, 512)), "desire_pulse": (TensorProto.FLOAT16, (1, 25, 8)),
             "traffic_convention": (TensorProto.FLOAT16, (1, 2))}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny")
  write_models(d, "tiny", 0)
  return d


def _session(path_or_model):
  so = ort.SessionOptions()
  so.intra_op_num_threads = 1
  src = str(path_or_model) if not isinstance(path_or_model, onnx.ModelProto) else path_or_model.SerializeToString()
  return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def _frames(rng):
  return {n: rng.integers(0, 256, (1, 12, 128, 256), dtype=np.uint8) for n in ("img", "big_img")}


def _policy_inputs(rng):
  desire = np.zeros((1, 25, 8), np.float16)
  desire[0, -3:, 3] = 1
  return {"features_buffer": rng.standard_normal((1, 25, 512)).astype(np.float16), "desire_pulse": desire,
          "traffic_convention": np.array([[1, 0]], np.float16)}


def _io(vi):
  t = vi.type.tensor_type
  return t.elem_type, tuple(d.dim_value for d in t.shape.dim)


@pytest.mark.parametrize("kind,inputs,width,slices", [("vision", VISION_IN, 1576, VISION_SLICES), ("policy", POLICY_IN, 1000, POLICY_SLICES)])
def test_contract(tiny_dir, kind, inputs, width, slices):
  model = onnx.load(str(tiny_dir / f"driving_{kind}.onnx"))
  onnx.checker.check_model(model, full_check=True)
  inits = {i.name for i in model.graph.initializer}
  assert {i.name: _io(i) for i in model.graph.input if i.name not in inits} == inputs
  assert [(o.name, _io(o)) for o in model.graph.output] == [("outputs", (TensorProto.FLOAT16, (1, width)))]
  # FLOAT16 inside like the real models: every weight is fp16
  assert {i.data_type for i in model.graph.initializer} - {TensorProto.INT64} == {TensorProto.FLOAT16}
  meta = {p.key: p.value for p in model.metadata_props}
  assert meta["model_checkpoint"] == "modeld-msm-ref-tiny-seed0"
  # decoded the way openpilot's get_model_metadata.py does it
  decoded = pickle.loads(codecs.decode(meta["output_slices"].encode(), "base64"))
  assert decoded == slices
  spans = sorted((s.start, s.stop) for s in decoded.values())
  assert spans[0][0] == 0 and spans[-1][1] == width and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_project_loader_reads_them(tiny_dir):
  from compile.onnx_model import load_model_info
  for kind, slices in (("vision", VISION_SLICES), ("policy", POLICY_SLICES)):
    info = load_model_info(tiny_dir / f"driving_{kind}.onnx", kind)
    assert info.output_slices == slices
    assert info.metadata["model_checkpoint"] == "modeld-msm-ref-tiny-seed0"


def test_vision_casts_uint8_to_fp16_first(tiny_dir):
  model = onnx.load(str(tiny_dir / "driving_vision.onnx"))
  casts = [n for n in model.graph.node if n.input and n.input[0] in ("img", "big_img")]
  assert len(casts) == 2 and all(n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT16 for n in casts)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny_dir):
  write_models(tmp_path / "a", "tiny", 0)
  write_models(tmp_path / "b", "tiny", 1)
  for kind in ("vision", "policy"):
    name = f"driving_{kind}.onnx"
    assert (tmp_path / "a" / name).read_bytes() == (tiny_dir / name).read_bytes()
    m0, m1 = onnx.load(str(tiny_dir / name)), onnx.load(str(tmp_path / "b" / name))
    assert [n.op_type for n in m0.graph.node] == [n.op_type for n in m1.graph.node]
    w0 = [numpy_helper.to_array(i) for i in m0.graph.initializer if i.data_type == TensorProto.FLOAT16 and i.dims and max(i.dims) > 8]
    w1 = [numpy_helper.to_array(i) for i in m1.graph.initializer if i.data_type == TensorProto.FLOAT16 and i.dims and max(i.dims) > 8]
    assert w0 and all(a.shape == b.shape and not np.array_equal(a, b) for a, b in zip(w0, w1))
  assert {p.key: p.value for p in m1.metadata_props}["model_checkpoint"] == "modeld-msm-ref-tiny-seed1"


def _check_vision(sess):
  rng = np.random.default_rng(7)
  a, b = (sess.run(None, _frames(rng))[0] for _ in range(2))
  assert a.dtype == np.float16 and a.shape == (1, 1576)
  for out in (a, b):
    x = out.astype(np.float32)
    assert np.isfinite(x).all()
    # O(1): the parsers' exp (clipped at 11), sigmoid and softmax see unsaturated values
    assert 0.1 < x.std() < 3 and np.abs(x).max() < 11
  hs = VISION_SLICES["hidden_state"]
  assert np.abs(a[0, hs].astype(np.float32) - b[0, hs].astype(np.float32)).mean() > 0.1
  for name, s in VISION_SLICES.items():
    assert not np.array_equal(a[0, s], b[0, s]), name


def _check_policy(sess):
  rng = np.random.default_rng(8)
  base = _policy_inputs(rng)
  raw = sess.run(None, base)[0]
  assert raw.dtype == np.float16 and raw.shape == (1, 1000)
  ref = raw.astype(np.float32)
  assert np.isfinite(ref).all()
  assert 0.1 < ref.std() < 3 and np.abs(ref).max() < 11
  changed = {
    "features_buffer": rng.standard_normal((1, 25, 512)).astype(np.float16),
    "desire_pulse": np.zeros((1, 25, 8), np.float16),
    "traffic_convention": np.array([[0, 1]], np.float16),
  }
  for name, value in changed.items():
    out = sess.run(None, {**base, name: value})[0].astype(np.float32)
    assert np.isfinite(out).all()
    # every input moves the plan and the desire state, not just a few outputs
    for sl in (POLICY_SLICES["plan"], POLICY_SLICES["desire_state"]):
      assert np.abs(out[0, sl] - ref[0, sl]).mean() > 1e-3, (name, sl)
  big = {k: (v * 8 if k == "features_buffer" else v) for k, v in base.items()}  # compile checks feed randn*8
  assert np.isfinite(sess.run(None, big)[0].astype(np.float32)).all()


def test_tiny_vision_sane_and_input_dependent(tiny_dir):
  _check_vision(_session(tiny_dir / "driving_vision.onnx"))


def test_tiny_policy_sane_and_depends_on_every_input(tiny_dir):
  _check_policy(_session(tiny_dir / "driving_policy.onnx"))


def test_count_macs_on_a_hand_counted_graph():
  f = TensorProto.FLOAT
  inits = [numpy_helper.from_array(np.zeros(s, np.float32), n) for n, s in
           (("wc", (8, 3, 3, 3)), ("wd", (8, 1, 3, 3)), ("wg", (8 * 4 * 4, 10)), ("wm", (10, 6)), ("shape", ()))]
  inits[-1] = numpy_helper.from_array(np.array([1, 128], np.int64), "shape")
  nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),         # 8x4x4 out, 27 each
           helper.make_node("Conv", ["c", "wd"], ["d"], group=8, pads=[1, 1, 1, 1]),                # 8x4x4 out, 9 each
           helper.make_node("Reshape", ["d", "shape"], ["r"]),
           helper.make_node("Gemm", ["r", "wg"], ["g"]),                                            # 128*10
           helper.make_node("MatMul", ["g", "wm"], ["y"])]                                          # 10*6
  graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, (1, 3, 8, 8))], [helper.make_tensor_value_info("y", f, (1, 6))], inits)
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
  assert count_macs(model) == 128 * 27 + 128 * 9 + 128 * 10 + 10 * 6
  assert count_params(model) == 8 * 27 + 8 * 9 + 128 * 10 + 60


def test_full_hits_openpilot_budget():
  vision, policy = build_model("vision", "full", 0), build_model("policy", "full", 0)
  assert count_macs(vision) == pytest.approx(refmodels.TARGET_VISION_MACS, rel=0.10)
  assert count_macs(policy) == pytest.approx(refmodels.TARGET_POLICY_MACS, rel=0.10)
  assert count_params(vision) + count_params(policy) == pytest.approx(refmodels.TARGET_PARAMS, rel=0.10)
  ops = {n.op_type for m in (vision, policy) for n in m.graph.node}
  assert {"Conv", "Gemm", "MatMul", "Softmax", "Elu", "Tanh", "ReduceMean", "Sqrt", "Div", "Cast"} <= ops
  convs = [n for n in vision.graph.node if n.op_type == "Conv"]
  attrs = [{a.name: (list(a.ints) or a.i) for a in n.attribute} for n in convs]
  assert any(a["group"] > 1 for a in attrs) and any(a["strides"] == [2, 2] for a in attrs)


@pytest.mark.slow
def test_full_runs_sane_in_onnxruntime():
  _check_vision(_session(build_model("vision", "full", 0)))
  _check_policy(_session(build_model("policy", "full", 0)))


@pytest.mark.slow
def test_tiny_matches_in_tinygrad(tiny_dir):
  from tinygrad import Tensor
  from tinygrad.nn.onnx import OnnxRunner
  rng = np.random.default_rng(9)
  for kind, feed in (("vision", _frames(rng)), ("policy", _policy_inputs(rng))):
    path = tiny_dir / f"driving_{kind}.onnx"
    want = _session(path).run(None, feed)[0].astype(np.float32)
    got = OnnxRunner(str(path))({k: Tensor(v) for k, v in feed.items()})["outputs"].float().numpy()
    np.testing.assert_allclose(got, want, atol=0.05, rtol=0.02)


def test_cli_writes_both_and_reports(tmp_path, capsys):
  from cli.main import main
  assert main(["models", "--size", "tiny", "-o", str(tmp_path / "m"), "--seed", "3"]) == 0
  out = capsys.readouterr().out
  assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["driving_policy.onnx", "driving_vision.onnx"]  # no temp files left
  assert all((p.stat().st_mode & 0o777) == 0o644 for p in (tmp_path / "m").iterdir())
  assert "MACs" in out and "params" in out and out.count("seed=3") == 2
  meta = {p.key: p.value for p in onnx.load(str(tmp_path / "m" / "driving_policy.onnx")).metadata_props}
  assert meta["model_checkpoint"] == "modeld-msm-ref-tiny-seed3"


def test_cli_rejects_a_file_as_output_dir(tmp_path, capsys):
  from cli.main import main
  (tmp_path / "f").write_text("x")
  assert main(["models", "-o", str(tmp_path / "f")]) == 2
  assert "not a directory" in capsys.readouterr().err


def test_unknown_size_is_a_user_error():
  with pytest.raises(UserError, match="unknown model size"):
    build_model("vision", "huge")
