"""compile/image_layout.py: a convolution whose window is its stride, over channels that do not fill a texel, becomes a 1x1
convolution over k x k blocks; the same function, checked by onnxruntime and by tinygrad against the original graph."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compile import image_layout
from selfdrive_glue.errors import UserError


def _conv(name, x, w, **attrs):
  return helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [name], name=name, **attrs)


def _model(path, rng):
  """Inputs a (1,3,8,12) and d (1,1,16,24) uint8; five convolutions, two of which qualify (c3 and d1)."""
  weights = {"c3": (5, 3, 2, 2), "c4": (4, 4, 2, 2), "p1": (4, 1, 3, 3), "d1": (6, 1, 4, 4), "odd": (2, 1, 3, 3)}
  inits = []
  for name, shape in weights.items():
    inits += [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), f"{name}_w"),
              numpy_helper.from_array(rng.standard_normal(shape[0]).astype(np.float32), f"{name}_b")]
  inits.append(numpy_helper.from_array(np.float32(1 / 255), "scale"))
  nodes = [
    _conv("c3", "a", "c3_w", kernel_shape=[2, 2], strides=[2, 2]),                       # 3 channels, 2x2 stride 2: rewritten
    helper.make_node("Concat", ["c3", "c3"], ["c3x2"], axis=1),
    helper.make_node("Slice", ["c3x2", "s0", "s4", "s1"], ["four"]),
    _conv("c4", "four", "c4_w", kernel_shape=[2, 2], strides=[2, 2]),                    # 4 channels fill a texel: kept
    helper.make_node("Cast", ["d"], ["df"], to=TensorProto.FLOAT),
    helper.make_node("Mul", ["df", "scale"], ["dn"]),
    _conv("p1", "dn", "p1_w", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),   # padded: kept
    _conv("d1", "dn", "d1_w", kernel_shape=[4, 4], strides=[4, 4]),                      # the DM stem's shape: rewritten
    _conv("odd", "dn", "odd_w", kernel_shape=[3, 3], strides=[3, 3]),                    # 16x24 not cut by 3: kept
  ]
  inits += [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("s0", 0), ("s4", 4), ("s1", 1))]
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 3, 8, 12]),
                                     helper.make_tensor_value_info("d", TensorProto.UINT8, [1, 1, 16, 24])],
                        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("c4", "p1", "d1", "odd")], inits)
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
  m.ir_version = 8
  onnx.save(m, str(path))


def _feeds(rng):
  return {"a": rng.standard_normal((1, 3, 8, 12)).astype(np.float32), "d": rng.integers(0, 256, (1, 1, 16, 24), dtype=np.uint8)}


def test_window_equal_to_stride_over_partial_texels_becomes_a_pointwise_convolution(tmp_path):
  rng = np.random.default_rng(0)
  src, dst = tmp_path / "m.onnx", tmp_path / "image_m.onnx"
  _model(src, rng)
  assert image_layout.rewrite(src, dst) == {"stems_space_to_depth": 2, "elu_as_select": 0}
  convs = {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in onnx.load(str(dst)).graph.node if n.op_type == "Conv"}
  assert convs["c3"]["kernel_shape"] == [1, 1] and convs["d1"]["kernel_shape"] == [1, 1]
  assert convs["c4"]["kernel_shape"] == [2, 2] and convs["p1"]["kernel_shape"] == [3, 3] and convs["odd"]["kernel_shape"] == [3, 3]
  feeds = _feeds(rng)
  want = ort.InferenceSession(str(src)).run(None, feeds)
  got = ort.InferenceSession(str(dst)).run(None, feeds)
  for w, g in zip(want, got):
    assert w.shape == g.shape
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)   # only the order of each output's k*k*c products changed
  from tinygrad.nn.onnx import OnnxRunner
  tg = OnnxRunner(str(dst))({k: v for k, v in feeds.items()})
  for name, w in zip(("c4", "p1", "d1", "odd"), want):
    np.testing.assert_allclose(tg[name].numpy(), w, rtol=1e-4, atol=1e-4)


def test_a_weight_two_convolutions_share_is_left_alone(tmp_path):
  w = numpy_helper.from_array(np.ones((2, 1, 2, 2), np.float32), "w")
  nodes = [helper.make_node("Conv", ["x", "w"], [o], kernel_shape=[2, 2], strides=[2, 2]) for o in ("y", "z")]
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
                        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", "z")], [w])
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
  assert image_layout.space_to_depth_stems(m) == 0


def test_the_switch(monkeypatch):
  from tinygrad.helpers import Context

  from compile.image_layout import images
  with Context(IMAGE=2):
    assert images()
    monkeypatch.setenv(image_layout.ENV, "off")
    assert not images() and "off" in image_layout.summary({})
    monkeypatch.setenv(image_layout.ENV, "yes")
    with pytest.raises(UserError, match="MODELD_IMAGE_LAYOUT=yes: use auto or off"):
      images()
  monkeypatch.delenv(image_layout.ENV)
  assert not images()   # no images, nothing to rewrite for


def _ln_elu_depthwise(path, dtype=TensorProto.FLOAT, alpha=1.0):
  """x (1,16,32,136): a layer norm over the channels per pixel, Elu (alpha), a 3x3 stride-2 depthwise convolution, Elu of
  the convolution (left alone by the rewrite)."""
  rng = np.random.default_rng(1)
  npt = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
  inits = [numpy_helper.from_array(rng.standard_normal((16, 1, 3, 3)).astype(npt), "dw_w"),
           numpy_helper.from_array(rng.standard_normal(16).astype(npt), "dw_b"),
           numpy_helper.from_array(np.array(1e-4, npt), "eps"),
           numpy_helper.from_array(rng.standard_normal((16, 1, 1)).astype(npt), "gamma"),
           numpy_helper.from_array(rng.standard_normal((16, 1, 1)).astype(npt), "beta")]
  nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1]), helper.make_node("Sub", ["x", "m"], ["d"]),
           helper.make_node("Mul", ["d", "d"], ["d2"]), helper.make_node("ReduceMean", ["d2"], ["v"], axes=[1]),
           helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["s"]),
           helper.make_node("Div", ["d", "s"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["ng"]),
           helper.make_node("Add", ["ng", "beta"], ["nb"]), helper.make_node("Elu", ["nb"], ["e"], name="elu1", alpha=alpha),
           helper.make_node("Conv", ["e", "dw_w", "dw_b"], ["c"], group=16, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
           helper.make_node("Elu", ["c"], ["y"])]
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, [1, 16, 32, 136])],
                        [helper.make_tensor_value_info("y", dtype, None)], inits)
  m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
  m.ir_version = 8
  onnx.save(m, str(path))
  return {"x": (3 * rng.standard_normal((1, 16, 32, 136))).astype(npt)}


def test_elu_as_a_select_is_the_same_values(tmp_path):
  src, dst = tmp_path / "m.onnx", tmp_path / "image_m.onnx"
  feeds = _ln_elu_depthwise(src, alpha=0.5)
  feeds["x"][0, :, 0, :4] = [[-80.0, -0.0, 0.0, 60.0]]   # exp's underflow and overflow sides, both zeros
  assert image_layout.rewrite(src, dst) == {"stems_space_to_depth": 0, "elu_as_select": 1}
  assert [n.input[0] for n in onnx.load(str(dst)).graph.node if n.op_type == "Elu"] == ["c"]   # the convolution's Elu stays
  want = ort.InferenceSession(str(src)).run(None, feeds)[0]
  got = ort.InferenceSession(str(dst)).run(None, feeds)[0]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  from tinygrad.nn.onnx import OnnxRunner
  a, b = (OnnxRunner(str(p))(dict(feeds))["y"].numpy() for p in (src, dst))
  np.testing.assert_array_equal(b, a)   # exp(x) - 1 == -(1 - exp(x)): tinygrad gives the same bits either way


def test_elu_as_a_select_keeps_fp16_operands_fp16(tmp_path):
  src, dst = tmp_path / "m.onnx", tmp_path / "image_m.onnx"
  feeds = _ln_elu_depthwise(src, TensorProto.FLOAT16)
  image_layout.rewrite(src, dst)
  got = ort.InferenceSession(str(dst)).run(None, feeds)[0]   # onnxruntime refuses mixed fp16/fp32 operands
  np.testing.assert_allclose(got.astype(np.float32), ort.InferenceSession(str(src)).run(None, feeds)[0].astype(np.float32), rtol=2e-3, atol=2e-3)


def test_elu_as_a_select_fuses_the_normalisation_into_the_image_write(tmp_path):
  """Under images, the Elu before a depthwise convolution of padded rows costs a kernel and an fp32 buffer; the select
  form does not (tinygrad's scheduler, run on the CPU device with the QCOM capture's image flags)."""
  from tinygrad import Tensor
  from tinygrad.helpers import Context, GlobalCounters
  from tinygrad.nn.onnx import OnnxRunner
  src, dst = tmp_path / "m.onnx", tmp_path / "image_m.onnx"
  feeds = _ln_elu_depthwise(src)
  image_layout.rewrite(src, dst)
  kernels, outs = [], []
  for p in (src, dst):
    with Context(IMAGE=2, FLOAT16=1, NOLOCALS=1):
      run = OnnxRunner(str(p))
      x = Tensor(feeds["x"]).realize()
      run({"x": x})["y"].realize()   # the weights' copies to the device happen once, here
      GlobalCounters.reset()
      outs.append(run({"x": x})["y"].realize().numpy())
      kernels.append(GlobalCounters.kernel_count)
  assert kernels[1] == kernels[0] - 1, kernels
  np.testing.assert_array_equal(outs[1], outs[0])
