"""An ONNX driving model as a trainable tinygrad function, and back: the graph that is trained is the graph that ships.

The reference graphs (compile/refmodels/driving.py) are evaluated node by node in float32 with their fp16 weight initializers
as trainable tensors; export writes the trained values back into the same ModelProto as fp16, so the I/O contract,
the op list and the export path are exactly those of the random-weight models.

Output heads are affine in their last Gemm (Gemm -> Slice -> Concat, nothing after), so each output column gets a
fixed scale and offset (the target's spread and mean) folded into that Gemm: the weights train in O(1) units while the
model emits metres and seconds, and export multiplies the fold in. Scalar initializers (1/64, epsilons, GELU constants)
stay constants.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes


def _attr(node, name: str, default=None):
  from onnx import helper
  for a in node.attribute:
    if a.name == name:
      return helper.get_attribute_value(a)
  return default


class TrainableGraph:
  def __init__(self, model: Any, output_width: int):
    from onnx import numpy_helper
    self.model = model
    self.consts: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    self.params: dict[str, Tensor] = {n: Tensor(a.astype(np.float32)).contiguous().realize() for n, a in self.consts.items()
                                      if a.dtype == np.float16 and a.size > 1}
    self.fold = self._output_gemms(output_width)
    self.scale = np.ones(output_width, np.float32)
    self.offset = np.zeros(output_width, np.float32)
    self._fold_t: dict[str, tuple[Tensor, Tensor]] = {}

  def _output_gemms(self, width: int) -> dict[str, np.ndarray]:
    """Gemm output name -> the output column of each of its columns, for every Gemm whose columns reach the output unchanged
    (a head Gemm may be sliced into several heads that sit apart in the output)."""
    producer = {n.output[0]: n for n in self.model.graph.node}
    out = producer[self.model.graph.output[0].name]
    while out.op_type == "Identity":
      out = producer[out.input[0]]
    if out.op_type != "Concat":
      raise ValueError(f"the model's output comes from {out.op_type}, not a Concat of heads")
    fold: dict[str, np.ndarray] = {}
    col = 0
    for name in out.input:
      n = producer[name]
      src = producer.get(n.input[0]) if n.op_type == "Slice" else None
      if src is not None and src.op_type == "Gemm":
        start, stop = int(self.consts[n.input[1]][0]), int(self.consts[n.input[2]][0])
        cols = fold.setdefault(src.output[0], np.full(self.consts[src.input[1]].shape[1], -1))
        cols[start:stop] = np.arange(col, col + stop - start)
        col += stop - start
      elif n.op_type == "Gemm":
        w = self.consts[n.input[1]].shape[1]
        fold[n.output[0]] = np.arange(col, col + w)
        col += w
      else:   # e.g. hidden_state, which ends in a normalisation: not foldable, its columns keep scale 1
        col += self._width(name)
    if col != width:
      raise ValueError(f"output heads add up to {col} columns, expected {width}")
    return fold

  def _width(self, name: str) -> int:
    from onnx import shape_inference
    for v in shape_inference.infer_shapes(self.model).graph.value_info:
      if v.name == name:
        return int(v.type.tensor_type.shape.dim[-1].dim_value)
    raise ValueError(f"no shape known for {name}")

  def set_output_affine(self, scale: np.ndarray, offset: np.ndarray) -> None:
    """Per output column: emitted = scale * (trained unit) + offset. Columns outside a head Gemm must keep (1, 0)."""
    foldable = np.zeros(len(self.scale), bool)
    for cols in self.fold.values():
      foldable[cols[cols >= 0]] = True
    if np.any(~foldable & ((scale != 1) | (offset != 0))):
      raise ValueError("an output column outside a head Gemm was given a scale/offset")
    self.scale, self.offset = scale.astype(np.float32), offset.astype(np.float32)
    self._fold_t = {}

  def _folded(self, gemm_out: str) -> tuple[Tensor, Tensor]:
    if gemm_out not in self._fold_t:
      cols = self.fold[gemm_out]
      s = np.where(cols >= 0, self.scale[np.maximum(cols, 0)], 1).astype(np.float32)
      o = np.where(cols >= 0, self.offset[np.maximum(cols, 0)], 0).astype(np.float32)
      self._fold_t[gemm_out] = (Tensor(s), Tensor(o))
    return self._fold_t[gemm_out]

  def tensor(self, name: str) -> Tensor:
    if name in self.params:
      return self.params[name]
    return Tensor(self.consts[name].astype(np.float32) if self.consts[name].dtype == np.float16 else self.consts[name])

  def __call__(self, inputs: dict[str, Tensor]) -> Tensor:
    """Evaluate on a batch (leading axis B, where the graph says 1) in float32; returns the (B, width) output."""
    env: dict[str, Tensor] = {k: v.cast(dtypes.float32) if v.dtype != dtypes.float32 else v for k, v in inputs.items()}

    def val(n: str) -> Tensor:
      return env[n] if n in env else self.tensor(n)

    for node in self.model.graph.node:
      op, ins = node.op_type, node.input
      if op == "Cast":
        y = val(ins[0]).cast(dtypes.float32)
      elif op in ("Add", "Sub", "Mul", "Div"):
        a, b = val(ins[0]), val(ins[1])
        y = {"Add": a + b, "Sub": a - b, "Mul": a * b, "Div": a / b}[op]
      elif op == "Sqrt":
        y = val(ins[0]).sqrt()
      elif op == "Tanh":
        y = val(ins[0]).tanh()
      elif op == "Elu":
        y = val(ins[0]).elu(float(_attr(node, "alpha", 1.0)))
      elif op == "Conv":
        pads = _attr(node, "pads")
        y = val(ins[0]).conv2d(val(ins[1]), val(ins[2]), groups=int(_attr(node, "group", 1)), stride=tuple(_attr(node, "strides")),
                               padding=(pads[1], pads[3], pads[0], pads[2]))
      elif op == "Gemm":
        x, w, b = val(ins[0]), val(ins[1]), val(ins[2])
        if node.output[0] in self.fold:
          s, o = self._folded(node.output[0])
          w, b = w * s, b * s + o
        y = x @ w + b
      elif op == "MatMul":
        y = val(ins[0]) @ val(ins[1])
      elif op == "ReduceMean":
        y = val(ins[0]).mean(axis=tuple(_attr(node, "axes")), keepdim=bool(_attr(node, "keepdims", 1)))
      elif op == "Concat":
        xs = [val(n) for n in ins]
        y = xs[0].cat(*xs[1:], dim=int(_attr(node, "axis")))
      elif op == "Slice":
        x = val(ins[0])
        axis = int(self.consts[ins[3]][0]) if len(ins) > 3 else 0
        start, stop = int(self.consts[ins[1]][0]), int(self.consts[ins[2]][0])
        y = x[tuple([slice(None)] * axis + [slice(start, stop)])]
      elif op == "Flatten":
        x = val(ins[0])
        y = x.reshape(x.shape[0], -1)
      elif op == "Reshape":
        shape = [int(v) for v in self.consts[ins[1]]]
        y = val(ins[0]).reshape(-1 if shape[0] == 1 else shape[0], *shape[1:])   # the graph's batch of 1 is any batch here
      elif op == "Transpose":
        y = val(ins[0]).permute(*_attr(node, "perm"))
      elif op == "Softmax":
        y = val(ins[0]).softmax(int(_attr(node, "axis", -1)))
      elif op == "Identity":
        y = val(ins[0])
      else:
        raise NotImplementedError(f"training does not know ONNX op {op}")
      env[node.output[0]] = y
    return env[self.model.graph.output[0].name]

  def export(self) -> Any:
    """A copy of the model with the trained weights (fold multiplied in) as fp16 initializers."""
    from onnx import numpy_helper
    trained = {n: p.numpy() for n, p in self.params.items()}
    producer = {n.output[0]: n for n in self.model.graph.node}
    for g in self.fold:
      s, o = (t.numpy() for t in self._folded(g))
      w_name, b_name = producer[g].input[1], producer[g].input[2]
      trained[w_name] = trained[w_name] * s
      trained[b_name] = trained[b_name] * s + o
    out = type(self.model)()
    out.CopyFrom(self.model)
    for init in out.graph.initializer:
      if init.name in trained:
        arr = trained[init.name]
        if not np.all(np.isfinite(arr)) or np.abs(arr).max() > 6e4:
          raise ValueError(f"trained weight {init.name} does not fit fp16 (max |w| {np.abs(arr).max():.3g})")
        init.CopyFrom(numpy_helper.from_array(arr.astype(np.float16), init.name))
    return out
