"""Reading openpilot's driving ONNX files: the I/O contract check and the metadata openpilot's tools read.

One loader for the real openpilot files and our reference models: `output_slices` comes from
metadata_props (base64 of a pickled dict name -> slice), input shapes from the graph.
"""
from __future__ import annotations

import base64
import hashlib
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from selfdrive_glue.errors import UserError

# name -> (shape, allowed element types); the real models feed fp16 graphs, our compile step feeds float32 casts
VISION_INPUTS = {"img": ((1, 12, 128, 256), {"uint8"}), "big_img": ((1, 12, 128, 256), {"uint8"})}
POLICY_INPUTS = {
  "features_buffer": ((1, 25, 512), {"float16", "float32"}),
  "desire_pulse": ((1, 25, 8), {"float16", "float32"}),
  "traffic_convention": ((1, 2), {"float16", "float32"}),
}
REQUIRED_SLICES = {"vision": ("hidden_state",), "policy": ("plan", "desire_state")}


@dataclass
class OnnxModelInfo:
  path: Path
  kind: str
  sha256: str
  input_shapes: dict[str, tuple[int, ...]]
  input_dtypes: dict[str, str]
  output_shapes: dict[str, tuple[int, ...]]
  output_slices: dict[str, slice]
  metadata: dict[str, str] = field(default_factory=dict)

  @property
  def output_width(self) -> int:
    return int(next(iter(self.output_shapes.values()))[1])


def sha256_file(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def decode_output_slices(b64: str) -> dict[str, slice]:
  # this pickle comes from the model file itself (openpilot's own format); only plain slices are accepted back
  try:
    raw = pickle.loads(base64.b64decode(b64))
  except Exception as e:
    raise UserError(f"metadata 'output_slices' is not base64 of a pickled dict ({type(e).__name__}); regenerate the model metadata") from None
  if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, slice) for k, v in raw.items()):
    raise UserError("metadata 'output_slices' must map names to slices")
  return raw


def encode_output_slices(slices: dict[str, slice]) -> str:
  return base64.b64encode(pickle.dumps(slices)).decode()


def _dims(t) -> tuple[int, ...]:
  return tuple(d.dim_value if d.HasField("dim_value") else 0 for d in t.type.tensor_type.shape.dim)


def load_model_info(path: str | Path, kind: str) -> OnnxModelInfo:
  """Parse and check one model file against openpilot's I/O contract. Raises UserError naming what is wrong."""
  import onnx
  from onnx import helper

  path = Path(path)
  if not path.is_file():
    raise UserError(f"{kind} model not found: {path}")
  try:
    model = onnx.load(str(path), load_external_data=False)
  except Exception as e:
    raise UserError(f"{kind} model {path} is not a readable ONNX file ({type(e).__name__}); re-download or regenerate it") from None
  graph = model.graph
  inits = {i.name for i in graph.initializer}
  inputs = {i.name: i for i in graph.input if i.name not in inits}
  expected = VISION_INPUTS if kind == "vision" else POLICY_INPUTS
  for name, (shape, dtypes_ok) in expected.items():
    if name not in inputs:
      raise UserError(f"{kind} model {path.name} has no input '{name}' (inputs: {', '.join(inputs) or 'none'}); is this the right model file?")
    got_shape = _dims(inputs[name])
    got_dtype = helper.tensor_dtype_to_np_dtype(inputs[name].type.tensor_type.elem_type).name
    if got_shape != shape:
      raise UserError(f"{kind} model input '{name}' has shape {got_shape}, expected {shape}")
    if got_dtype not in dtypes_ok:
      raise UserError(f"{kind} model input '{name}' has dtype {got_dtype}, expected {' or '.join(sorted(dtypes_ok))}")
  if len(graph.output) != 1:
    raise UserError(f"{kind} model must have exactly one output, found {len(graph.output)}")
  _check_ops(model, kind, path)
  meta = {p.key: p.value for p in model.metadata_props}
  if "output_slices" not in meta:
    raise UserError(f"{kind} model {path.name} has no 'output_slices' metadata; openpilot models carry it (metadata_props)")
  slices = decode_output_slices(meta["output_slices"])
  out_shapes = {o.name: _dims(o) for o in graph.output}
  width = next(iter(out_shapes.values()))[-1]
  for req in REQUIRED_SLICES[kind]:
    if req not in slices:
      raise UserError(f"{kind} model output_slices lack '{req}'")
  for name, s in slices.items():
    if s.stop is None or s.stop > width:
      raise UserError(f"{kind} output slice '{name}' {s} exceeds the output width {width}")
  return OnnxModelInfo(path, kind, sha256_file(path), {k: _dims(v) for k, v in inputs.items()},
                       {k: helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name for k, v in inputs.items()},
                       out_shapes, slices, {k: v for k, v in meta.items() if k != "output_slices"})


def _check_ops(model, kind: str, path: Path) -> None:
  from tinygrad.nn.onnx import onnx_ops
  unsupported = sorted({n.op_type for n in model.graph.node if n.op_type not in onnx_ops})
  if unsupported:
    raise UserError(f"{kind} model {path.name} uses op(s) tinygrad 0.14.0 cannot run: {', '.join(unsupported)}")
