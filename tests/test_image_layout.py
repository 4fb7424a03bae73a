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
  assert image_layout.rewrite(src, dst) == {"stems_space_to_depth": 2}
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
