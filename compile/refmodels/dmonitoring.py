"""A reference driver-monitoring model with openpilot's exact I/O contract, from a seed.

`dmonitoring_model.onnx`: `input_img` (1, 1440*960) uint8 (the warped Y plane of the driver camera) and `calib` (1, 3)
float32 (rpyCalib) -> `outputs` (1, 553) fp16, FLOAT16 inside like the shipped file, with openpilot's `output_slices`
metadata: per driver side (lhd, rhd) the 12 face descriptors (6 means, 6 log-stds), the sigmoid heads and 0.11.1's
sleep_prob, then wheel_on_right and a 512-wide feature block (the 0.10/0.11.0 model has the same layout less sleep_prob:
551 wide). The parser reads the slices by name, so either layout runs.

Two sizes: `tiny` (three strided convolutions, for tests) and `full` (the shipped model's size class: ~3.8 M fp16
parameters, ~7.5 MB, a downsampling convolution trunk over the 1440x960 image). Weights are random but scaled so the
heads see O(1) values (compile/refmodels/driving.py's builder and normalisation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compile.refmodels.driving import IR_VERSION, OPSET, WrittenModel, _Graph, count_macs, count_params, encode_output_slices
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import write_atomic

DM_W, DM_H = 1440, 960          # the warp's output: input_img is this image's Y plane, row-major
INPUT_LEN = DM_W * DM_H
FACE_DESCS = 12
SIGMOID_HEADS = ("face_prob", "left_eye_prob", "right_eye_prob", "left_blink_prob", "right_blink_prob", "sunglasses_prob",
                 "using_phone_prob", "sleep_prob")
SIDES = ("lhd", "rhd")
FEATURES = 512
FILE = "dmonitoring_model.onnx"


def _slices() -> dict[str, slice]:
  out, off = {}, 0
  for s in SIDES:
    for name, width in ((f"face_descs_{s}", FACE_DESCS), *((f"{h}_{s}", 1) for h in SIGMOID_HEADS)):
      out[name], off = slice(off, off + width), off + width
  out["wheel_on_right"], off = slice(off, off + 1), off + 1
  out["features"] = slice(off, off + FEATURES)
  return out


DM_SLICES = _slices()
DM_WIDTH = DM_SLICES["features"].stop


@dataclass(frozen=True)
class DMSpec:
  stem_ch: int
  stem_k: int                               # the stem's kernel and stride: a non-overlapping patch embedding
  stages: tuple[tuple[int, int], ...]       # (out_ch, blocks): each stage halves the image, then `blocks` residual blocks
  head_ch: int                              # pointwise squeeze before flatten
  fc: int
  head_hidden: int


DM_SIZES = {
  "tiny": DMSpec(stem_ch=8, stem_k=8, stages=((16, 0), (16, 0), (16, 0)), head_ch=8, fc=64, head_hidden=32),
  "full": DMSpec(stem_ch=16, stem_k=4, stages=((32, 1), (64, 1), (96, 1), (128, 1), (128, 0)), head_ch=64, fc=512,
                 head_hidden=512),
}


def _after(n: int, k: int, stride: int) -> int:
  p = (k - 1) // 2 if stride == 1 else (k - stride + 1) // 2
  return (n + 2 * p - k) // stride + 1


def _graph(g: _Graph, s: DMSpec) -> str:
  def cnorm(x, ch):
    return g.norm(x, 1, ch, (ch, 1, 1))

  img = g.op("Reshape", ["input_img", g.i64([1, 1, DM_H, DM_W])])
  x = g.op("Add", [g.op("Mul", [g.op("Cast", [img], to=10), g.f16(1 / 64)]), g.f16(-2.0)])
  x = g.elu(cnorm(g.conv(x, 1, s.stem_ch, s.stem_k, s.stem_k), s.stem_ch))
  h, w, ch = DM_H // s.stem_k, DM_W // s.stem_k, s.stem_ch
  for out_ch, blocks in s.stages:
    x = g.conv(x, ch, ch, 3, 2, group=ch) if ch > 8 else g.conv(x, ch, ch, 3, 2)   # strided depthwise (dense while narrow)
    h, w = _after(h, 3, 2), _after(w, 3, 2)
    x = g.elu(cnorm(g.conv(x, ch, out_ch, 1), out_ch))
    ch = out_ch
    for _ in range(blocks):
      r = g.elu(g.conv(x, ch, ch * 2, 1, gain=math.sqrt(2)))
      r = g.elu(g.conv(r, ch * 2, ch * 2, 3, group=ch * 2, gain=math.sqrt(2)))
      x = cnorm(g.op("Add", [x, g.conv(r, ch * 2, ch, 1)]), ch)
  x = g.op("Flatten", [g.elu(g.conv(x, ch, s.head_ch, 1, gain=math.sqrt(2)))], axis=1)
  feat = g.norm(g.elu(g.gemm(x, s.head_ch * h * w, s.fc, gain=math.sqrt(2))), 1, s.fc, (s.fc,))
  # calib enters beside the image features: the pose heads are relative to the camera's calibrated orientation
  calib = g.op("Cast", ["calib"], to=10)
  both = g.op("Concat", [feat, calib], axis=1)
  hid = g.norm(g.elu(g.gemm(both, s.fc + 3, s.head_hidden, gain=math.sqrt(2))), 1, s.head_hidden, (s.head_hidden,))
  heads = g.gemm(hid, s.head_hidden, DM_WIDTH - FEATURES, gain=0.5)
  features = g.norm(g.gemm(feat, s.fc, FEATURES), 1, FEATURES, (FEATURES,))
  return g.op("Concat", [heads, features], axis=1)


def build_dm_model(size: str = "tiny", seed: int = 0):
  """The driver-monitoring model of `size` as an onnx.ModelProto; the same (size, seed) gives identical bytes."""
  import onnx
  from onnx import TensorProto, helper

  if size not in DM_SIZES:
    raise UserError(f"unknown model size '{size}'; use one of: {', '.join(DM_SIZES)}")
  g = _Graph(np.random.default_rng([seed, 2]))   # its own stream: the driving models' weights do not move with it
  inputs = [helper.make_tensor_value_info("input_img", TensorProto.UINT8, (1, INPUT_LEN)),
            helper.make_tensor_value_info("calib", TensorProto.FLOAT, (1, 3))]
  out = _graph(g, DM_SIZES[size])
  g.nodes.append(helper.make_node("Identity", [out], ["outputs"], name="outputs"))
  graph = helper.make_graph(g.nodes, "dmonitoring", inputs, [helper.make_tensor_value_info("outputs", TensorProto.FLOAT16, (1, DM_WIDTH))],
                            g.inits)
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="modeld-msm", producer_version="ref")
  model.ir_version = IR_VERSION
  helper.set_model_props(model, {"output_slices": encode_output_slices(DM_SLICES), "model_checkpoint": f"modeld-msm-dm-ref-{size}-seed{seed}"})
  onnx.checker.check_model(model)
  return model


def dm_stand_in_model():
  """The trained driver-monitoring stand-in (tiny architecture, weights from `modeld-msm train-dm`), shipped as package data."""
  import onnx

  from compile.refmodels.driving import STAND_IN_DIR
  path = STAND_IN_DIR / FILE
  if not path.is_file():
    raise UserError(f"the trained stand-in model {path} is missing from this install; reinstall modeld-msm or use random weights")
  return onnx.load(str(path))


def write_dm_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, model=None, stand_in: bool = False) -> WrittenModel:
  """Write dmonitoring_model.onnx into out_dir atomically. model: an already built ModelProto; stand_in: the trained tiny
  stand-in (size must be tiny)."""
  out_dir = Path(out_dir)
  if stand_in:
    if size != "tiny":
      raise UserError("the trained stand-in is tiny only; drop --stand-in for the full size")
    model = dm_stand_in_model()
  if out_dir.exists() and not out_dir.is_dir():
    raise UserError(f"output path {out_dir} exists and is not a directory; pass a directory with -o")
  model = model if model is not None else build_dm_model(size, seed)
  try:
    out_dir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create output directory {out_dir}: {e.strerror}; choose a writable path") from None
  data = model.SerializeToString()
  write_atomic(out_dir / FILE, data)
  return WrittenModel(out_dir / FILE, len(data), count_macs(model), count_params(model))
