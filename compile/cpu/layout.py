"""Layout choices for CPU artifacts: the same function, laid out so tinygrad 0.14's CPU code is not starved by memory.

What each choice does (the measurements are in docs/performance-cpu.md §6):
  * weights of Gemm and of MatMul with a 2-D constant right operand are stored transposed (Gemm transB=1; MatMul reads
    Transpose(W^T)). The per-frame products there are matrix-vector (1 row) or nearly so: with W as (in, out) every output
    block walks the whole matrix in 16-byte pieces, one cache line per row; with W^T each output reads one contiguous row.
  * a dense spatial convolution (group 1, kernel larger than 1x1) is materialised by itself: left lazy, tinygrad fuses
    both 12-channel stems, their Concat and the first normalisation into one kernel with two reductions, far slower than
    the stems apart.
  * every Elu runs as a kernel of its own, its input and output materialised. tinygrad expands exp into a polynomial
    of scalar C; fused into a convolution's epilogue it sits inside the register tile (upcast) code, which clang leaves
    scalar, while a plain elementwise loop is vectorised by clang's loop vectoriser.
  * a pointwise (1x1) convolution with constant weights runs as our register-blocked C kernel (compile/cpu/pointwise.py),
    faster than tinygrad's own for these shapes. Its weights are padded once, when the op first runs (before the JIT
    captures), and captured as constants. Where an Elu is its only reader, the kernel applies it as it stores
    (fuse_conv_elu), saving the Elu's own pass over the output.
The rewrites are exact (a transpose moves values; a realisation boundary changes no arithmetic) and the compile step's
onnxruntime check runs the rewritten runner against the original model as before. The car's QCOM artifact never uses
them: its layouts are openpilot's (IMAGE=2).
"""
from __future__ import annotations

import math
import os
import types
from pathlib import Path
from typing import Any

from compile.cpu import pointwise as cpu_pointwise
from selfdrive_glue.errors import UserError

LAYOUTS = ("auto", "on", "off")
# the attribute fuse_conv_elu gives a Conv: the alpha of the Elu that followed it
ELU_ATTR = "modeld_elu_alpha"


def choose(device: str, requested: str) -> tuple[bool, str]:
  """-> (use the CPU layout, why) for a compile of `device`."""
  if requested not in LAYOUTS:
    raise UserError(f"unknown layout {requested!r}: use one of {', '.join(LAYOUTS)}")
  cpu = device.split(":")[0] == "CPU"
  if requested == "off":
    return False, "requested"
  if not cpu:
    if requested == "on":
      raise UserError(f"--layout on is for CPU artifacts; {device} keeps the models' own layout")
    return False, f"{device} keeps the models' own layout"
  if requested == "on":
    return True, "requested"
  return True, ("CPU target: transposed constant weights, dense convolutions materialised, Elu in its own kernels, "
                "pointwise convolutions on a register-blocked kernel")


def rewrite(src: Path, dst: Path) -> dict[str, int]:
  """Write src with the CPU layout's graph rewrites (`transpose_weights`, `fuse_conv_elu`); returns how many of each."""
  import onnx
  m = onnx.load(str(src))
  counts = {"weights_transposed": transpose_weights(m.graph), "conv_elu_fused": fuse_conv_elu(m.graph)}
  onnx.save(m, str(dst))
  return counts


def transpose_weights(g) -> int:
  """Store every Gemm/MatMul constant weight of the graph transposed; returns how many were rewritten.

  Gemm(A, B) with transB=0 and B an initializer becomes Gemm(A, B^T, transB=1); MatMul(X, W) with W a 2-D initializer
  becomes MatMul(X, Transpose(W^T)). Initializers used by any other node, or by two nodes, are left alone so each rewrite
  only moves values that nothing else reads."""
  import numpy as np
  from onnx import helper, numpy_helper

  inits = {i.name: i for i in g.initializer}
  uses: dict[str, int] = {}
  for n in g.node:
    for i in n.input:
      uses[i] = uses.get(i, 0) + 1

  def transposed(name: str) -> bool:
    t = inits.get(name)
    if t is None or len(t.dims) != 2 or uses.get(name, 0) != 1:
      return False
    t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(t).T), name))
    return True

  count, nodes = 0, []
  for n in g.node:
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if n.op_type == "Gemm" and len(n.input) >= 2 and not attrs.get("transB", 0) and transposed(n.input[1]):
      for a in n.attribute:
        if a.name == "transB":
          n.attribute.remove(a)
          break
      n.attribute.append(helper.make_attribute("transB", 1))
      count += 1
    elif n.op_type == "MatMul" and transposed(n.input[1]):
      t_out = f"{n.input[1]}__cpu_t"
      nodes.append(helper.make_node("Transpose", [n.input[1]], [t_out], name=f"{n.name or n.output[0]}__cpu_t", perm=[1, 0]))
      n.input[1] = t_out
      count += 1
    nodes.append(n)
  del g.node[:]
  g.node.extend(nodes)
  return count


