"""The pointwise-convolution kernel of CPU artifacts (compile/cpu/pointwise.py): right values for every tile path and
part count, used only where it applies, and used by a compiled artifact."""
from __future__ import annotations

import ctypes
import json
import shutil
import subprocess

import numpy as np
import pytest

from compile.cpu import layout as cpu_layout
from compile.cpu import pointwise as cpu_pointwise


def _case(cin: int, cout: int, h: int, w: int, bias: bool = True, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((1, cin, h, w), dtype=np.float32)
  wt = rng.standard_normal((cout, cin, 1, 1), dtype=np.float32)
  b = rng.standard_normal(cout, dtype=np.float32) if bias else None
  ref = wt.reshape(cout, cin).astype(np.float64) @ x.reshape(cin, -1).astype(np.float64)
  if b is not None:
    ref += b[:, None]
  return x, wt, b, ref.reshape(1, cout, h, w)


def _run(x, wt, b, parts=None, jit=False, elu_alpha=None):
  from tinygrad import Tensor, TinyJit
  wpad, bpad = cpu_pointwise.pad(wt, b)
  wp, bp = Tensor(wpad).realize(), Tensor(bpad).realize()
  if not jit:
    return cpu_pointwise.conv(Tensor(x), wp, bp, wt.shape[0], parts, elu_alpha).numpy()
  f = TinyJit(lambda t: cpu_pointwise.conv(t, wp, bp, wt.shape[0], parts, elu_alpha).realize())
  for i in (3, 2, 1):   # other inputs first: the last call runs the captured kernel on x
    f(Tensor(x + i))
  return f(Tensor(x)).numpy()


@pytest.mark.parametrize("cin,cout,h,w,bias", [(96, 288, 4, 16, True), (7, 20, 4, 16, False), (33, 12, 8, 8, True), (16, 1, 2, 32, True)])
def test_kernel_matches_a_float64_product(cin, cout, h, w, bias):
  """cout not a multiple of the tile (20, 1), odd cin, one AVX-512 pixel tile, no bias: the padding rows are never stored."""
  x, wt, b, ref = _case(cin, cout, h, w, bias)
  out = _run(x, wt, b)
  assert out.shape == (1, cout, h, w)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 * np.sqrt(cin))


def test_parts_split_pixels_and_give_the_same_bytes():
  """Each output is the same sum whatever the split, so 1, 2, 3 and 7 parts (more parts than pixel tiles: some idle)
  agree bit for bit, and the JIT's captured kernel with them."""
  x, wt, b, ref = _case(24, 36, 6, 32)
  outs = [_run(x, wt, b, parts) for parts in (1, 2, 3, 7)] + [_run(x, wt, b, 2, jit=True)]
  for o in outs[1:]:
    np.testing.assert_array_equal(o, outs[0])
  np.testing.assert_allclose(outs[0], ref, rtol=1e-5, atol=1e-3)


def test_elu_epilogue_matches_elu_of_the_product():
  """Elu(alpha) applied as the tile is stored: both branches, alpha not 1, values far below zero (exp underflows, the
  result is -alpha) and near zero; against float64 expm1 within the fp32 product's own error."""
  x, wt, b, ref = _case(12, 18, 4, 32, seed=3)
  x *= 8   # products from about -100 to 100
  ref *= 8
  ref -= 7 * b[None, :, None, None]   # the bias is not scaled
  assert ref.min() < -90 and ref.max() > 0 and np.abs(ref).min() < 0.5
  want = np.where(ref > 0, ref, 0.5 * np.expm1(ref))
  for parts, jit in ((1, False), (2, True)):
    np.testing.assert_allclose(_run(x, wt, b, parts, jit, elu_alpha=0.5), want, rtol=1e-5, atol=1e-4)


