"""Straight runs of a block's ALU, move and texture instructions, executed in C over every lane of a batch.

The closures of compiled.py still pay numpy's per-call cost once per instruction, and tinygrad's kernels run a few
thousand lanes per batch, so per-instruction numpy calls (and, for `isam`, numpy's fp16 -> fp32 cast) leave a full model
step's time in the Python/numpy layer, not in arithmetic (measured: docs/emulator-speed.md). Here each run of
consecutive instructions that are pure functions of registers (cat1 moves/conversions between 32-bit types, the cat2/cat3
ALU ops on full registers, 2D `isam` into full registers) becomes a list of micro-ops; one C call walks the lanes in
chunks of 256 and applies them in order. Lanes are independent for these instructions (no memory writes, no cross-lane
operations), so running every instruction over a chunk before the next chunk gives each lane what running every
instruction over all lanes gives it.

Each micro-op computes what alu.py computes, bit for bit: fp32 add/mul rounded once each (built with
-ffp-contract=off, so a*b+c is not fused, as Mesa states the a6xx mad is not), float -> int by truncation with
saturation and NaN -> 0, (abs)/(neg) as sign-bit operations on floats and wrapping ones on integers, fp16 texels widened
through a table made by numpy's own cast. Anything else (half registers, (sat), min/max.f, special registers, memory,
control flow) stays with the closures; `tests/test_ir3_compiled.py` holds native == closures == generic handlers on a
corpus with NaN, inf, -0, denormals and the integer extremes. EMU_NATIVE=0 turns it off; so does a host without clang.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backend import native_lib
from backend.emu.executor import GpuFault
from backend.emu.ir3 import alu
from backend.emu.ir3.compiled import apply_mods, mov_const_bits
from backend.emu.ir3.decode import REG_A0, Instr, Operand

CHUNK = 256
MIN_RUN = 2   # instructions a run needs to go native (tests set 1, so every native form is checked on its own)
# micro-op opcodes (the C enum below is generated from this tuple, so the two cannot drift apart)
OPS = ("F_ADD", "F_MUL", "F_MAD", "COPY", "U_ADD", "U_SUB", "AND", "OR", "XOR", "NOT", "SHL", "SHR", "ASHR", "MULL_U",
       "MUL_U24", "MUL_S24", "MIN_U", "MAX_U", "MIN_S", "MAX_S", "CMP_F", "CMP_U", "CMP_S", "MADSH_M16", "MAD_U16",
       "MAD_S16", "MAD_U24", "MAD_S24", "SEL", "SHRM", "SHLM", "SHRG", "SHLG", "ANDG", "F2S", "F2U", "S2F", "U2F", "ISAM")
OP = {name: i for i, name in enumerate(OPS)}
CONDS = ("lt", "le", "gt", "ge", "eq", "ne")
# a source: its kind in the low bits, its modifiers above (applied as the op's type reads them)
REG, SCALAR, CONST = 0, 1, 2
FABS, FNEG, SABS, SNEG, UNEG = 4, 8, 16, 32, 64
UOP_WORDS = 10   # op, dst, aux, (kind, value) x 3, wrmask

_CAT2 = {"add.f": "F_ADD", "mul.f": "F_MUL", "absneg.f": "COPY", "add.u": "U_ADD", "add.s": "U_ADD", "sub.u": "U_SUB",
         "sub.s": "U_SUB", "min.u": "MIN_U", "max.u": "MAX_U", "min.s": "MIN_S", "max.s": "MAX_S", "absneg.s": "COPY",
         "and.b": "AND", "or.b": "OR", "xor.b": "XOR", "not.b": "NOT", "shl.b": "SHL", "shr.b": "SHR", "ashr.b": "ASHR",
         "mull.u": "MULL_U", "mul.u24": "MUL_U24", "mul.s24": "MUL_S24", "cmps.f": "CMP_F", "cmps.u": "CMP_U", "cmps.s": "CMP_S"}
_CAT3 = {"mad.f32": "F_MAD", "madsh.m16": "MADSH_M16", "mad.u16": "MAD_U16", "mad.s16": "MAD_S16", "mad.u24": "MAD_U24",
         "mad.s24": "MAD_S24", "sel.b32": "SEL", "shrm": "SHRM", "shlm": "SHLM", "shrg": "SHRG", "shlg": "SHLG", "andg": "ANDG"}
_WORD32 = ("u32", "s32", "b32")


def _ops_enum() -> str:
  return "enum {" + ", ".join(OPS) + "};"


_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>
#include <cpuid.h>
#define CH %(chunk)d
%(enum)s
enum { REG = 0, SCALAR = 1, CONST = 2, FABS = 4, FNEG = 8, SABS = 16, SNEG = 32, UNEG = 64 };
typedef struct { const uint8_t *data; int64_t pitch, width, height, texel; } img_t;

static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline uint32_t mods(uint32_t v, int64_t k) {
  if (k & FABS) v &= 0x7fffffffu;
  if (k & FNEG) v ^= 0x80000000u;
  if (k & SABS) v = ((int32_t)v < 0) ? 0u - v : v;
  if (k & SNEG) v = 0u - v;
  if (k & UNEG) v = 0u - v;
  return v;
}
static inline int32_t s24(uint32_t v) { return (int32_t)(v << 8) >> 8; }
static inline int32_t s16(uint32_t v) { return (int32_t)(v << 16) >> 16; }

/* one source for the chunk: a register row read in place, or the modified/broadcast values in buf */
static inline __attribute__((always_inline)) const uint32_t *source(const int64_t *u, int i, uint32_t *buf, uint32_t *regs,
                                                                   int64_t n, int64_t base, int64_t m, const uint32_t *consts) {
  int64_t kind = u[3 + 2 * i], val = u[4 + 2 * i];
  if ((kind & 3) == REG) {
    const uint32_t *r = regs + val * n + base;
    if (!(kind & ~3)) return r;
    for (int64_t l = 0; l < m; l++) buf[l] = mods(r[l], kind);
    return buf;
  }
  uint32_t v = (kind & 3) == SCALAR ? (uint32_t)val : mods(consts[val], kind);
  for (int64_t l = 0; l < m; l++) buf[l] = v;
  return buf;
}

#define LOOP(expr) for (int64_t l = 0; l < m; l++) r[l] = (expr)
#define CMP(x, y) switch (u[2]) { \
  case 0: LOOP((x) < (y)); break; case 1: LOOP((x) <= (y)); break; case 2: LOOP((x) > (y)); break; \
  case 3: LOOP((x) >= (y)); break; case 4: LOOP((x) == (y)); break; default: LOOP((x) != (y)); break; }

static inline uint32_t f2i(float v, double lo, double hi, int is_signed) {
  if (v != v) return 0;
  double t = trunc((double)v);
  t = t < lo ? lo : (t > hi ? hi : t);
  return is_signed ? (uint32_t)(int32_t)t : (uint32_t)t;
}

/* four finite halves widened by the F16C unit: exact, like every finite fp16 -> fp32 conversion (NaN payloads and
   infinities take the table, numpy's own cast) */
__attribute__((target("f16c"))) static inline void cvt4(uint64_t q, uint32_t out[4][CH], int64_t l) {
  float f[4];
  _mm_storeu_ps(f, _mm_cvtph_ps(_mm_cvtsi64_si128((long long)q)));
  for (int k = 0; k < 4; k++) memcpy(&out[k][l], &f[k], 4);
}

static inline __attribute__((always_inline)) void isam(int f16c, const int64_t *u, uint32_t *regs, int64_t n, int64_t base,
                                                       int64_t m, const uint8_t *mask, const img_t *imgs, const uint32_t *lut) {
  const img_t *im = &imgs[u[2]];
  const uint32_t *x = regs + u[4] * n + base, *y = regs + (u[4] + 1) * n + base;
  uint32_t out[4][CH];
  int comps[4], nc = 0;
  for (int c = 0; c < 4; c++) if (u[9] >> c & 1) comps[nc++] = c;
  const uint64_t w = im->width, h = im->height;
  if (im->texel == 8 && u[9] == 15) {   /* RGBA16F, every component: the form tinygrad's image convolutions fetch */
    for (int64_t l = 0; l < m; l++) {
      uint64_t q = 0;
      if (x[l] < w && y[l] < h) memcpy(&q, im->data + (int64_t)y[l] * im->pitch + (int64_t)x[l] * 8, 8);
      uint64_t v = (q & 0x7c007c007c007c00ULL) ^ 0x7c007c007c007c00ULL;   /* a zero 16-bit lane: inf or NaN there */
      if (f16c && !((v - 0x0001000100010001ULL) & ~v & 0x8000800080008000ULL)) { cvt4(q, out, l); continue; }
      out[0][l] = lut[q & 0xffff]; out[1][l] = lut[(q >> 16) & 0xffff]; out[2][l] = lut[(q >> 32) & 0xffff]; out[3][l] = lut[q >> 48];
    }
    nc = 4;
  } else for (int64_t l = 0; l < m; l++) {
    if (x[l] < w && y[l] < h) {
      const uint8_t *p = im->data + (int64_t)y[l] * im->pitch + (int64_t)x[l] * im->texel;
      for (int k = 0; k < nc; k++) {
        if (im->texel == 8) { uint16_t h; memcpy(&h, p + 2 * comps[k], 2); out[k][l] = lut[h]; }
        else memcpy(&out[k][l], p + 4 * comps[k], 4);
      }
    } else for (int k = 0; k < nc; k++) out[k][l] = 0;
  }
  /* every component is read before any is written: the destination may overlap the coordinates */
  for (int k = 0; k < nc; k++) {
    uint32_t *d = regs + (u[1] + k) * n + base;
    if (!mask) memcpy(d, out[k], m * 4);
    else for (int64_t l = 0; l < m; l++) if (mask[base + l]) d[l] = out[k][l];
  }
}

/* one body, built twice: the same IEEE operations at any vector width (nothing is contracted), AVX2 where the host has
   it (picked once, at the first call), SSE2 otherwise */
%(run_avx2)s
%(run_default)s
void ir3_native_run(const int64_t *uops, int64_t nops, uint32_t *regs, int64_t n, const uint32_t *consts,
                    const uint8_t *mask, const img_t *imgs, const uint32_t *lut) {
  static int avx2 = -1;
  if (avx2 < 0) {   /* F16C: CPUID.1:ECX bit 29 (clang 14's __builtin_cpu_supports does not know it) */
    unsigned a, b, c, d;
    avx2 = __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
  }
  (avx2 ? run_avx2 : run_default)(uops, nops, regs, n, consts, mask, imgs, lut);
}
"""