def fuse_conv_elu(g) -> int:
  """Give each pointwise Conv whose output only an Elu reads that Elu's alpha (attribute ELU_ATTR) and make the Elu an
  Identity: the pointwise kernel then applies it in registers as it stores, instead of a pass of its own over the output.
  Returns how many pairs were fused. Where the kernel does not apply after all (the input's shape), Conv runs the Elu."""
  from onnx import helper

  inits = {i.name: list(i.dims) for i in g.initializer}
  readers: dict[str, list[Any]] = {}
  for n in g.node:
    for i in n.input:
      readers.setdefault(i, []).append(n)
  graph_outputs = {o.name for o in g.output}
  count = 0
  for n in g.node:
    if n.op_type != "Conv" or len(n.output) != 1 or len(n.input) < 2 or n.output[0] in graph_outputs:
      continue
    users = readers.get(n.output[0], [])
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if (len(users) != 1 or users[0].op_type != "Elu" or n.input[1] not in inits or (len(n.input) > 2 and n.input[2] not in inits)
        or not cpu_pointwise.attrs_supported(inits[n.input[1]], attrs)):
      continue
    elu = users[0]
    alpha = next((helper.get_attribute_value(a) for a in elu.attribute if a.name == "alpha"), 1.0)
    n.attribute.append(helper.make_attribute(ELU_ATTR, float(alpha)))
    elu.op_type = "Identity"
    del elu.attribute[:]
    count += 1
  return count


def cpu_ops(base: dict[str, Any], constants: dict[int, Any] | None = None, pointwise: dict[int, Any] | None = None) -> dict[str, Any]:
  """tinygrad's ONNX op table with Conv materialising dense spatial convolutions and running pointwise ones on
  compile/cpu/pointwise.py, and Elu in kernels of its own (see the module docstring).

  constants: the runner's initializer Tensors by id (only those may be padded once and captured); pointwise: filled with
  the padded (weights, bias) per weight id, the pointwise convolutions this table ran."""
  from tinygrad import Tensor, dtypes


  conv = base["Conv"]
  if not isinstance(conv, types.FunctionType):
    raise UserError("internal error: tinygrad's ONNX Conv is not a plain function in this version; compile with --layout off")
  constants = constants or {}
  pointwise = {} if pointwise is None else pointwise
  use_pointwise = os.environ.get("MODELD_CPU_POINTWISE", "1") != "0"

  elu = base["Elu"]

  def Elu(X, alpha=1.0):
    # materialised on both sides: left lazy, the input side fuses into the producer's epilogue and the output side into
    # each consumer's loads (a 3x3 depthwise convolution would compute it once per tap)
    return elu(X.contiguous(), alpha).contiguous()

  def Conv(X, W, B=None, **kw):
    alpha = kw.pop(ELU_ATTR, None)   # fuse_conv_elu's: this Conv's only reader was Elu(alpha), now an Identity
    if (use_pointwise and id(W) in constants and (B is None or id(B) in constants) and X.dtype == dtypes.float32
        and W.dtype == dtypes.float32 and X.device.split(":")[0] == "CPU" and cpu_pointwise.supported(X.shape, W.shape, kw)):
      if (padded := pointwise.get(id(W))) is None:
        wpad, bpad = cpu_pointwise.pad(W.numpy(), None if B is None else B.numpy())
        padded = pointwise[id(W)] = (Tensor(wpad, device=X.device).realize(), Tensor(bpad, device=X.device).realize())
      return cpu_pointwise.conv(X, *padded, cout=W.shape[0], elu_alpha=alpha)
    out = conv(X, W, B, **kw)
    # group 1 and a window larger than one pixel: a real convolution, whose reduction must not absorb its consumers
    out = out.contiguous() if kw.get("group", 1) == 1 and math.prod(W.shape[2:]) > 1 else out
    return out if alpha is None else Elu(out, alpha)

  return {**base, "Conv": Conv, "Elu": Elu}


def apply(runner) -> Any:
  """Give one OnnxRunner the CPU op table (per instance: tinygrad's own table stays as it is). Call it before the runner
  first runs: its graph values are then its initializers. The pointwise convolutions it ran are in `runner.cpu_pointwise`."""
  from tinygrad import Tensor
  constants = {id(v): v for v in runner.graph_values.values() if isinstance(v, Tensor)}
  runner.cpu_pointwise = {}
  runner.onnx_ops = cpu_ops(runner.onnx_ops, constants, runner.cpu_pointwise)
  return runner