# what clang may emit for each -march, as /proc/cpuinfo spells it: a CPU lacking one would die of SIGILL instead of skipping
MARCH_NEEDS = {"x86-64": {"sse2"}, "haswell": {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"},
               "skylake-avx512": {"avx2", "fma", "bmi1", "bmi2", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}}


@pytest.mark.skipif(shutil.which("clang") is None, reason="needs clang")
@pytest.mark.parametrize("march", list(MARCH_NEEDS))
def test_every_isa_tile_computes_the_same(tmp_path, march):
  """The preprocessor picks the tile by ISA (SSE 6x2 vectors of 4, AVX 6x2 of 8, AVX-512 6x4 of 16): the same source built
  for each, run here through ctypes where the CPU can, gives the product."""
  import platform
  have = set()
  if platform.system() == "Linux":
    have = {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split(":", 1)[1].split()}
  missing = sorted(MARCH_NEEDS[march] - have)
  if platform.machine() != "x86_64" or missing:
    pytest.skip(f"this CPU cannot run -march={march} (no {' '.join(missing) or 'x86_64'})")
  cin, cout, h, w = 40, 31, 4, 32
  x, wt, b, ref = _case(cin, cout, h, w)
  wpad, bpad = cpu_pointwise.pad(wt, b)
  src = tmp_path / "k.c"
  src.write_text(cpu_pointwise._source("k", cin, cout, h * w, 2))
  lib = tmp_path / "k.so"
  subprocess.run(["clang", "-shared", "-O2", "-fPIC", "-ffreestanding", "-fno-math-errno", f"-march={march}", str(src), "-o", str(lib)], check=True)
  k = ctypes.CDLL(str(lib)).k
  out = np.full((cout, h * w), np.nan, np.float32)
  for part in (0, 1):
    k(*(ctypes.c_void_p(a.ctypes.data) for a in (out, np.ascontiguousarray(x), wpad, bpad)), ctypes.c_int(part))
  np.testing.assert_allclose(out.reshape(ref.shape), ref, rtol=1e-5, atol=1e-3)


def test_supported_only_where_the_kernel_is_the_convolution():
  ok = dict(strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1], group=1)
  assert cpu_pointwise.supported((1, 8, 8, 8), (16, 8, 1, 1), ok)
  assert cpu_pointwise.supported((1, 8, 8, 8), (16, 8, 1, 1), {})
  for x, w, kw in [((2, 8, 8, 8), (16, 8, 1, 1), ok),                 # batch 2
                   ((1, 8, 8, 8), (16, 8, 3, 3), ok),                 # a window
                   ((1, 8, 8, 8), (16, 8, 1, 1), {**ok, "strides": [2, 2]}),
                   ((1, 8, 8, 8), (16, 8, 1, 1), {**ok, "pads": [1, 1, 1, 1]}),
                   ((1, 8, 8, 8), (16, 8, 1, 1), {**ok, "dilations": [2, 2]}),
                   ((1, 8, 8, 8), (16, 4, 1, 1), {**ok, "group": 2}),
                   ((1, 8, 8, 8), (16, 8, 1, 1), {**ok, "auto_pad": "SAME_UPPER"}),
                   ((1, 8, 4, 8), (16, 8, 1, 1), ok)]:                # 32 pixels: half an AVX-512 tile
    assert not cpu_pointwise.supported(x, w, kw), (x, w, kw)


def test_op_table_uses_the_kernel_for_constant_weights_only(monkeypatch):
  """Given the runner's constants, a pointwise Conv runs our kernel (weights padded once, reused by the next call); weights
  that are not constants, and MODELD_CPU_POINTWISE=0, keep tinygrad's convolution. Values agree either way."""
  from tinygrad import Tensor
  from tinygrad.nn.onnx import onnx_ops
  from tinygrad.uop.ops import Ops
  x, wt, b, ref = _case(16, 24, 4, 16)
  W, B, X = Tensor(wt).realize(), Tensor(b).realize(), Tensor(x).realize()
  used: dict = {}
  conv = cpu_layout.cpu_ops(onnx_ops, {id(W): W, id(B): B}, used)["Conv"]

  def kernels(t):
    return [u.src[0].arg.name for u in t.uop.toposort() if u.op is Ops.CALL and u.src[0].op is Ops.PROGRAM]

  out = conv(X, W, B)
  assert any(n.startswith("pointwise_16_24_4_16") for n in kernels(out)) and list(used) == [id(W)]
  padded = used[id(W)]
  np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)
  conv(X, W, B).realize()
  assert used[id(W)] is padded   # padded once
  other = conv(X, Tensor(wt), B)   # an equal tensor that is not one of the runner's constants
  assert kernels(other) == [] and len(used) == 1
  np.testing.assert_allclose(other.numpy(), ref, rtol=1e-5, atol=1e-4)
  monkeypatch.setenv("MODELD_CPU_POINTWISE", "0")
  off = cpu_layout.cpu_ops(onnx_ops, {id(W): W, id(B): B}, {})["Conv"](X, W, B)
  assert kernels(off) == []


