"""A loaded program called by the names of its inputs and outputs, as its artifact records them (artifact/kinds.py).

The captured JIT takes its arguments in the order the compile gave them; that order is read from the artifact's own
metadata here and nowhere else, so the processes hand over named buffers and get named outputs back.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tinygrad import Tensor

from artifact import kinds
from artifact.kinds import HOST
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
    """Refuse, in one line, a program that reads an input the caller does not provide."""
    if missing := [n for n in self.inputs if n not in provided]:
      raise UserError(f"{self.file} reads the input '{missing[0]}', which this process does not provide; use an artifact of a kind it serves")


def host_arrays(spec: dict[str, Any]) -> dict[str, np.ndarray]:
  """Zeroed arrays for a program's host inputs, shaped and typed as it records them: the caller writes them in place."""
  return {io["name"]: np.zeros(tuple(io["shape"]), np.dtype(io["dtype"])) for io in spec["inputs"] if io["role"] == HOST}


def host_of(kind: kinds.Kind = kinds.DEFAULT) -> dict[str, np.ndarray]:
  """Zeroed host inputs of a kind's step program, for tools and tests that call its programs directly."""
  return host_arrays(kind.program("step").as_meta())


def host_tensors(arrays: dict[str, np.ndarray]) -> dict[str, Tensor]:
  # NPY tensors alias the numpy memory, so the captured JIT copies their current contents in on every call
  return {k: Tensor(v, device="NPY") for k, v in arrays.items()}