_RUN = r"""
%(attr)s static void run_%(isa)s(const int64_t *uops, int64_t nops, uint32_t *regs, int64_t n, const uint32_t *consts,
                    const uint8_t *mask, const img_t *imgs, const uint32_t *lut) {
  uint32_t ba[CH], bb[CH], bc[CH], r[CH];
  for (int64_t base = 0; base < n; base += CH) {
    int64_t m = n - base < CH ? n - base : CH;
    for (int64_t k = 0; k < nops; k++) {
      const int64_t *u = uops + k * %(words)d;
      if (u[0] == ISAM) { isam(%(f16c)d, u, regs, n, base, m, mask, imgs, lut); continue; }
      const uint32_t *a = source(u, 0, ba, regs, n, base, m, consts);
      const uint32_t *b = u[5] >= 0 ? source(u, 1, bb, regs, n, base, m, consts) : 0;
      const uint32_t *c = u[7] >= 0 ? source(u, 2, bc, regs, n, base, m, consts) : 0;
      switch (u[0]) {
        case F_ADD: LOOP(f2u(u2f(a[l]) + u2f(b[l]))); break;
        case F_MUL: LOOP(f2u(u2f(a[l]) * u2f(b[l]))); break;
        case F_MAD: for (int64_t l = 0; l < m; l++) { float t = u2f(a[l]) * u2f(b[l]); r[l] = f2u(t + u2f(c[l])); } break;
        case COPY: LOOP(a[l]); break;
        case U_ADD: LOOP(a[l] + b[l]); break;
        case U_SUB: LOOP(a[l] - b[l]); break;
        case AND: LOOP(a[l] & b[l]); break;
        case OR: LOOP(a[l] | b[l]); break;
        case XOR: LOOP(a[l] ^ b[l]); break;
        case NOT: LOOP(~a[l]); break;
        case SHL: LOOP(a[l] << (b[l] & 31)); break;
        case SHR: LOOP(a[l] >> (b[l] & 31)); break;
        case ASHR: LOOP((uint32_t)((int32_t)a[l] >> (b[l] & 31))); break;
        case MULL_U: LOOP((a[l] & 0xffffu) * (b[l] & 0xffffu)); break;
        case MUL_U24: LOOP((a[l] & 0xffffffu) * (b[l] & 0xffffffu)); break;
        case MUL_S24: LOOP((uint32_t)((int64_t)s24(a[l]) * s24(b[l]))); break;
        case MIN_U: LOOP(a[l] < b[l] ? a[l] : b[l]); break;
        case MAX_U: LOOP(a[l] > b[l] ? a[l] : b[l]); break;
        case MIN_S: LOOP((int32_t)a[l] < (int32_t)b[l] ? a[l] : b[l]); break;
        case MAX_S: LOOP((int32_t)a[l] > (int32_t)b[l] ? a[l] : b[l]); break;
        case CMP_F: CMP(u2f(a[l]), u2f(b[l])); break;
        case CMP_U: CMP(a[l], b[l]); break;
        case CMP_S: CMP((int32_t)a[l], (int32_t)b[l]); break;
        case MADSH_M16: LOOP((((a[l] & 0xffffu) * (b[l] >> 16)) << 16) + c[l]); break;
        case MAD_U16: LOOP((a[l] & 0xffffu) * (b[l] & 0xffffu) + c[l]); break;
        case MAD_S16: LOOP((uint32_t)((int64_t)s16(a[l]) * s16(b[l])) + c[l]); break;
        case MAD_U24: LOOP((a[l] & 0xffffffu) * (b[l] & 0xffffffu) + c[l]); break;
        case MAD_S24: LOOP((uint32_t)((int64_t)s24(a[l]) * s24(b[l])) + c[l]); break;
        case SEL: LOOP(b[l] != 0 ? a[l] : c[l]); break;
        case SHRM: LOOP((b[l] >> (a[l] & 31)) & c[l]); break;
        case SHLM: LOOP((b[l] << (a[l] & 31)) & c[l]); break;
        case SHRG: LOOP((b[l] >> (a[l] & 31)) | c[l]); break;
        case SHLG: LOOP((b[l] << (a[l] & 31)) | c[l]); break;
        case ANDG: LOOP((b[l] & a[l]) | c[l]); break;
        case F2S: LOOP(f2i(u2f(a[l]), -2147483648.0, 2147483647.0, 1)); break;
        case F2U: LOOP(f2i(u2f(a[l]), 0.0, 4294967295.0, 0)); break;
        case S2F: LOOP(f2u((float)(int32_t)a[l])); break;
        case U2F: LOOP(f2u((float)a[l])); break;
      }
      uint32_t *d = regs + u[1] * n + base;
      if (!mask) memcpy(d, r, m * 4);
      else for (int64_t l = 0; l < m; l++) if (mask[base + l]) d[l] = r[l];
    }
  }
}
"""


