"""Pointwise (1x1) convolutions of CPU artifacts as a register-blocked C kernel, handed to tinygrad as a custom kernel.

The 1x1 convolutions are ~90 % of the vision model's FLOPs. tinygrad 0.14's C renderer gives them a tile of scalar
accumulators fed by at most 4-wide loads, and clang rebuilds 4-wide FMAs from that; keeping a whole tile of vector
accumulators in registers does better (bench/bench_pointwise.py compares the two per shape; measured in
docs/performance-cpu.md §5).

The kernel computes out[co, p] = bias[co] + sum_ci w[co, ci] * x[ci, p] over NCHW buffers (batch 1, p the pixel):
  * a tile of MR output channels x NV vectors of pixels lives in registers for the whole ci loop, so each x vector loaded
    feeds MR FMAs and each broadcast weight NV;
  * the weights are the model's [co][ci] constants with zero rows padding cout to a multiple of every MR, so the last
    tile reads no further than its buffer (a tile's MR weight rows are MR sequential streams);
  * the vector width is the target's, chosen by the preprocessor under tinygrad's -march=native (16 lanes with AVX-512,
    8 with AVX, else 4), with a tile that fits that ISA's vector registers;
  * pixel blocks are split over tinygrad's `core_id` parts, so artifact/cpu_threads.py runs them on every core.
It enters tinygrad through its own API (Tensor.custom_kernel returning a PROGRAM with our SOURCE, compiled by the CPU
device's compiler), so JIT capture, the artifact's pickle and the replay see an ordinary CPU program. The arithmetic is
a plain fp32 sum in ci order (no reassociation flags), checked against onnxruntime by the compile step like the rest.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from artifact import cpu_threads

# a tile is MR output channels x NV vectors of VW pixels, per ISA: AVX-512 6x4 of 16 lanes (24 of its 32 vector registers;
# 6x4 was the fastest of 12x2, 6x2, 4x4 and 3x8 on every shape of the model), AVX/AVX2 6x2 of 8 (12 of 16),
# SSE/NEON 6x2 of 4
_HEADER = """\
#if defined(__AVX512F__)
#define VW 16
#define NV 4
#elif defined(__AVX__)
#define VW 8
#define NV 2
#else
#define VW 4
#define NV 2
#endif
#define MR 6
#define PX (VW * NV)
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
"""
# an Elu applied as the tile is stored (cpu_layout fuses Conv -> Elu pairs): exp by Cody-Waite reduction to [-ln2/2, ln2/2]
# and a degree-7 polynomial (Cephes' expf coefficients), 2^n put into the exponent bits; max error 5e-8 against float64
# over [-100, 5] (tinygrad's own Elu: 7e-8). Vector ?: is C++ only in clang, so selects are masks.
_ELU = """\
typedef int vi __attribute__((vector_size(VW * 4), aligned(4)));
static inline vf sel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf elu(vf v, float alpha) {
  const vf zero = (vf){0};
  vf x = sel(v < zero, v, zero);
  x = sel(x > zero - 87.0f, x, zero - 87.0f);
  vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi), vf);
  vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = zero + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return sel(v > zero, v, alpha * (p * (vf)bits - 1.0f));
}
"""
# a pixel count the kernel takes is a multiple of every ISA's PX; others keep tinygrad's own kernel
PIXEL_MULTIPLE = 64
# weights and bias rows are padded to a multiple of MR
PAD_ROWS = 6


def _source(name: str, cin: int, cout: int, pixels: int, parts: int, elu_alpha: float | None = None) -> str:
  rows = math.ceil(cout / PAD_ROWS) * PAD_ROWS
  # alpha as a hex float literal: the attribute's fp32 value exactly
  store = "acc[m][j]" if elu_alpha is None else f"elu(acc[m][j], {float(np.float32(elu_alpha)).hex()}f)"
  return _HEADER + (_ELU if elu_alpha is not None else "") + f"""\
