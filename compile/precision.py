"""Compute precision per target: the car computes in fp16 like the models; a CPU computes in fp32; a workstation GPU computes
in fp16 (native) unless fp32 is asked for.

openpilot's models are fp16 inside. tinygrad's C renderer stores fp16 as clang's `__fp16`, a storage-only type: clang
computes every `__fp16` op in fp32 with a conversion on each side (vcvtph2ps/vcvtps2ph), and its sums accumulate in fp32
anyway. So even a CPU with native fp16 arithmetic (x86 AVX512-FP16, Arm FEAT_FP16) runs the fp16 graph slower than the same
graph in fp32, which vectorises (measured on CPUs with and without it: docs/performance-cpu.md §1). The
compile step therefore rewrites the graph to fp32 for every CPU (weights widened exactly, fp16 casts turned into fp32 ones);
the numerics check against onnxruntime still runs on the original fp16 model, with the same tolerance. The CPU's fp16
support is still detected and recorded, so the choice can be revisited if tinygrad's renderer changes (a test watches it).
"""
from __future__ import annotations

from pathlib import Path

from artifact.cpu_info import NATIVE_FP16_FLAGS, CpuInfo, cpu_info
from selfdrive_glue.errors import UserError

PRECISIONS = ("auto", "fp16", "fp32")


def choose(device: str, requested: str, cpu: CpuInfo | None = None) -> tuple[str, str]:
  """-> (precision, why) for a compile of `device`."""
  if requested not in PRECISIONS:
    raise UserError(f"unknown precision {requested!r}: use one of {', '.join(PRECISIONS)}")
  if device.split(":")[0] == "QCOM":
    if requested == "fp32":
      raise UserError(f"--precision fp32 is for CPU and workstation GPU artifacts; {device} computes the models in fp16 like the car "
                      "(use auto or fp16)")
    return "fp16", f"{device} computes in the models' own fp16"
  if device.split(":")[0] != "CPU":
    return ("fp32", "requested") if requested == "fp32" else ("fp16", f"{device} computes fp16 natively")
  cpu = cpu or cpu_info()
  if requested != "auto":
    return requested, f"requested (this CPU has {'native' if cpu.native_fp16 else 'no native'} fp16)"
  if cpu.native_fp16:
    return "fp32", (f"{cpu.model} has native fp16 ({' '.join(sorted(cpu.flags & NATIVE_FP16_FLAGS))}), but tinygrad's C "
                    "renderer computes fp16 as __fp16, converting around every op: fp32 is faster")
  return "fp32", f"{cpu.model} has no native fp16 (no {'/'.join(sorted(NATIVE_FP16_FLAGS))}): fp16 ops would be emulated"


def widen_to_fp32(src: Path, dst: Path) -> Path:
  """Write src with every fp16 tensor, value type and cast made fp32 (exact: fp32 holds every fp16 value)."""
  import numpy as np
  import onnx
  from onnx import AttributeProto, TensorProto, numpy_helper

  def widen(t: TensorProto) -> None:
    if t.data_type == TensorProto.FLOAT16:
      t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))

  m = onnx.load(str(src))
  g = m.graph
  for t in g.initializer:
    widen(t)
  for vi in (*g.input, *g.output, *g.value_info):
    if vi.type.tensor_type.elem_type == TensorProto.FLOAT16:
      vi.type.tensor_type.elem_type = TensorProto.FLOAT
  for n in g.node:
    if n.op_type not in _TYPED_OPS and any(a.name in ("to", "dtype") for a in n.attribute):
      raise UserError(f"{src.name}: node {n.name or n.op_type} ({n.op_type}) carries a dtype the fp32 rewrite does not know; "
                      "compile with --precision fp16")
    for a in n.attribute:
      if a.name in ("to", "dtype") and a.type == AttributeProto.INT and a.i == TensorProto.FLOAT16:
        a.i = TensorProto.FLOAT
      elif a.type == AttributeProto.TENSOR:
        widen(a.t)
      elif a.type == AttributeProto.GRAPH:
        raise UserError(f"{src.name}: node {n.name or n.op_type} ({n.op_type}) has a subgraph, which the fp32 rewrite does not handle; "
                        "compile with --precision fp16")
  onnx.save(m, str(dst))
  return dst


# ops whose dtype attribute the rewrite understands (the output type they name)
_TYPED_OPS = {"Cast", "ConstantOfShape", "EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike"}
