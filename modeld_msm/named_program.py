"""A loaded program called by the names of its inputs and outputs, as its artifact records them (artifact/kinds.py).

The captured JIT takes its arguments in the order the compile gave them; that order is read from the artifact's own
metadata here and nowhere else, so the processes hand over named buffers and get named outputs back.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tinygrad import Tensor

from artifact import kinds
from artifact.kinds import HOST, PACKED
from selfdrive_glue.errors import UserError


class NamedProgram:
  def __init__(self, jit: Any, spec: dict[str, Any], file: str = "program"):
    self.jit, self.file = jit, file
    self.inputs = [io["name"] for io in spec["inputs"]]
    self.outputs = [io["name"] for io in spec["outputs"]]
    self.specs = {io["name"]: io for io in spec["inputs"]}

  def __call__(self, named: dict[str, Any]) -> dict[str, Tensor]:
    """Run it on {input name: tensor}; -> {output name: tensor} (empty for a program whose outputs are its state)."""
    out = self.jit(*(named[n] for n in self.inputs))
    if not self.outputs:
      return {}
    return dict(zip(self.outputs, out if isinstance(out, tuple) else (out,)))

  def require(self, provided: set[str]) -> None:
    """Refuse, in one line, a program that reads an input the caller does not provide (a packed input: any of its members)."""
    reads = [m["name"] for io in self.specs.values() for m in (io.get("members") or ()) if io["role"] == PACKED]
    reads += [n for n in self.inputs if self.specs[n]["role"] != PACKED]
    if missing := [n for n in reads if n not in provided]:
      raise UserError(f"{self.file} reads the input '{missing[0]}', which this process does not provide; use an artifact of a kind it serves")


def host_arrays(spec: dict[str, Any]) -> dict[str, np.ndarray]:
  """Zeroed arrays for a program's host inputs, shaped and typed as it records them: the caller writes them in place.
  A packed input is one uint8 array under its own name, and each of its members (host arrays and frames alike) a view
  of it at the offset the spec records, so what the caller writes by a member's name is already in the one buffer."""
  out: dict[str, np.ndarray] = {}
  for io in spec["inputs"]:
    if io["role"] == HOST:
      out[io["name"]] = np.zeros(tuple(io["shape"]), np.dtype(io["dtype"]))
    elif io["role"] == PACKED:
      buf = out[io["name"]] = np.zeros(tuple(io["shape"]), np.uint8)
      for m in io["members"]:
        dt, shape = np.dtype(m["dtype"]), tuple(m["shape"])
        out[m["name"]] = buf[m["offset"]:m["offset"] + dt.itemsize * int(np.prod(shape))].view(dt).reshape(shape)
  return out


def host_of(kind: kinds.Kind = kinds.DEFAULT, camera: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
  """Zeroed host inputs of a kind's step program, for tools and tests that call its programs directly (camera: for a kind
  with a packed input, whose frames it holds)."""
  return host_arrays(kind.program("step").as_meta(camera))


def host_tensors(arrays: dict[str, np.ndarray]) -> dict[str, Tensor]:
  # NPY tensors alias the numpy memory, so the captured JIT copies their current contents in on every call
  return {k: Tensor(v, device="NPY") for k, v in arrays.items()}
