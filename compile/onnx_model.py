"""Reading openpilot's driving ONNX files: the I/O contract check and the metadata openpilot's tools read.

One loader for the real openpilot files and our reference models: `output_slices` comes from
metadata_props (base64 of a pickled dict name -> slice), input shapes from the graph.
"""
from __future__ import annotations

import base64
import io
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifact import kinds
from compile.stateful_contract import check_stateful, is_stateful
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import sha256_file

# name -> (shape, allowed element types); the real models feed fp16 graphs, our compile step feeds float32 casts
VISION_INPUTS = {"img": ((1, 12, 128, 256), {"uint8"}), "big_img": ((1, 12, 128, 256), {"uint8"})}
POLICY_INPUTS = {
  "features_buffer": ((1, 25, 512), {"float16", "float32"}),
  "desire_pulse": ((1, 25, 8), {"float16", "float32"}),
  "traffic_convention": ((1, 2), {"float16", "float32"}),
}
# the driver-monitoring model: the warped driver-camera Y plane (1440x960) and rpyCalib (docs: openpilot's DM contract)
DM_INPUTS = {"input_img": ((1, 1440 * 960), {"uint8"}), "calib": ((1, 3), {"float32", "float16"})}
# openpilot master's combined driving model (PR #38173): 24 past features (the graph appends this frame's) and the action delays
SUPERCOMBO_INPUTS = {**VISION_INPUTS, "features_buffer": ((1, 24, 512), {"float16", "float32"}),
                     "desire_pulse": POLICY_INPUTS["desire_pulse"], "traffic_convention": POLICY_INPUTS["traffic_convention"],
                     "action_t": ((1, 2), {"float16", "float32"})}
INPUTS: dict[str, dict[str, Any]] = {"vision": VISION_INPUTS, "policy": POLICY_INPUTS, "dmonitoring": DM_INPUTS, "supercombo": SUPERCOMBO_INPUTS,
                                     "stateful": {}}
# contracts whose states, inputs and outputs the graph itself declares (compile/stateful_contract.py), not a fixed table
GRAPH_DECLARED = {"stateful"}
# what each contract's file is called in openpilot's tree, for messages
FILES = {"vision": "driving_vision.onnx (openpilot 0.11)", "policy": "driving_policy.onnx (openpilot 0.11)",
         "dmonitoring": "dmonitoring_model.onnx", "supercombo": "driving_supercombo.onnx (openpilot master since PR #38173)",
         "stateful": "driving_supercombo.onnx (openpilot master since 2026-09, stateful)"}
# the heads dmonitoringmodeld parses, per driver side; sleep_prob (0.11.1) is read when present
DM_HEADS = ("face_descs", "face_prob", "left_eye_prob", "right_eye_prob", "left_blink_prob", "right_blink_prob", "sunglasses_prob",
            "using_phone_prob")
# master's parser needs every head but action (optional: the plan is the fallback) and hidden_state (fed back, not parsed)
SUPERCOMBO_HEADS = ("lane_lines", "lane_lines_prob", "road_edges", "meta", "desire_pred", "pose", "wide_from_device_euler",
                    "road_transform", "plan", "lead", "lead_prob", "desire_state")
REQUIRED_SLICES = {"vision": ("hidden_state",), "policy": ("plan", "desire_state"), "supercombo": (*SUPERCOMBO_HEADS, "hidden_state"),
                   "stateful": SUPERCOMBO_HEADS,   # the graph pushes its own hidden state: the slice need not be published
                   "dmonitoring": (*(f"{h}_{s}" for s in ("lhd", "rhd") for h in DM_HEADS), "wheel_on_right")}