def source() -> str:
  run = {f"run_{isa}": _RUN % {"isa": isa, "attr": attr, "words": UOP_WORDS, "f16c": int(isa == "avx2")}
         for isa, attr in (("avx2", '__attribute__((target("avx2,f16c")))'), ("default", ""))}
  return _SOURCE % {"chunk": CHUNK, "enum": _ops_enum(), **run}


_LIB: Any = None          # the loaded library, False once it failed to build here
# fp16 bits -> fp32 bits exactly as numpy casts them (the closures widen texels with numpy)
_LUT16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
_LUT_PTR = _LUT16.ctypes.data


def _dead() -> None:   # a weak reference to nothing
  return None


def lib() -> Any:
  global _LIB
  if _LIB is None:
    try:
      dll = native_lib.build("ir3_native", source(), ("-O3", "-ffp-contract=off", "-fno-fast-math"))
      dll.ir3_native_run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
      dll.ir3_native_run.restype = None
      _LIB = dll
    except (OSError, AttributeError, subprocess.CalledProcessError) as e:   # no clang, or it does not build here
      detail = e.stderr.decode(errors="replace").strip().splitlines()[:1] if isinstance(e, subprocess.CalledProcessError) else [str(e)]
      print(f"[emu] the native executor is unavailable ({'; '.join(detail)}): level B runs on the numpy closures", file=sys.stderr)
      _LIB = False
  return _LIB


