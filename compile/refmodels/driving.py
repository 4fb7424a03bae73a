"""Reference driving models with openpilot's exact I/O contract, from a seed.

We cannot ship comma's weights, so tests, benchmarks and the demo run models generated here:
`driving_vision.onnx` (img, big_img uint8 (1,12,128,256) -> outputs fp16 (1,1576)) and
`driving_policy.onnx` (features_buffer, desire_pulse, traffic_convention fp16 -> outputs fp16 (1,1000)),
FLOAT16 inside like the real files, with the same `output_slices` metadata openpilot's metadata tool reads.

Two sizes: `tiny` (a handful of small layers, for tests) and `full` (the compute and parameter budget of
openpilot 0.11.1's models: ~0.81 G MACs vision, ~36 M MACs policy, ~30 M parameters, with a representative
op mix). Weights are random but scaled so activations stay O(1): every block ends in a normalisation and
heads are scaled so the parsers' exp/sigmoid/softmax see meaningful values, not saturated ones.
Only ops that both onnxruntime and tinygrad 0.14.0's OnnxRunner implement are used.
"""
from __future__ import annotations

import base64
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selfdrive_glue.errors import UserError
from selfdrive_glue.files import write_atomic

OPSET = 17
IR_VERSION = 8  # the IR that goes with opset 17; newer onnx packages default to IRs older onnxruntimes refuse
IMG_SHAPE = (1, 12, 128, 256)
HISTORY, FEATURE_LEN, DESIRE_LEN, TRAFFIC_LEN = 25, 512, 8, 2

VISION_SLICES = {
  "meta": slice(0, 55), "desire_pred": slice(55, 87), "pose": slice(87, 99), "wide_from_device_euler": slice(99, 105),
  "road_transform": slice(105, 117), "lane_lines": slice(117, 645), "lane_lines_prob": slice(645, 653),
  "road_edges": slice(653, 917), "lead": slice(917, 1061), "lead_prob": slice(1061, 1064), "hidden_state": slice(1064, 1576),
}
POLICY_SLICES = {"plan": slice(0, 990), "desire_state": slice(990, 998), "pad": slice(998, 1000)}
VISION_WIDTH, POLICY_WIDTH = 1576, 1000

# openpilot 0.11.1 budget (docs/anchors.md §3): what `full` aims for
TARGET_VISION_MACS, TARGET_POLICY_MACS, TARGET_PARAMS = 810.7e6, 36.4e6, 30.0e6


@dataclass(frozen=True)
class VisionSpec:
  stem_ch: int                                  # per image; img and big_img get separate stems, then are concatenated
  stem_k: int
  stem_stride: int
  stages: tuple[tuple[int, int, int, int], ...]  # (out_ch, stride, expand, blocks); stride>1 starts with a depthwise downsample
  head_ch: int                                  # pointwise squeeze before flatten
  fc: int                                       # trunk vector width
  head_hidden: int                              # hidden width of each output head


@dataclass(frozen=True)
class PolicySpec:
  dim: int
  heads: int
  blocks: int
  mlp: int
  fc: int


SIZES: dict[str, tuple[VisionSpec, PolicySpec]] = {
  "tiny": (VisionSpec(stem_ch=8, stem_k=4, stem_stride=4, stages=((16, 2, 1, 1), (16, 2, 1, 0)), head_ch=4, fc=64, head_hidden=32),
           PolicySpec(dim=32, heads=2, blocks=1, mlp=64, fc=64)),
  "full": (VisionSpec(stem_ch=24, stem_k=3, stem_stride=2, stages=((48, 1, 2, 1), (96, 2, 3, 2), (192, 2, 3, 2), (384, 2, 4, 1)),
                      head_ch=64, fc=1024, head_hidden=1024),
           PolicySpec(dim=256, heads=4, blocks=1, mlp=1024, fc=1792)),
}