# widths the parsers rely on: 6 means + 6 log-stds per face; every other DM head is one value
SLICE_WIDTHS = {"dmonitoring": {f"face_descs_{s}": 12 for s in ("lhd", "rhd")}}
DM_SCALARS = {"wheel_on_right", *(f"{h}_{s}" for s in ("lhd", "rhd") for h in (*DM_HEADS[1:], "sleep_prob"))}
SCALAR_SLICES = {"dmonitoring": DM_SCALARS}   # one value each, as the parser reads them
LEAST_WIDTHS = {"supercombo": {"action": 2}, "stateful": {"action": 2}}  # optional slices, at least this wide where present
FEATURE_LEN = POLICY_INPUTS["features_buffer"][0][-1]   # the vision's hidden_state slice fills one features_buffer row


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


# what a pickle (protocols 0-5) of a dict of str -> slice(int | None, ...) names: slice is its only global; dict, str, int
# and None have opcodes of their own. Protocols 0-2 spell the module the Python 2 way.
_SLICE_GLOBALS = {("builtins", "slice"), ("__builtin__", "slice")}


class _SliceUnpickler(pickle.Unpickler):
  """Plain unpickling calls whatever the pickle names (`os.system` included), and this pickle comes from the model file:
  every global but `slice` is refused by name, before anything is imported. Extension codes and persistent ids go
  through find_class / persistent_load too, so nothing else can reach a callable."""

  def find_class(self, module: str, name: str):
    if (module, name) in _SLICE_GLOBALS:
      return slice
    raise UserError(f"metadata 'output_slices' asks for {module}.{name}, which slice metadata never needs (a dict of names to "
                    "slices); refused without loading it: the model file was tampered with or is not an openpilot model")

  def persistent_load(self, pid):
    raise UserError("metadata 'output_slices' holds a persistent id, which slice metadata never has; refused")


def decode_output_slices(b64: str) -> dict[str, slice]:
  """openpilot's `output_slices` metadata (base64 of a pickled dict name -> slice), read without running code from it."""
  try:
    raw = _SliceUnpickler(io.BytesIO(base64.b64decode(b64))).load()
  except UserError:
    raise
  except Exception as e:
    raise UserError(f"metadata 'output_slices' is not base64 of a pickled dict ({type(e).__name__}); regenerate the model metadata") from None
  if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, slice) and _index_ok(v) for k, v in raw.items()):
    raise UserError("metadata 'output_slices' must map names to slices of integers below 2**31")
  if bad := [k for k in raw if not (k.isprintable() and 0 < len(k) <= 64)]:
    # names are printed in reports and messages: a newline or a terminal escape in one is not a name
    raise UserError(f"metadata 'output_slices' has {len(bad)} name(s) that are not printable text of 1-64 characters, e.g. {bad[0][:40]!r}")
  return raw


def _index_ok(s: slice) -> bool:
  # below 2**31: no output is wider, and a 5000-digit int cannot even be printed in an error message
  ints = all(x is None or (isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31) for x in (s.start, s.stop))
  return ints and s.step in (None, 1)


def contract_of(inputs: dict[str, Any], outputs: Any = ()) -> str | None:
  """Which of openpilot's model contracts a graph's input names say it is (None: none of them). Names decide, shapes are
  checked afterwards against the contract: a features_buffer with action_t beside it is master's combined model; new_img,
  or any input X with an output next_X, is master's stateful model (since 2026-09)."""
  names = set(inputs)
  if is_stateful(names, set(outputs)):
    return "stateful"
  if "action_t" in names or {"img", "features_buffer"} <= names:
    return "supercombo"
  if "input_img" in names:
    return "dmonitoring"
  if "features_buffer" in names:
    return "policy"
  if "img" in names:
    return "vision"
  return None


def _where(contract: str) -> str:
  """How `compile` is given a model of this contract."""
  kind = kinds.of_model(contract)
  return f"compile it with {kind.compile_flags}" if kind is not None else f"pass it as --{contract}"


def encode_output_slices(slices: dict[str, slice]) -> str:
  return base64.b64encode(pickle.dumps(slices)).decode()


def _dims(t) -> tuple[int, ...]:
  return tuple(d.dim_value if d.HasField("dim_value") else 0 for d in t.type.tensor_type.shape.dim)