def enabled() -> bool:
  return os.environ.get("EMU_NATIVE", "1") != "0" and bool(lib())


# *** instruction -> micro-ops ***

def _src(o: Operand, step: int, kind: str) -> tuple[int, int] | None:
  """(kind|mods, value) of a full-width source for repetition `step`; None where the closures must read it."""
  m = 0
  if o.abs:
    m |= FABS if kind == "f" else SABS if kind == "s" else 0
  if o.neg:
    m |= FNEG if kind == "f" else SNEG if kind == "s" else UNEG
  if o.kind == "r":
    idx = o.index + (step if o.rpt else 0)
    return None if o.half or idx >= REG_A0 else (REG | m, idx)
  if o.kind == "c":
    return None if o.half else (CONST | m, o.index + (step if o.rpt else 0))
  if o.kind in ("imm", "fimm"):
    if o.half:
      return None
    bits = np.uint32(o.index & 0xffffffff) if o.kind == "imm" else np.float32(o.fval).view(np.uint32)
    return SCALAR, int(alu.to_bits(apply_mods(o, alu.bits_as(bits, False, kind)), False))
  return None


def _uop(op: str, dst: int, srcs: list[tuple[int, int]], aux: int = 0, wrmask: int = 0) -> list[int]:
  words = [OP[op], dst, aux]
  for i in range(3):
    words += list(srcs[i]) if i < len(srcs) else [-1, 0]
  return words + [wrmask]