# Vision heads: trunk vector -> hidden -> slice. Grouped so related outputs share a hidden layer, like real multi-head models.
_VISION_HEADS = (("meta", "desire_pred", "lane_lines_prob", "lead_prob"), ("pose", "wide_from_device_euler", "road_transform"),
                 ("lane_lines", "road_edges"), ("lead",))
_OUT_SCALE = 0.5   # head outputs ~N(0, 0.5): exp() of a std half stays in (0.2, 5) mostly, sigmoid/softmax are not saturated


class _Graph:
  """A tiny ONNX graph builder: fp16 initializers drawn from one rng in build order, so a seed fixes every byte."""

  def __init__(self, rng: np.random.Generator):
    self.rng, self._n = rng, 0
    self.nodes: list = []
    self.inits: list = []

  def name(self, prefix: str) -> str:
    self._n += 1
    return f"{prefix}_{self._n}"

  def const(self, arr: np.ndarray, prefix="c") -> str:
    from onnx import numpy_helper
    n = self.name(prefix)
    self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), n))
    return n

  def f16(self, arr) -> str:
    return self.const(np.asarray(arr, dtype=np.float16), "w")

  def i64(self, vals) -> str:
    return self.const(np.asarray(vals, dtype=np.int64), "shape")

  def weight(self, shape, fan_in: int, gain=1.0) -> str:
    return self.f16(self.rng.standard_normal(shape, dtype=np.float32) * (gain / math.sqrt(fan_in)))

  def op(self, op_type: str, inputs: list[str], **attrs) -> str:
    from onnx import helper
    out = self.name(op_type.lower())
    self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
    return out

  # layers
  def conv(self, x, cin, cout, k, stride=1, group=1, gain=1.0):
    fan_in = cin // group * k * k
    w = self.weight((cout, cin // group, k, k), fan_in, gain)
    b = self.f16(self.rng.standard_normal(cout, dtype=np.float32) * 0.02)
    p = (k - 1) // 2 if stride == 1 else (k - stride + 1) // 2
    return self.op("Conv", [x, w, b], kernel_shape=[k, k], strides=[stride, stride], pads=[p, p, p, p], group=group)

  def gemm(self, x, fin, fout, gain=1.0):
    w = self.weight((fin, fout), fin, gain)
    b = self.f16(self.rng.standard_normal(fout, dtype=np.float32) * 0.02)
    return self.op("Gemm", [x, w, b])

  def linear(self, x, fin, fout, gain=1.0):
    """x (..., fin) @ W + b: MatMul+Add so it applies per timestep on 3-D inputs."""
    w = self.weight((fin, fout), fin, gain)
    b = self.f16(self.rng.standard_normal(fout, dtype=np.float32) * 0.02)
    return self.op("Add", [self.op("MatMul", [x, w]), b])

  def norm(self, x, axis: int, ch: int, bshape: tuple[int, ...]):
    """Normalise over one axis with ReduceMean/Sqrt/Div (LayerNorm-style, spelled out so every runtime has it).

    Always over channels/features (<= 1792 values), never over space: a short fp16 reduction stays accurate."""
    mean = self.op("ReduceMean", [x], axes=[axis], keepdims=1)
    # pre-scaled by 1/8 before squaring: d*d stays finite in fp16 up to |d| ~ 2000 (compile checks feed randn*8 inputs)
    d = self.op("Mul", [self.op("Sub", [x, mean]), self.f16(0.125)])
    var = self.op("ReduceMean", [self.op("Mul", [d, d])], axes=[axis], keepdims=1)
    std = self.op("Sqrt", [self.op("Add", [var, self.f16(1e-4)])])
    y = self.op("Div", [d, std])
    gamma = self.f16((1.0 + 0.1 * self.rng.standard_normal(ch, dtype=np.float32)).reshape(bshape))
    beta = self.f16((0.1 * self.rng.standard_normal(ch, dtype=np.float32)).reshape(bshape))
    return self.op("Add", [self.op("Mul", [y, gamma]), beta])

  def elu(self, x):
    return self.op("Elu", [x], alpha=1.0)

  def gelu(self, x):
    # tanh form from elementary ops (opset 17 has no Gelu): sqrt(2/pi) * x * (1 + 0.044715 x^2), ordered so no fp16 x^3 overflows
    t = self.op("Add", [self.op("Mul", [self.op("Mul", [x, x]), self.f16(0.044715)]), self.f16(1.0)])
    inner = self.op("Mul", [self.op("Mul", [x, t]), self.f16(math.sqrt(2 / math.pi))])
    return self.op("Mul", [self.op("Mul", [x, self.f16(0.5)]), self.op("Add", [self.op("Tanh", [inner]), self.f16(1.0)])])


def _vision_graph(g: _Graph, s: VisionSpec) -> str:
  def cnorm(x, ch):
    return g.norm(x, 1, ch, (ch, 1, 1))

  stems = []
  for name in ("img", "big_img"):
    # uint8 YUV -> about [-2, 2]; the real models also take raw uint8 and scale inside
    x = g.op("Add", [g.op("Mul", [g.op("Cast", [name], to=10), g.f16(1 / 64)]), g.f16(-2.0)])
    stems.append(g.conv(x, IMG_SHAPE[1], s.stem_ch, s.stem_k, s.stem_stride))
  ch = 2 * s.stem_ch
  x = g.elu(cnorm(g.op("Concat", stems, axis=1), ch))
  for out_ch, stride, expand, blocks in s.stages:
    if stride > 1 or out_ch != ch:  # strided depthwise + pointwise downsample
      x = g.conv(x, ch, ch, 3, stride, group=ch)
      x = g.elu(cnorm(g.conv(x, ch, out_ch, 1), out_ch))
      ch = out_ch
    for _ in range(blocks):  # inverted residual: pointwise expand, depthwise 3x3, pointwise project
      h = g.elu(g.conv(x, ch, ch * expand, 1, gain=math.sqrt(2)))
      h = g.elu(g.conv(h, ch * expand, ch * expand, 3, group=ch * expand, gain=math.sqrt(2)))
      h = g.conv(h, ch * expand, ch, 1)
      x = cnorm(g.op("Add", [x, h]), ch)
  x = g.elu(g.conv(x, ch, s.head_ch, 1, gain=math.sqrt(2)))
  flat = s.head_ch * (IMG_SHAPE[2] // 2 ** _down(s)) * (IMG_SHAPE[3] // 2 ** _down(s))
  x = g.op("Flatten", [x], axis=1)
  feat = g.norm(g.elu(g.gemm(x, flat, s.fc, gain=math.sqrt(2))), 1, s.fc, (s.fc,))
  outs = {}
  for group in _VISION_HEADS:
    width = sum(VISION_SLICES[k].stop - VISION_SLICES[k].start for k in group)
    h = g.norm(g.elu(g.gemm(feat, s.fc, s.head_hidden, gain=math.sqrt(2))), 1, s.head_hidden, (s.head_hidden,))
    y = g.gemm(h, s.head_hidden, width, gain=_OUT_SCALE)
    off = 0
    for k in group:
      w = VISION_SLICES[k].stop - VISION_SLICES[k].start
      outs[k] = g.op("Slice", [y, g.i64([off]), g.i64([off + w]), g.i64([1])])
      off += w
  # hidden_state feeds the policy's features_buffer: a normalised projection of the trunk, so it is O(1) and input-dependent
  outs["hidden_state"] = g.norm(g.gemm(feat, s.fc, FEATURE_LEN), 1, FEATURE_LEN, (FEATURE_LEN,))
  order = sorted(VISION_SLICES, key=lambda k: VISION_SLICES[k].start)
  return g.op("Concat", [outs[k] for k in order], axis=1)


def _down(s: VisionSpec) -> int:
  return int(math.log2(s.stem_stride)) + sum(int(math.log2(st)) for _, st, _, _ in s.stages)


def _policy_graph(g: _Graph, s: PolicySpec) -> str:
  d, hd = s.dim, s.dim // s.heads

  def lnorm(x):
    return g.norm(x, 2, d, (d,))

  x = g.op("Concat", ["features_buffer", "desire_pulse"], axis=2)
  # desire_pulse is mostly zeros with rare ones: a larger gain so a pulse visibly moves the plan
  x = g.linear(x, FEATURE_LEN + DESIRE_LEN, d, gain=2.0)
  tc = g.op("Reshape", [g.linear("traffic_convention", TRAFFIC_LEN, d), g.i64([1, 1, d])])
  pos = g.f16(0.5 * g.rng.standard_normal((1, HISTORY, d), dtype=np.float32))
  x = lnorm(g.op("Add", [g.op("Add", [x, tc]), pos]))
  for _ in range(s.blocks):
    # softmax attention over the 25 timesteps
    qkv = g.linear(lnorm(x), d, 3 * d)
    qkv = g.op("Transpose", [g.op("Reshape", [qkv, g.i64([1, HISTORY, 3, s.heads, hd])])], perm=[2, 0, 3, 1, 4])  # 3,1,H,T,hd
    q, k, v = (g.op("Reshape", [g.op("Slice", [qkv, g.i64([i]), g.i64([i + 1]), g.i64([0])]), g.i64([1, s.heads, HISTORY, hd])])
               for i in range(3))
    att = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]), g.f16(1 / math.sqrt(hd))])
    o = g.op("MatMul", [g.op("Softmax", [att], axis=-1), v])
    o = g.op("Reshape", [g.op("Transpose", [o], perm=[0, 2, 1, 3]), g.i64([1, HISTORY, d])])
    x = g.op("Add", [x, g.linear(o, d, d)])
    x = g.op("Add", [x, g.linear(g.gelu(g.linear(lnorm(x), d, s.mlp, gain=math.sqrt(2))), s.mlp, d)])
  x = g.op("Flatten", [lnorm(x)], axis=1)
  h = g.norm(g.gelu(g.gemm(x, HISTORY * d, s.fc, gain=math.sqrt(2))), 1, s.fc, (s.fc,))
  parts = [g.gemm(h, s.fc, sl.stop - sl.start, gain=_OUT_SCALE) for sl in sorted(POLICY_SLICES.values(), key=lambda sl: sl.start)]
  return g.op("Concat", parts, axis=1)