def detect_contract(path: str | Path) -> str | None:
  """Which contract a model file's input names say it is (contract_of), or None for an unreadable file or no contract:
  load_model_info then says what is wrong."""
  import onnx
  try:
    graph = onnx.load(str(path), load_external_data=False).graph
  except Exception:
    return None
  inits = {i.name for i in graph.initializer}
  return contract_of({i.name: i for i in graph.input if i.name not in inits})


def load_model_info(path: str | Path, kind: str) -> OnnxModelInfo:
  """Parse and check one model file against openpilot's I/O contract. Raises UserError naming what is wrong."""
  import onnx

  path = Path(path)
  if not path.is_file():
    raise UserError(f"{kind} model not found: {path}")
  try:
    model = onnx.load(str(path), load_external_data=False)
  except Exception as e:
    raise UserError(f"{kind} model {path} is not a readable ONNX file ({type(e).__name__}); re-download or regenerate it") from None
  # weights kept in files beside the model: a way of saving ONNX, not damage; the compile reads one self-contained file
  if external := sorted({e.value for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
                         for e in t.external_data if e.key == "location"}):
    raise UserError(f"{kind} model {path.name} keeps its weights in external data files ({', '.join(external[:3])}); save it with the "
                    "weights inside: onnx.save(onnx.load(path), out) loads them in and writes one file")
  # structure first (dangling node inputs, names that are not UTF-8, unknown types), so the contract below reads a sound graph
  _checker(model, kind, path, full=False)
  graph = model.graph
  inits = {i.name for i in graph.initializer}
  inputs = {i.name: i for i in graph.input if i.name not in inits}
  expected = INPUTS[kind]
  if (other := contract_of(inputs, [o.name for o in graph.output])) not in (None, kind):
    raise UserError(f"{path.name} is the {other} model, {FILES[other]}, not the {kind} model {FILES[kind]}; {_where(other)}")
  if kind in GRAPH_DECLARED:
    check_stateful({k: (_dims(v), _dtype_name(v)) for k, v in inputs.items()}, {o.name: (_dims(o), _dtype_name(o)) for o in graph.output},
                   f"model {path.name}")
  for name, (shape, dtypes_ok) in expected.items():
    if name not in inputs:
      raise UserError(f"{kind} model {path.name} has no input '{name}' (inputs: {', '.join(inputs) or 'none'}); is this the right model file?")
    got_shape = _dims(inputs[name])
    got_dtype = _dtype_name(inputs[name])
    if got_shape != shape:
      raise UserError(f"{kind} model input '{name}' has shape {got_shape}, expected {shape}")
    if got_dtype not in dtypes_ok:
      raise UserError(f"{kind} model input '{name}' has dtype {got_dtype}, expected {' or '.join(sorted(dtypes_ok))}")
  if kind not in GRAPH_DECLARED and (extra := sorted(set(inputs) - set(expected))):
    raise UserError(f"{kind} model {path.name} has input(s) openpilot's modeld does not feed: {', '.join(extra)}; is this the right model file?")
  if kind not in GRAPH_DECLARED and len(graph.output) != 1:
    raise UserError(f"{kind} model must have exactly one output, found {len(graph.output)}")
  # then types and shapes through the whole graph: an input declared float32 in an fp16 graph passes the contract above
  # but fails onnxruntime's type check (and only after tinygrad has loaded the model, tens of seconds in)
  _checker(model, kind, path, full=True, hint=_precision_hint(inputs, graph.output[0]))
  _check_ops(model, kind, path)
  meta = {p.key: p.value for p in model.metadata_props}
  if "output_slices" not in meta:
    raise UserError(f"{kind} model {path.name} has no 'output_slices' metadata; openpilot models carry it (metadata_props)")
  try:
    slices = decode_output_slices(meta["output_slices"])
  except UserError as e:
    raise UserError(f"{kind} model {path}: {e}") from None
  # the prediction vector first: output_width reads it (a stateful graph also returns its states' next values)
  out_shapes = {o.name: _dims(o) for o in sorted(graph.output, key=lambda o: o.name != "outputs")}
  width = next(iter(out_shapes.values()))[-1]
  for req in REQUIRED_SLICES[kind]:
    if req not in slices:
      raise UserError(f"{kind} model {path.name}: its output_slices lack '{req}' (it has {', '.join(slices) or 'none'}); "
                      "is this the right model file?")
  for name, s in slices.items():
    if s.stop is None or s.stop > width:
      raise UserError(f"{kind} output slice '{name}' {s} exceeds the output width {width}")
  for name, want in SLICE_WIDTHS.get(kind, {}).items():
    if (s := slices[name]).stop - (s.start or 0) != want:
      raise UserError(f"{kind} model {path.name}: its {name} slice {s} is {s.stop - (s.start or 0)} wide, openpilot's parser reads {want}")
  for name in (n for n in slices if n in SCALAR_SLICES.get(kind, ())):
    if (s := slices[name]).stop - (s.start or 0) != 1:
      raise UserError(f"{kind} model {path.name}: its {name} slice {s} is not one value wide, as openpilot's parser reads it")
  if "hidden_state" in REQUIRED_SLICES[kind] and (hs := slices["hidden_state"]).stop - (hs.start or 0) != FEATURE_LEN:
    raise UserError(f"{kind} model {path.name}: its hidden_state slice {hs} is not {FEATURE_LEN} wide, the policy's features_buffer rows")
  for name, least in LEAST_WIDTHS.get(kind, {}).items():
    if name in slices and (a := slices[name]).stop - (a.start or 0) < least:
      raise UserError(f"{kind} model {path.name}: its {name} slice {a} is narrower than the {least} values modeld reads")
  return OnnxModelInfo(path, kind, sha256_file(path), {k: _dims(v) for k, v in inputs.items()},
                       {k: _dtype_name(v) for k, v in inputs.items()},
                       out_shapes, slices, {k: v for k, v in meta.items() if k != "output_slices"})