def translate(ins: Instr, op_half: bool) -> list[list[int]] | None:
  """The micro-ops of one instruction, or None when it is not one of the native forms."""
  if ins.cat in (2, 3):
    table = _CAT2 if ins.cat == 2 else _CAT3
    if ins.op not in table or op_half or "sat" in ins.flags or ins.dst[0].kind != "r" or ins.dst[0].half:
      return None
    if ins.op in alu.CMPS and ins.cond not in CONDS:
      return None
    kind = alu.CMPS.get(ins.op) or (alu.CAT2 if ins.cat == 2 else alu.CAT3)[ins.op][0]
    out = []
    for s in range(ins.repeat + 1):
      if ins.dst[0].index + s >= REG_A0:
        return None
      srcs = [_src(o, s, kind) for o in ins.srcs]
      if any(x is None for x in srcs):
        return None
      out.append(_uop(table[ins.op], ins.dst[0].index + s, srcs, CONDS.index(ins.cond) if ins.op in alu.CMPS else 0))   # type: ignore[arg-type]
    return out
  if ins.cat == 1:
    return _move(ins)
  if ins.cat == 5:
    return _isam(ins)
  return None


def _move(ins: Instr) -> list[list[int]] | None:
  if ins.op not in ("mov", "cov") or len(ins.types) != 2:
    return None
  st, dt = ins.types
  dst, src = ins.dst[0], ins.srcs[0]
  if dst.kind != "r" or dst.half or dst.index + ins.repeat >= REG_A0:
    return None
  if src.kind in ("imm", "fimm"):
    bits = mov_const_bits(ins, False)
    return [_uop("COPY", dst.index + s, [(SCALAR, int(bits))]) for s in range(ins.repeat + 1)]
  words = (*_WORD32, "f32")
  if st not in words or dt not in words or src.half or src.kind not in ("r", "c") or (st == "f32" and dt == "b32"):
    return None   # (f32 -> b32 has no saturation bounds in alu.convert: the closures raise, so must this)
  op = ("COPY" if (st == "f32") == (dt == "f32") else "F2S" if dt == "s32" else "F2U" if st == "f32" else
        "S2F" if st == "s32" else "U2F")
  out = []
  for s in range(ins.repeat + 1):
    o = _src(src, s, "u")
    if o is None or (o[0] & ~3):   # mov applies no modifiers: a source printed with one goes to the closures
      return None
    out.append(_uop(op, dst.index + s, [o]))
  return out