def encode_output_slices(slices: dict[str, slice]) -> str:
  """openpilot's encoding: metadata_props['output_slices'] = base64(pickle(dict name -> slice))."""
  return base64.b64encode(pickle.dumps(slices, protocol=4)).decode()


def build_model(kind: str, size: str = "tiny", seed: int = 0, policy_spec: PolicySpec | None = None):
  """Build `vision` or `policy` of `size` ('tiny'|'full') as an onnx.ModelProto; the same (kind, size, seed) gives identical bytes.
  policy_spec replaces the size's policy architecture (master's combined model has a bigger budget than 0.11.1's pair)."""
  import onnx
  from onnx import TensorProto, helper

  if size not in SIZES:
    raise UserError(f"unknown model size '{size}'; use one of: {', '.join(SIZES)}")
  if kind not in ("vision", "policy"):
    raise UserError(f"unknown model kind '{kind}'; use vision or policy")
  vspec, pspec = SIZES[size]
  pspec = policy_spec or pspec
  # separate streams per model so changing one architecture does not reshuffle the other's weights
  g = _Graph(np.random.default_rng([seed, 0 if kind == "vision" else 1]))
  f16 = TensorProto.FLOAT16
  if kind == "vision":
    inputs = [helper.make_tensor_value_info(n, TensorProto.UINT8, IMG_SHAPE) for n in ("img", "big_img")]
    out, width, slices = _vision_graph(g, vspec), VISION_WIDTH, VISION_SLICES
  else:
    inputs = [helper.make_tensor_value_info("features_buffer", f16, (1, HISTORY, FEATURE_LEN)),
              helper.make_tensor_value_info("desire_pulse", f16, (1, HISTORY, DESIRE_LEN)),
              helper.make_tensor_value_info("traffic_convention", f16, (1, TRAFFIC_LEN))]
    out, width, slices = _policy_graph(g, pspec), POLICY_WIDTH, POLICY_SLICES
  g.nodes.append(helper.make_node("Identity", [out], ["outputs"], name="outputs"))
  graph = helper.make_graph(g.nodes, f"driving_{kind}", inputs, [helper.make_tensor_value_info("outputs", f16, (1, width))], g.inits)
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="modeld-msm", producer_version="ref")
  model.ir_version = IR_VERSION
  helper.set_model_props(model, {"output_slices": encode_output_slices(slices), "model_checkpoint": f"modeld-msm-ref-{size}-seed{seed}"})
  onnx.checker.check_model(model)
  return model