def _dtype_name(value_info) -> str:
  from onnx import helper
  elem = value_info.type.tensor_type.elem_type
  try:
    return helper.tensor_dtype_to_np_dtype(elem).name
  except (KeyError, ValueError, TypeError):
    return f"ONNX element type {elem}"


def _checker(model, kind: str, path: Path, full: bool, hint: dict[str, str] | None = None) -> None:
  """onnx.checker; full: also strict type and shape inference through the graph (what onnxruntime checks when it loads).
  hint: input name -> a likely cause, given only when the checker's message is about that input."""
  import onnx
  try:
    onnx.checker.check_model(model, full_check=full)
  except Exception as e:
    why = (str(e).strip().splitlines() or [""])[0][:300]
    # the hint where the error is about that input: named in it, or an input of the node it names
    m = re.search(r"node name: ([^)]+)\)", str(e))
    fed = {i for n in model.graph.node if m and n.name == m.group(1).strip() for i in n.input}
    named = [h for name, h in (hint or {}).items() if name in str(e) or name in fed]
    hint_text = f" ({', '.join(named)}?)" if named else ""
    raise UserError(f"{kind} model {path} is not a valid ONNX model ({type(e).__name__}: {why}){hint_text}; the file is damaged or was "
                    "edited: re-download or regenerate it") from None


def _precision_hint(inputs: dict, output) -> dict[str, str]:
  """Float inputs declared in another precision than the graph's output: the usual cause of a type error in an fp16 graph,
  when the error is about that input (the DM's calib is float32 in its float16 graph by design: not every failure's cause)."""
  want = _dtype_name(output)
  return {k: f"input '{k}' {d} in a {want} graph" for k, v in inputs.items()
          if (d := _dtype_name(v)).startswith("float") and want.startswith("float") and d != want}


def _check_ops(model, kind: str, path: Path) -> None:
  from tinygrad.nn.onnx import onnx_ops
  unsupported = sorted({n.op_type for n in model.graph.node if n.op_type not in onnx_ops})
  if unsupported:
    raise UserError(f"{kind} model {path.name} uses op(s) tinygrad 0.14.0 cannot run: {', '.join(unsupported)}")
