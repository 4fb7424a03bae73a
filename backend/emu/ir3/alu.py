"""What the a6xx ALU instructions compute (cat1 moves/conversions, cat2/cat3 ALU, cat4 SFU), on numpy vectors of fibers.

Values travel as raw register bits (uint32 for full registers, uint16 for half ones); each op views them in its own
type. fp32/fp16 arithmetic is IEEE round-to-nearest-even as numpy does it, rounding once per operation: mad.f32/mad.f16
are not fused (Mesa, src/freedreno/ir3/ir3_nir_opt_algebraic_late.py: "Since for us, mad is not fused"), so a*b rounds
to the destination type and then +c rounds again; fp16 goes through fp32 and rounds once per op. SFU results (cat4) are
computed in fp32 and rounded to the destination: rcp/sqrt/rsq are correctly rounded here, exp2/log2/sin/cos within 2 ulp
(numpy's fp32 routines, whose bits differ with the host's ISA: AVX-512 and AVX2 builds disagree in the last ulp). No
public source states the a630 SFU's accuracy, so conformance against the CPU compares cat4 results with a 2-ulp bound.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

NP_TYPES: dict[str, Any] = {"f32": np.float32, "f16": np.float16, "u32": np.uint32, "s32": np.int32, "u16": np.uint16, "s16": np.int16,
            "u8": np.uint8, "s8": np.int8, "b32": np.uint32, "b16": np.uint16}
INT_LIMITS = {t: (np.iinfo(NP_TYPES[t]).min, np.iinfo(NP_TYPES[t]).max) for t in ("u32", "s32", "u16", "s16", "u8", "s8")}


class Unimplemented(Exception):
  """An opcode or mode the interpreter does not execute; the executor names the kernel and instruction."""


def bits_as(bits: Any, half: bool, kind: str) -> Any:
  """Register bits viewed as the op's type: kind 'f' float, 'u' unsigned, 's' signed (16-bit when half)."""
  b = np.asarray(bits, np.uint16 if half else np.uint32)
  if kind == "f":
    return b.view(np.float16 if half else np.float32)
  if kind == "s":
    return b.view(np.int16 if half else np.int32)
  return b


def to_bits(v: Any, half: bool) -> Any:
  """A typed result as register bits of the destination's width (floats convert, integers wrap)."""
  v = np.asarray(v)
  if v.dtype.kind == "f":
    return v.astype(np.float16 if half else np.float32).view(np.uint16 if half else np.uint32)
  if v.dtype == np.bool_:
    return v.astype(np.uint16 if half else np.uint32)
  return v.astype(np.uint16 if half else np.uint32, casting="unsafe")


def convert(bits: Any, src_t: str, dst_t: str, src_half: bool) -> Any:
  """cat1 mov/cov: src bits of type src_t -> a value of type dst_t. float->int truncates toward zero and saturates
  (NaN -> 0), int->float and f32->f16 round to nearest even, int->int wraps or sign-extends by the source type."""
  b: Any = np.asarray(bits, np.uint16 if src_half else np.uint32)
  if src_t in ("u8", "s8"):
    # the ISA has no s8 source type: Mesa encodes an 8-bit sign extension as u8 -> s16/s32
    signed = src_t == "s8" or dst_t in ("s16", "s32")
    v = (b & 0xff).astype(np.uint8).view(np.int8) if signed else (b & 0xff).astype(np.uint8)
  elif src_t in ("f16", "u16", "s16"):
    v = b.astype(np.uint16).view(NP_TYPES[src_t])
  else:
    v = b.astype(np.uint32).view(NP_TYPES[src_t])
  if src_t == dst_t:
    return v
  dt = NP_TYPES[dst_t]
  if dst_t in ("f32", "f16"):
    return v.astype(dt)
  if v.dtype.kind == "f":
    lo, hi = INT_LIMITS[dst_t]
    t = np.trunc(v.astype(np.float64))
    return np.where(np.isnan(t), 0, np.clip(t, lo, hi)).astype(dt)
  return v.astype(np.int64).astype(dt, casting="unsafe")


def _cmp(cond: str) -> Callable:
  return {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal}[cond]


def _sh(b):
  return b & 31


def _shl(a, b):
  return np.left_shift(a, _sh(b).astype(a.dtype))


def _shr(a, b):
  return np.right_shift(a, _sh(b).astype(a.dtype))


def _rndaz(a):
  return np.copysign(np.floor(np.abs(a) + a.dtype.type(0.5)), a)


def _s24(a):
  """The low 24 bits as a signed value, at 32-bit width (a half-register source is widened first, not shifted in 16 bits)."""
  return (np.asarray(a).astype(np.int32) << 8) >> 8


def _s16(a):
  return (np.asarray(a).astype(np.int32) << 16) >> 16


def _clz(a):
  """clz.b of 0 is all ones (-1), not 32: Mesa's ir3 emits NIR's ufind_msb as sel(x != 0 ? 31 - clz(x) : clz(x)) and find_lsb
  as clz(bfrev(x)), both -1 for 0 by NIR's definition only if clz.b(0) is -1 (src/freedreno/ir3/ir3_compiler_nir.c)."""
  out = np.full(a.shape, 0xffffffff, np.uint32)
  nz = a != 0
  out[nz] = 31 - np.floor(np.log2(a[nz].astype(np.float64))).astype(np.uint32)
  return out