void {name}(float* restrict out, const float* restrict x, const float* restrict wp, const float* restrict bias, const int core_id) {{
  const int blocks = {pixels} / PX, per = (blocks + {parts} - 1) / {parts};
  const int b0 = core_id * per, b1 = b0 + per < blocks ? b0 + per : blocks;
  for (int pb = b0; pb < b1; pb++) {{
    const float* xp = x + pb * PX;
    for (int cb = 0; cb < {rows} / MR; cb++) {{
      const float* w = wp + cb * MR * {cin};
      vf acc[MR][NV];
      for (int m = 0; m < MR; m++)
        for (int j = 0; j < NV; j++) acc[m][j] = (vf){{0}} + bias[cb * MR + m];
      for (int ci = 0; ci < {cin}; ci++) {{
        vf xv[NV];
        for (int j = 0; j < NV; j++) xv[j] = *(const vf*)(xp + ci * {pixels} + j * VW);
        for (int m = 0; m < MR; m++) {{
          const float wv = w[m * {cin} + ci];
          for (int j = 0; j < NV; j++) acc[m][j] += wv * xv[j];
        }}
      }}
      for (int m = 0; m < MR; m++) {{
        if (cb * MR + m >= {cout}) break;
        for (int j = 0; j < NV; j++) *(vf*)(out + (cb * MR + m) * {pixels} + pb * PX + j * VW) = {store};
      }}
    }}
  }}
}}
"""


def pad(w, b) -> tuple[Any, Any]:
  """(cout, cin[,1,1]) weights and (cout,) bias (or None) as numpy arrays with cout padded by zero rows to PAD_ROWS."""
  w = np.asarray(w, np.float32).reshape(w.shape[0], -1)
  cout, cin = w.shape
  rows = math.ceil(cout / PAD_ROWS) * PAD_ROWS
  wpad = np.zeros((rows, cin), np.float32)
  wpad[:cout] = w
  bpad = np.zeros(rows, np.float32)
  if b is not None:
    bpad[:cout] = np.asarray(b, np.float32).reshape(-1)
  return wpad, bpad


def attrs_supported(w_shape, attrs: dict[str, Any]) -> bool:
  """A 1x1 window, stride 1, no padding, no dilation, one group: what the ONNX node alone says."""
  if len(w_shape) != 4 or tuple(w_shape[2:]) != (1, 1) or attrs.get("group", 1) != 1:
    return False
  if any(s != 1 for s in attrs.get("strides", (1, 1))) or any(d != 1 for d in attrs.get("dilations", (1, 1))):
    return False
  return not any(p != 0 for p in attrs.get("pads", (0, 0, 0, 0))) and attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID")


def supported(x_shape: tuple[int, ...], w_shape: tuple[int, ...], kw: dict[str, Any]) -> bool:
  """The node's attributes, batch 1, and whole pixel tiles on every ISA."""
  return (attrs_supported(w_shape, kw) and len(x_shape) == 4 and x_shape[0] == 1 and x_shape[1] == w_shape[1]
          and (x_shape[2] * x_shape[3]) % PIXEL_MULTIPLE == 0)


def conv(x, wp, bias, cout: int, parts: int | None = None, elu_alpha: float | None = None):
  """x (1, cin, H, W) fp32 Tensor; wp, bias the realized padded Tensors (`pad`) -> (1, cout, H, W), computed in `parts`
  core_id parts (default: tinygrad's CPU thread count, as its own kernels are split); elu_alpha: Elu(alpha) applied to
  the result as it is stored."""
  from tinygrad import Tensor, dtypes
  from tinygrad.device import Device
  from tinygrad.renderer import Estimates
  from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp


  _, cin, h, w = x.shape
  pixels, parts = h * w, parts or cpu_threads.count()
  name = f"pointwise{'_elu' if elu_alpha is not None else ''}_{cin}_{cout}_{h}_{w}"
  renderer = Device[x.device].renderer

  def program(out: UOp, xu: UOp, wu: UOp, bu: UOp) -> UOp:
    core = UOp.variable("core_id", 0, parts - 1, dtypes.int, param=True)
    core = core.replace(arg=replace(core.arg, slot=4))   # the 5th argument, after the four buffers
    # what tinygrad's counters and DEBUG lines report for it (GFLOP/s, GB/s); loads as on AVX-512: each x tile once per
    # channel block, the weights once per pixel block
    rows = math.ceil(cout / PAD_ROWS) * PAD_ROWS
    est = Estimates(ops=2 * cin * rows * pixels, lds=4 * (cin * pixels * rows // PAD_ROWS + rows * cin * pixels // PIXEL_MULTIPLE + cout * pixels),
                    mem=4 * (cin * pixels + rows * cin + rows + cout * pixels))
    sink = UOp.sink(out, xu, wu, bu, arg=KernelInfo(name=name, estimates=est))
    info = ProgramInfo(name=name, global_size=(parts, 1, 1), local_size=(1, 1, 1), vars=(core,), globals=(0, 1, 2, 3),
                       outs=(0,), ins=(1, 2, 3), target=renderer.target)
    return UOp(Ops.PROGRAM, arg=info, src=(sink, UOp(Ops.LINEAR, src=(*sink.src, core)),
                                           UOp(Ops.SOURCE, arg=_source(name, cin, cout, pixels, parts, elu_alpha))))

  out = Tensor.empty(1, cout, h, w, dtype=dtypes.float32, device=x.device)
  return Tensor.custom_kernel(out, x.contiguous(), wp, bias, fxn=program)[0]
