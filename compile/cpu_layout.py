"""Layout choices for CPU artifacts: the same function, laid out so tinygrad 0.14's CPU code is not starved by memory.

Measured on the full reference models (2-core AMD EPYC, fp32, bench/bench_compile.py --profile):
  * weights of Gemm and of MatMul with a 2-D constant right operand are stored transposed (Gemm transB=1; MatMul reads
    Transpose(W^T)). The per-frame products there are matrix-vector (1 row) or nearly so: with W as (in, out) every output
    block walks the whole matrix in 16-byte pieces, one cache line per row; with W^T each output reads one contiguous row.
    The vision trunk's 8192x1024 Gemm went from 19 ms to a few, and the policy's 6400x1792 likewise.
  * a dense spatial convolution (group 1, kernel larger than 1x1) is materialised by itself: left lazy, tinygrad fused
    both 12-channel stems, their Concat and the first normalisation into one kernel with two reductions (53 ms, against
    about 8 ms per stem alone).
  * every Elu runs as a kernel of its own, its input and output materialised. tinygrad expands exp into a polynomial
    of scalar C; fused into a convolution's epilogue it sits inside the register tile (upcast) code, which clang leaves
    scalar, while a plain elementwise loop is vectorised by clang's loop vectoriser. The 96->288 pointwise convolution
    at 32x64 with its Elu: 2.38 ms fused, 1.17 ms (97 GFLOP/s) + 0.31 ms apart; the Elu alone with a 16-wide upcast
    takes 1.03 ms.
The rewrites are exact (a transpose moves values; a realisation boundary changes no arithmetic) and the compile step's
onnxruntime check runs the rewritten runner against the original model as before. The car's QCOM artifact never uses
them: its layouts are openpilot's (IMAGE=2).
"""
from __future__ import annotations

import math
import types
from pathlib import Path
from typing import Any

from selfdrive_glue.errors import UserError

LAYOUTS = ("auto", "on", "off")


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
  return True, "requested" if requested == "on" else "CPU target: transposed constant weights, dense convolutions materialised"


def transpose_weights(src: Path, dst: Path) -> int:
  """Write src with every Gemm/MatMul constant weight stored transposed; returns how many were rewritten.

  Gemm(A, B) with transB=0 and B an initializer becomes Gemm(A, B^T, transB=1); MatMul(X, W) with W a 2-D initializer
  becomes MatMul(X, Transpose(W^T)). Initializers used by any other node, or by two nodes, are left alone so each rewrite
  only moves values that nothing else reads."""
  import numpy as np
  import onnx
  from onnx import helper, numpy_helper

  m = onnx.load(str(src))
  g = m.graph
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
  onnx.save(m, str(dst))
  return count


def cpu_ops(base: dict[str, Any]) -> dict[str, Any]:
  """tinygrad's ONNX op table with Conv materialising dense spatial convolutions and Elu in kernels of its own (see the
  module docstring)."""
  conv = base["Conv"]
  if not isinstance(conv, types.FunctionType):
    raise UserError("internal error: tinygrad's ONNX Conv is not a plain function in this version; compile with --layout off")

  def Conv(X, W, B=None, **kw):
    out = conv(X, W, B, **kw)
    # group 1 and a window larger than one pixel: a real convolution, whose reduction must not absorb its consumers
    return out.contiguous() if kw.get("group", 1) == 1 and math.prod(W.shape[2:]) > 1 else out

  elu = base["Elu"]

  def Elu(X, alpha=1.0):
    # materialised on both sides: left lazy, the input side fuses into the producer's epilogue and the output side into
    # each consumer's loads (a 3x3 depthwise convolution would compute it once per tap)
    return elu(X.contiguous(), alpha).contiguous()

  return {**base, "Conv": Conv, "Elu": Elu}


def apply(runner) -> Any:
  """Give one OnnxRunner the CPU op table (per instance: tinygrad's own table stays as it is)."""
  runner.onnx_ops = cpu_ops(runner.onnx_ops)
  return runner