def _isam(ins: Instr) -> list[list[int]] | None:
  if ins.op != "isam" or any(m in ("3d", "a", "o", "p", "s2en") or m.startswith("base") for m in ins.extra["mods"]):
    return None
  dst, coord = ins.dst[0], ins.srcs[0]
  tex = next((o.index for o in ins.srcs if o.kind == "tex"), None)
  wrmask = ins.extra["wrmask"]
  ncomp = bin(wrmask).count("1")
  if (tex is None or coord.kind != "r" or coord.half or coord.index + 1 >= REG_A0 or dst.kind != "r" or dst.half
      or dst.index + ncomp - 1 >= REG_A0):
    return None
  return [[OP["ISAM"], dst.index, tex, REG, coord.index, -1, 0, -1, 0, wrmask]]


# *** runs ***

class Run:
  """Consecutive native instructions of a block as one C call. Calling it returns False, having changed nothing, when
  a texture it reads cannot be resolved here (the closures then run the instructions and raise the fault)."""

  def __init__(self, uops: list[list[int]], count: int):
    self.uops = np.ascontiguousarray(np.array(uops, np.int64).reshape(-1, UOP_WORDS))
    self.ptr, self.nops, self.count = self.uops.ctypes.data, len(self.uops), count
    isams = self.uops[self.uops[:, 0] == OP["ISAM"]]
    self.slots = tuple(sorted({int(s) for s in isams[:, 2]}))
    self.n_isam = len(isams)
    rows, consts = [-1], [-1]
    for u in self.uops:
      rows.append(int(u[1]) + (3 if u[0] == OP["ISAM"] else 0))
      for k in range(3):
        kind, val = int(u[3 + 2 * k]), int(u[4 + 2 * k])
        if kind >= 0 and kind & 3 == REG:
          rows.append(val + (1 if u[0] == OP["ISAM"] else 0))
        elif kind >= 0 and kind & 3 == CONST:
          consts.append(val)
    self.top_row, self.top_const = max(rows), max(consts)   # the highest register row and const word it touches
    # the Images of the dispatch whose texture table the last call used (weakly: it holds views of that job's BOs), the table
    self._images: Any = _dead
    self._table = 0
    if self.slots:   # texture slot -> its row in the per-dispatch image table
      row = {s: i for i, s in enumerate(self.slots)}
      for u in self.uops:
        if u[0] == OP["ISAM"]:
          u[2] = row[int(u[2])]

  def __call__(self, b, mask) -> bool:
    L = b.L
    imgs = 0
    if self.slots:
      if self._images() is b.images:   # the same dispatch as the last call: its table still holds
        imgs = self._table
      else:
        try:
          imgs = b.images.native_table(self.slots)
        except GpuFault:
          return False
        self._images, self._table = weakref.ref(b.images), imgs
    if (ptrs := getattr(L, "native_ptrs", None)) is None:
      ptrs = L.native_ptrs = (L.full.ctypes.data, L.consts.ctypes.data, len(L.full), len(L.consts))
    if self.top_row >= ptrs[2] or self.top_const >= ptrs[3]:   # C would step outside the files: the closures raise instead
      return False
    mk = None if mask is None else np.ascontiguousarray(mask, np.bool_)
    _LIB.ir3_native_run(self.ptr, self.nops, ptrs[0], L.n, ptrs[1], 0 if mk is None else mk.ctypes.data, imgs, _LUT_PTR)
    if self.n_isam:
      b.counts.tex += b.active * self.n_isam
    return True


def plan(instrs: Sequence[Instr], handlers: Sequence[Callable], op_half: Callable[[Instr], bool]) -> list[tuple[Callable, tuple]]:
  """A block's instructions as (callable, closures): a Run with the closures of its instructions, or a closure alone
  (closures == ()). Runs shorter than MIN_RUN stay closures unless they fetch texels (the C call would not pay)."""
  out: list[tuple[Callable, tuple]] = []
  pending: list[tuple[list[list[int]], Callable, Instr]] = []

  def flush():
    if len(pending) >= MIN_RUN or (pending and pending[0][2].cat == 5):
      out.append((Run([u for p in pending for u in p[0]], len(pending)), tuple(p[1] for p in pending)))
    else:
      out.extend((p[1], ()) for p in pending)
    pending.clear()

  for ins, h in zip(instrs, handlers):
    uops = translate(ins, op_half(ins) if ins.cat in (2, 3) else False)
    if uops is None:
      flush()
      out.append((h, ()))
    else:
      pending.append((uops, h, ins))
  flush()
  return out