def _shapes(model) -> dict[str, tuple[int, ...]]:
  import onnx
  inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
  vis = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
  shapes = {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim) for v in vis}
  shapes.update({i.name: tuple(i.dims) for i in model.graph.initializer})
  return shapes


def count_macs(model) -> int:
  """Multiply-accumulates of Conv, Gemm and MatMul nodes (the convention of the 0.11.1 count: other ops are ignored)."""
  shapes, macs = _shapes(model), 0
  for n in model.graph.node:
    if n.op_type == "Conv":
      w = shapes[n.input[1]]
      macs += math.prod(shapes[n.output[0]]) * math.prod(w[1:])
    elif n.op_type == "Gemm":
      a = shapes[n.input[0]]
      macs += math.prod(shapes[n.output[0]]) * a[-1]  # no transA in our models; real ones are counted the same way
    elif n.op_type == "MatMul":
      macs += math.prod(shapes[n.output[0]]) * shapes[n.input[0]][-1]
  return macs


def count_params(model) -> int:
  """Elements of floating-point initializers (weights); int64 shape constants do not count."""
  from onnx import TensorProto
  floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
  return sum(math.prod(i.dims) for i in model.graph.initializer if i.data_type in floats)


@dataclass(frozen=True)
class WrittenModel:
  path: Path
  bytes: int
  macs: int
  params: int


