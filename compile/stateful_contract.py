"""openpilot master's stateful driving contract (since 2026-09), recognised from the graph alone.

Master's `driving_supercombo.onnx` keeps its history queues inside the graph: every state is an input `X` whose next value
the graph returns as the output `next_X`, which the runtime feeds back as the next frame's `X` (docs:
openpilot-master-2026-09.md §3). Which inputs are states, and their shapes and dtypes, are read from the graph, never from
constants: the shipped model's state names are not public, and a retrained one may add or drop a queue.

This module works on plain name -> (shape, dtype name) tables so that it needs neither onnx nor tinygrad: the ONNX loader
(compile/onnx_model.py) and any later reader of a compiled artifact can both hand it what they read.
"""
from __future__ import annotations

from dataclasses import dataclass

from selfdrive_glue.errors import UserError

Spec = tuple[tuple[int, ...], str]   # (shape, numpy dtype name)

NEXT = "next_"
OUTPUT = "outputs"
# the inputs the host feeds every frame (everything else must be a state): name -> (shape, allowed dtypes). The host
# inputs are declared float32 and cast to the model's precision inside the graph; fp16 is accepted as our older graphs use it
HOST_INPUTS: dict[str, tuple[tuple[int, ...], frozenset[str]]] = {
  "new_img": ((2, 6, 128, 256), frozenset({"uint8"})),
  "desire": ((8,), frozenset({"float32", "float16"})),
  "traffic_convention": ((1, 2), frozenset({"float32", "float16"})),
  "action_t": ((1, 2), frozenset({"float32", "float16"})),
}


@dataclass(frozen=True)
class StatefulContract:
  host_inputs: dict[str, Spec]
  states: dict[str, Spec]          # X -> its spec; the graph returns X's next value as next_X, same spec
  output: Spec                     # the flat prediction vector `outputs` (1, N)

  @property
  def state_bytes(self) -> int:
    return sum(_nbytes(s) for s in self.states.values())

  @staticmethod
  def next_of(state: str) -> str:
    return NEXT + state


_ITEMSIZE = {"uint8": 1, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "float64": 8, "int64": 8}


def _nbytes(spec: Spec) -> int:
  n = _ITEMSIZE.get(spec[1], 0)
  for d in spec[0]:
    n *= d
  return n


def is_stateful(inputs: dict[str, Spec] | set[str], outputs: dict[str, Spec] | set[str]) -> bool:
  """Whether a graph speaks this contract: it takes `new_img`, or it declares any state pair (X in, next_X out)."""
  return "new_img" in inputs or any(o.startswith(NEXT) and o[len(NEXT):] in inputs for o in outputs)


def states_of(inputs: dict[str, Spec], outputs: dict[str, Spec]) -> dict[str, Spec]:
  """The states of a graph: every input X for which the graph declares an output next_X, each checked against its pair.

  A next_X without an input X, or of another shape or dtype than X, is refused by name: a runtime feeding it back would
  either have nowhere to put it or would write a buffer of another size."""
  states = {}
  for out, (shape, dtype) in outputs.items():
    if not out.startswith(NEXT):
      continue
    name = out[len(NEXT):]
    if name not in inputs:
      raise UserError(f"stateful model output '{out}' has no input '{name}' to be fed back into; a state needs both (inputs: "
                      f"{', '.join(inputs) or 'none'})")
    in_shape, in_dtype = inputs[name]
    if (shape, dtype) != (in_shape, in_dtype):
      raise UserError(f"stateful model output '{out}' is {dtype} {shape} but its state input '{name}' is {in_dtype} {in_shape}; "
                      "a state must be fed back as it came out")
    states[name] = (in_shape, in_dtype)
  return states


def check_stateful(inputs: dict[str, Spec], outputs: dict[str, Spec], model: str = "model") -> StatefulContract:
  """The stateful contract of a graph from its input and output tables (shapes with 0 for a symbolic dim), or UserError."""
  states = states_of(inputs, outputs)
  host = {}
  for name, (shape, dtypes_ok) in HOST_INPUTS.items():
    if name not in inputs:
      raise UserError(f"stateful {model} has no input '{name}' (inputs: {', '.join(inputs) or 'none'}); is this openpilot master's "
                      "driving_supercombo.onnx?")
    got_shape, got_dtype = inputs[name]
    if got_shape != shape:
      raise UserError(f"stateful {model} input '{name}' has shape {got_shape}, expected {shape}")
    if got_dtype not in dtypes_ok:
      raise UserError(f"stateful {model} input '{name}' has dtype {got_dtype}, expected {' or '.join(sorted(dtypes_ok))}")
    host[name] = inputs[name]
  if extra := sorted(set(inputs) - set(host) - set(states)):
    raise UserError(f"stateful {model} has input(s) neither fed by modeld nor paired with a next_ output: {', '.join(extra)}; "
                    "a state X needs an output next_X")
  if OUTPUT not in outputs:
    raise UserError(f"stateful {model} has no output '{OUTPUT}' (outputs: {', '.join(outputs) or 'none'})")
  if extra := sorted(set(outputs) - {OUTPUT} - {NEXT + s for s in states}):
    raise UserError(f"stateful {model} has output(s) modeld neither reads nor feeds back: {', '.join(extra)}")
  shape, dtype = outputs[OUTPUT]
  if len(shape) != 2 or shape[0] != 1 or shape[1] < 1:
    raise UserError(f"stateful {model} output '{OUTPUT}' has shape {shape}, expected (1, N)")
  if not dtype.startswith("float"):
    raise UserError(f"stateful {model} output '{OUTPUT}' has dtype {dtype}, expected a float type")
  for name, (shape, _) in states.items():
    if any(d <= 0 for d in shape):
      raise UserError(f"stateful {model} state '{name}' has shape {shape} with a symbolic or empty dimension; states are fixed-size buffers")
  return StatefulContract(host, states, outputs[OUTPUT])