@pytest.mark.xdist_group("cpu_artifact_1928")
def test_artifact_runs_the_pointwise_kernel(cpu_artifact_1928):
  """The compiled artifact's vision model runs its pointwise convolutions on the kernel (the compile checked the result
  against onnxruntime), and the manifest says how many."""
  meta = json.loads((cpu_artifact_1928 / "metadata.json").read_text())
  assert meta["cpu_layout"]["pointwise_kernel"]["vision"] > 0
  from tinygrad.uop.ops import Ops

  from artifact.format import verify_artifact
  from artifact.load import load_programs
  policy_jit = load_programs(verify_artifact(cpu_artifact_1928))["step"]
  names = [c.src[0].arg.name for c in policy_jit.captured.linear.src if c.op is Ops.CALL and c.src[0].op is Ops.PROGRAM]
  assert sum(n.startswith("pointwise_") for n in names) == meta["cpu_layout"]["pointwise_kernel"]["vision"], names


def _graph(tmp_path, hw=(8, 8)):
  """x -> Conv1x1 a -> Elu(0.5) -> ...: a fusable pair; Conv1x1 b read by an Elu and an Add: not; Conv3x3 c -> Elu: not;
  Conv1x1 d -> Elu(default alpha) as the last: fusable."""
  import onnx
  from onnx import TensorProto, helper, numpy_helper
  rng = np.random.default_rng(5)

  def init(name, *shape):
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)
  inits = [init("wa", 16, 8, 1, 1), init("ba", 16), init("wb", 16, 16, 1, 1), init("wc", 16, 16, 3, 3), init("wd", 8, 16, 1, 1)]
  nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"]), helper.make_node("Elu", ["a"], ["ea"], alpha=0.5),
           helper.make_node("Conv", ["ea", "wb"], ["b"]), helper.make_node("Elu", ["b"], ["eb"]), helper.make_node("Add", ["b", "eb"], ["s"]),
           helper.make_node("Conv", ["s", "wc"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Elu", ["c"], ["ec"]),
           helper.make_node("Conv", ["ec", "wd"], ["d"]), helper.make_node("Elu", ["d"], ["y"])]
  g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 8, *hw))],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 8, *hw))], inits)
  path = tmp_path / f"m{hw[0]}x{hw[1]}.onnx"
  onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
  return path


def test_fuse_conv_elu_takes_only_pointwise_convolutions_an_elu_alone_reads(tmp_path):
  import onnx
  src = _graph(tmp_path)
  counts = cpu_layout.rewrite(src, tmp_path / "out.onnx")
  g = onnx.load(str(tmp_path / "out.onnx")).graph
  fused = {n.output[0]: next(a.f for a in n.attribute if a.name == cpu_layout.ELU_ATTR) for n in g.node
           if any(a.name == cpu_layout.ELU_ATTR for a in n.attribute)}
  assert counts["conv_elu_fused"] == 2 and fused == {"a": 0.5, "d": 1.0}
  assert [n.op_type for n in g.node] == ["Conv", "Identity", "Conv", "Elu", "Add", "Conv", "Elu", "Conv", "Identity"]


@pytest.mark.parametrize("hw", [(8, 8), (4, 6)])
def test_fused_graph_matches_onnxruntime(tmp_path, hw):
  """The rewritten graph on the CPU op table against onnxruntime on the original: at 8x8 the pairs run as pointwise_elu
  kernels; at 4x6 (24 pixels, no whole tile) the same fused nodes fall back to tinygrad's convolution and Elu."""
  import onnxruntime as ort
  from tinygrad import Tensor
  from tinygrad.nn.onnx import OnnxRunner
  from tinygrad.uop.ops import Ops
  src = _graph(tmp_path, hw)
  cpu_layout.rewrite(src, tmp_path / "out.onnx")
  x = np.random.default_rng(1).standard_normal((1, 8, *hw)).astype(np.float32) * 3
  ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
  runner = cpu_layout.apply(OnnxRunner(tmp_path / "out.onnx"))
  y = runner({"x": Tensor(x)})["y"]
  names = [u.src[0].arg.name for u in y.uop.toposort() if u.op is Ops.CALL and u.src[0].op is Ops.PROGRAM]
  np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4)
  if hw == (8, 8):
    assert sorted(n.rsplit("_", 2)[0] for n in names) == ["pointwise_16_16", "pointwise_elu_16_8", "pointwise_elu_8_16"]
    assert len(runner.cpu_pointwise) == 3
  else:
    assert names == [] and runner.cpu_pointwise == {}