# cat2: op -> (source kind, function). Kinds: 'f' float (fp16 on half registers), 'u' unsigned, 's' signed, 'b' bits.
CAT2: dict[str, tuple[str, Callable]] = {
  "add.f": ("f", np.add), "mul.f": ("f", np.multiply), "min.f": ("f", np.fmin), "max.f": ("f", np.fmax),
  "absneg.f": ("f", lambda a: a), "floor.f": ("f", np.floor), "ceil.f": ("f", np.ceil), "rndne.f": ("f", np.rint),
  "rndaz.f": ("f", _rndaz), "trunc.f": ("f", np.trunc), "sign.f": ("f", np.sign),
  "add.u": ("u", np.add), "add.s": ("s", np.add), "sub.u": ("u", np.subtract), "sub.s": ("s", np.subtract),
  "min.u": ("u", np.minimum), "max.u": ("u", np.maximum), "min.s": ("s", np.minimum), "max.s": ("s", np.maximum),
  "absneg.s": ("s", lambda a: a), "and.b": ("u", np.bitwise_and), "or.b": ("u", np.bitwise_or), "xor.b": ("u", np.bitwise_xor),
  "not.b": ("u", np.invert), "shl.b": ("u", _shl), "shr.b": ("u", _shr), "ashr.b": ("s", lambda a, b: np.right_shift(a, _sh(b).astype(a.dtype))),
  "mull.u": ("u", lambda a, b: (a & 0xffff).astype(np.uint32) * (b & 0xffff).astype(np.uint32)),
  "mul.u24": ("u", lambda a, b: (np.asarray(a, np.uint32) & 0xffffff) * (np.asarray(b, np.uint32) & 0xffffff)),
  "mul.s24": ("s", lambda a, b: _s24(a) * _s24(b)),
  "clz.b": ("u", _clz), "bfrev.b": ("u", lambda a: np.array([int(f"{int(x):032b}"[::-1], 2) for x in np.atleast_1d(a)], np.uint32)),
  "cbits.b": ("u", lambda a: np.array([bin(int(x)).count("1") for x in np.atleast_1d(a)], np.uint32)),
}
CMPS = {"cmps.f": "f", "cmps.u": "u", "cmps.s": "s"}


def cat2(op: str, cond: str, srcs: list[np.ndarray]) -> np.ndarray:
  if op in CMPS:
    return _cmp(cond)(srcs[0], srcs[1])
  return CAT2[op][1](*srcs)


def _madsh(a, b, c):
  """madsh.m16: the cross term of a 32x32 multiply split in 16-bit halves: (lo16(a) * hi16(b)) << 16, plus c."""
  return ((a & 0xffff) * (b >> 16) << 16) + c


# cat3: op -> (source kind, function of the three typed sources)
CAT3: dict[str, tuple[str, Callable]] = {
  "mad.f32": ("f", lambda a, b, c: np.add(np.multiply(a, b, dtype=np.float32), c, dtype=np.float32)),
  "mad.f16": ("f", lambda a, b, c: np.add(np.multiply(a, b, dtype=np.float16), c, dtype=np.float16)),
  "madsh.m16": ("u", _madsh),
  "mad.u16": ("u", lambda a, b, c: (a & 0xffff) * (b & 0xffff) + c),
  "mad.s16": ("s", lambda a, b, c: _s16(a) * _s16(b) + c),
  "mad.u24": ("u", lambda a, b, c: (np.asarray(a, np.uint32) & 0xffffff) * (np.asarray(b, np.uint32) & 0xffffff) + c),
  "mad.s24": ("s", lambda a, b, c: _s24(a) * _s24(b) + c),
  "sel.b32": ("u", lambda a, cond, b: np.where(cond != 0, a, b)), "sel.b16": ("u", lambda a, cond, b: np.where(cond != 0, a, b)),
  "shrm": ("u", lambda a, b, c: _shr(b, a) & c), "shlm": ("u", lambda a, b, c: _shl(b, a) & c),
  "shrg": ("u", lambda a, b, c: _shr(b, a) | c), "shlg": ("u", lambda a, b, c: _shl(b, a) | c),
  "andg": ("u", lambda a, b, c: (b & a) | c),
}

# cat4 (SFU), computed in fp32; the h-prefixed forms are the fp16 ones (result rounded to the half destination)
CAT4: dict[str, Callable] = {
  "rcp": lambda a: np.float32(1) / a, "rsq": lambda a: np.float32(1) / np.sqrt(a), "sqrt": np.sqrt,
  "log2": np.log2, "exp2": np.exp2, "sin": np.sin, "cos": np.cos,
}
CAT4.update({"h" + k: v for k, v in list(CAT4.items())})


def _as_signed(x) -> int:
  return int(np.uint32(x).view(np.int32))


# cat6 atomics: (old, value, second value of the pair (cmpxchg only), signed) -> the value written; the destination
# gets `old` (ir3_a6xx.c: "write the new value to memory, and return the original value read"). Wrapping 32-bit
# arithmetic; min/max compare as the instruction's type (Mesa types imin/imax .s32, the rest .u32). sub/inc/dec are
# left out: NIR has no atomic op Mesa lowers to them, and no source states whether inc/dec wrap against a bound.
ATOMICS: dict[str, Callable] = {
  "add": lambda o, v, w, s: np.uint32((int(o) + int(v)) & 0xffffffff),
  "xchg": lambda o, v, w, s: np.uint32(v),
  "min": lambda o, v, w, s: np.uint32(min(o, v, key=_as_signed if s else int)),
  "max": lambda o, v, w, s: np.uint32(max(o, v, key=_as_signed if s else int)),
  "and": lambda o, v, w, s: np.uint32(o & v),
  "or": lambda o, v, w, s: np.uint32(o | v),
  "xor": lambda o, v, w, s: np.uint32(o ^ v),
  # the pair is (new value, comparator): ir3_a6xx.c collects (NIR src[2], src[1]) and spirv_to_nir puts SPIR-V's
  # Comparator in src[1] and its Value in src[2]
  "cmpxchg": lambda o, v, w, s: np.uint32(v if o == w else o),
}