STAND_IN_DIR = Path(__file__).resolve().parents[1] / "stand_in"


def stand_in_model(kind: str):
  """The trained stand-in (tiny architecture, weights from `modeld-msm train`), shipped as package data."""
  import onnx

  path = STAND_IN_DIR / f"driving_{kind}.onnx"
  if not path.is_file():
    raise UserError(f"the trained stand-in model {path} is missing from this install; reinstall modeld-msm or use random weights")
  return onnx.load(str(path))


def write_models(out_dir: str | Path, size: str = "tiny", seed: int = 0, stand_in: bool = False) -> dict[str, WrittenModel]:
  """Write driving_vision.onnx and driving_policy.onnx into out_dir, each atomically (selfdrive_glue.files.write_atomic).

  stand_in: the trained stand-in pair (tiny only; `seed` is then ignored) instead of random weights."""
  if stand_in and size != "tiny":
    raise UserError(f"the trained stand-in exists for size 'tiny' only, not '{size}'; use random weights for '{size}'")
  out_dir = Path(out_dir)
  if out_dir.exists() and not out_dir.is_dir():
    raise UserError(f"output path {out_dir} exists and is not a directory; pass a directory with -o")
  # both models first: a failure to build them (onnx missing on a base install) leaves no folder behind
  models = {kind: stand_in_model(kind) if stand_in else build_model(kind, size, seed) for kind in ("vision", "policy")}
  try:
    out_dir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create output directory {out_dir}: {e.strerror}; choose a writable path") from None
  written = {}
  for kind, model in models.items():
    data = model.SerializeToString()
    path = out_dir / f"driving_{kind}.onnx"
    write_atomic(path, data)
    written[kind] = WrittenModel(path, len(data), count_macs(model), count_params(model))
  return written
