"""Emulator level B: the a630 machine code tinymesa compiles, decoded and executed on the emulated render node.

Decode: every instruction of the reference program agrees with Mesa's own disassembly and decoded fields.
Execute: tinygrad ops on DEV=EMU+QCOM (openpilot's QCOM flags, IMAGE=2 images included) against the same ops on the CPU,
bit-exact where IEEE fixes the result, within stated bounds elsewhere; faults and unimplemented instructions are loud.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("qcom_artifact")
QCOM_FLAGS = {"FLOAT16": 1, "NOLOCALS": 1, "IMAGE": 2}
# fp16 storage rounds to 11 significant bits and reduction order differs from the CPU's: |a-b| <= ATOL + RTOL*|ref|
FP16_RTOL, FP16_ATOL = 1e-2, 1e-2
F32_REDUCE_RTOL, F32_REDUCE_ATOL = 1e-5, 1e-5
# cat4 (rcp/sqrt/exp2/log2/sin/cos) and the fp32 paths that use them: a few ulp of fp32
SFU_RTOL, SFU_ATOL = 4e-6, 1e-6


def _emu():
  import backend
  backend.install()
  from tinygrad import Device
  from tinygrad.helpers import DEV
  old = DEV.value
  DEV.value = "EMU+QCOM:IR3"
  try:
    dev = Device["QCOM"]
  finally:
    DEV.value = old
  return dev


@contextlib.contextmanager
def executing():
  """The QCOM device of this process on the emulated node, with IR3 execution on for the block."""
  node = _emu().iface.node
  was = node.execute
  node.set_execute(True)
  try:
    yield node
  finally:
    node.set_execute(was)


def on_both(fn, *arrays, flags=None):
  """fn over CPU tensors and over EMU tensors (under flags, QCOM's by default): (reference, emulated) as numpy."""
  from tinygrad import Tensor
  from tinygrad.helpers import Context
  ref = fn(*[Tensor(a, device="CPU") for a in arrays]).numpy()
  with executing(), Context(**(QCOM_FLAGS if flags is None else flags)):
    got = fn(*[Tensor(a, device="QCOM") for a in arrays]).numpy()
  return ref, got


def assert_close(ref, got, rtol, atol, what=""):
  assert ref.shape == got.shape and ref.dtype == got.dtype, (ref.shape, got.shape, ref.dtype, got.dtype)
  r, g = ref.astype(np.float64), got.astype(np.float64)
  excess = np.abs(g - r) - (atol + rtol * np.abs(r))
  assert np.array_equal(np.isnan(r), np.isnan(g)), f"{what}: NaN positions differ"
  ok = ~np.isnan(r)
  if (excess[ok] > 0).any():
    i = int(np.argmax(np.where(ok, excess, -np.inf)))
    raise AssertionError(f"{what}: element {i}: emulated {g.flat[i]!r} vs CPU {r.flat[i]!r} (tolerance {atol} + {rtol}*|ref|)")


RNG = np.random.default_rng(7)
F32 = (RNG.standard_normal(257) * 3).astype(np.float32)
F32B = (RNG.standard_normal(257) * 3).astype(np.float32)
POS = (np.abs(F32) + 0.1).astype(np.float32)
I32 = RNG.integers(-2**31, 2**31 - 1, 257, dtype=np.int64).astype(np.int32)
I32B = RNG.integers(-2**31, 2**31 - 1, 257, dtype=np.int64).astype(np.int32)
I32B[I32B == 0] = 3
SMALL = RNG.integers(-1000, 1000, 257).astype(np.int32)


# ---- decode ----

def test_decoder_agrees_with_mesa_on_every_instruction_of_the_reference_program(qcom_artifact, monkeypatch):
  """The tiny program under openpilot's flags, as the artifact holds it: every instruction decodes, prints back as Mesa prints
  it, and agrees with Mesa's decoded fields (flags, repeat/nop, register, const and immediate numbers)."""
  from backend.emu.ir3.decode import check_fields, decode
  shaders = _program_shaders(qcom_artifact, monkeypatch)
  n = 0
  ops = set()
  for sh in shaders:
    prog = decode(sh)
    for ins, m in zip(prog.instrs, prog.mesa):
      assert ins.render() == m.text, (ins.index, ins.render(), m.text)
      assert check_fields(ins, m) == [], (m.text, check_fields(ins, m))
      assert ins.cat == m.raw >> 61
      n += 1
      ops.add(ins.op)
  assert len(shaders) >= 20 and n > 2000, (len(shaders), n)
  assert {"mad.f32", "isam", "stib.b", "ldg", "stg", "cmps.f", "cov", "br", "predt"} <= ops, ops


def _program_shaders(artifact, monkeypatch) -> list[bytes]:
  """Every distinct shader one full step of the artifact dispatches (level A: recorded, not run)."""
  from tinygrad.helpers import DEV

  from modeld_msm.model_state import ModelState
  from selfdrive_glue.nv12 import nv12_info
  monkeypatch.setenv("MODELD_DEV", "EMU+QCOM:IR3")
  node = _emu().iface.node
  old_dev = DEV.value
  seen: dict[bytes, None] = {}
  old = node.on_dispatch
  node.on_dispatch = lambda d: seen.setdefault(d.shader, None)
  try:
    ms = ModelState(artifact)
    buf = np.zeros(nv12_info(1928, 1208).size, np.uint8)
    eye = np.eye(3, dtype=np.float32)
    ms.run(buf, buf, eye, eye, np.zeros(8, np.float32), np.array([[1, 0]], np.float32), False)
    _emu().synchronize()
  finally:
    node.on_dispatch = old
    DEV.value = old_dev
  return list(seen)


def test_decoder_representation():
  from backend.emu.ir3.decode import DecodeError, parse_operand
  o = parse_operand("(neg)(r)hr3.z")
  assert (o.kind, o.index, o.half, o.neg, o.rpt, o.abs) == ("r", 14, True, True, True, False)
  assert parse_operand("c12.w").index == 51 and parse_operand("c12.w").kind == "c"
  m = parse_operand("p[r44.x+80]")
  assert (m.kind, m.space, m.base.index, m.offset) == ("mem", "p", 176, 80)
  f = parse_operand("(log2(e))")
  assert f.kind == "fimm" and f.index == 8 and abs(f.fval - 1.4426950408889634) < 1e-12
  assert parse_operand("!p0.y").invert and parse_operand("!p0.y").index == 1
  with pytest.raises(DecodeError, match="not a form"):
    parse_operand("q7.x")


# ---- execute: conformance against the CPU ----

UNARY_F32 = {
  "neg": (lambda a: -a, 0, 0), "abs": (lambda a: a.abs(), 0, 0), "relu": (lambda a: a.relu(), 0, 0),
  "floor": (lambda a: a.floor(), 0, 0), "ceil": (lambda a: a.ceil(), 0, 0), "round": (lambda a: a.round(), 0, 0),
  "trunc": (lambda a: a.trunc(), 0, 0), "sqrt": (lambda a: a.abs().sqrt(), SFU_RTOL, SFU_ATOL),
  "reciprocal": (lambda a: a.reciprocal(), SFU_RTOL, SFU_ATOL), "exp": (lambda a: a.exp(), SFU_RTOL * 4, SFU_ATOL),
  "log": (lambda a: a.abs().add(0.1).log(), SFU_RTOL * 4, SFU_ATOL * 4), "sin": (lambda a: a.sin(), 1e-5, 1e-5),
  "sigmoid": (lambda a: a.sigmoid(), SFU_RTOL * 4, SFU_ATOL), "tanh": (lambda a: a.tanh(), 1e-5, 1e-5),
  "gelu": (lambda a: a.gelu(), 1e-5, 1e-5),
}


@pytest.mark.parametrize("name", list(UNARY_F32))
def test_unary_fp32(name):
  fn, rtol, atol = UNARY_F32[name]
  ref, got = on_both(fn, F32, flags={})
  if rtol == atol == 0:
    assert np.array_equal(ref, got), (name, np.abs(ref - got).max())
  else:
    assert_close(ref, got, rtol, atol, name)


BINARY = {
  "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "maximum": lambda a, b: a.maximum(b),
  "minimum": lambda a, b: a.minimum(b), "lt": lambda a, b: a < b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
  "where": lambda a, b: (a < b).where(a, b),
}


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_fp32_bit_exact(name):
  ref, got = on_both(BINARY[name], F32, F32B, flags={})
  assert np.array_equal(ref, got), name


def test_division_fp32_within_rcp_bound():
  """tinygrad's IR3 code divides as a * rcp(b): within 2 ulp of the CPU's correctly rounded a / b."""
  ref, got = on_both(lambda a, b: a / b, F32, F32B, flags={})
  assert_close(ref, got, 2.5e-7, 0, "div")


# What C leaves undefined or to the implementation (signed overflow, a negative value shifted, an out-of-range float -> int
# conversion, a narrowing signed conversion), the CPU device computes however its ISA happens to: clang's AVX2 and AVX-512 code
# disagree on float -> uint8 of a negative value. So the reference is numpy computing the semantics that tinygrad's IR3 path is
# compiled from: NIR's ALU ops (tinygrad/renderer/nir.py builds NIR for Mesa's ir3; https://docs.mesa3d.org/nir/alu.html), where
# iadd/isub/imul/ineg/ishl are two's complement modulo 2**bits, ishr is arithmetic, idiv/irem as tinygrad lowers floor division, and an
# integer narrowing keeps the low bits. The emulator is held to that on all data; the CPU only where C defines the result.
INT = {
  "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "and": lambda a, b: a & b, "or": lambda a, b: a | b,
  "xor": lambda a, b: a ^ b, "lt": lambda a, b: a < b, "eq": lambda a, b: a == b, "max": lambda a, b: a.maximum(b),
  "shl": lambda a, b: a << 3, "shr": lambda a, b: a >> 5, "idiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
  "neg": lambda a, b: -a, "where": lambda a, b: (a < b).where(a, b),
}
# the same ops in exact (int64) arithmetic; _wrap then takes the result modulo 2**bits as NIR defines it
INT_EXACT = {
  "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "and": lambda a, b: a & b, "or": lambda a, b: a | b,
  "xor": lambda a, b: a ^ b, "lt": lambda a, b: a < b, "eq": lambda a, b: a == b, "max": np.maximum, "shl": lambda a, b: a << 3,
  "shr": lambda a, b: a >> 5, "idiv": lambda a, b: a // b, "mod": lambda a, b: a % b, "neg": lambda a, b: -a,
  "where": lambda a, b: np.where(a < b, a, b),
}


def _wrap(exact, dtype):
  """exact integers -> dtype, modulo 2**bits (booleans pass)."""
  exact = np.asarray(exact)
  if exact.dtype == np.bool_:
    return exact
  bits = np.dtype(dtype).itemsize * 8
  return ((exact.astype(np.int64) & ((1 << bits) - 1)).astype(np.uint64)).astype(np.dtype(dtype).str.replace("i", "u")).view(dtype)


def _defined_in_c(name, a, b, exact, dtype):
  """Where C defines tinygrad's rendering of the op: no signed overflow, no negative value shifted (left: undefined; right:
  implementation-defined), no narrowing of a value the type cannot hold."""
  info = np.iinfo(dtype)
  ok = np.ones(a.shape, bool) if exact.dtype == np.bool_ else (exact >= info.min) & (exact <= info.max)
  if name in ("shl", "shr"):
    ok &= a >= 0
  return ok


def _against_reference(name, a, b, dtype, ref, got):
  a64, b64 = a.astype(np.int64), b.astype(np.int64)
  exact = np.asarray(INT_EXACT[name](a64, b64))
  want = _wrap(exact, dtype)
  assert np.array_equal(got, want), (name, dtype, "emulated vs NIR's definition", got[:6], want[:6])
  ok = _defined_in_c(name, a64, b64, exact, dtype)
  assert ok.sum() >= len(a) // 10, (name, int(ok.sum()))   # the CPU still checks a good share of the data
  assert np.array_equal(ref[ok], want[ok]), (name, dtype, "CPU vs NIR's definition where C defines it", ref[ok][:6], want[ok][:6])


@pytest.mark.parametrize("name", list(INT))
def test_int32_bit_exact(name):
  a, b = I32.copy(), I32B.copy()
  a[:128] >>= 17   # half the data small enough that C defines every op on it (|a*b| < 2**31), half full range
  b[:128] >>= 17
  b[b == 0] = 3
  # INT_MIN // -1 traps (SIGFPE) on the CPU instead of giving a value: no mask could keep it out, so the data never holds it
  assert not ((a == np.iinfo(np.int32).min) & (b == -1)).any() and (b != 0).all()
  ref, got = on_both(INT[name], a, b, flags={})
  _against_reference(name, a, b, np.int32, ref, got)


def test_int32_reference_data_reaches_the_undefined_cases():
  """The full-range data overflows add/sub/mul/shl and shifts negative values, so the emulator is checked where C is not."""
  a, b = I32.astype(np.int64), I32B.astype(np.int64)
  for name in ("add", "sub", "shl", "shr"):
    assert (~_defined_in_c(name, a, b, np.asarray(INT_EXACT[name](a, b)), np.int32)).sum() > 20, name


@pytest.mark.parametrize("name", ["add", "sub", "mul", "idiv", "mod", "lt", "max", "and", "shr"])
def test_int16_and_int8_bit_exact(name):
  """16-bit integer ALU on half registers (mul.s24/mad.s24 widen a half source before sign-extending it)."""
  from tinygrad import dtypes
  a16, b16 = (SMALL * 31).astype(np.int16), (I32B % 200).astype(np.int16)
  a16[:128] //= 31 * 8   # products in range on half the data (C then defines the narrowing back to 16 bits), wrapping on the rest
  b16[b16 == 0] = 5
  a8, b8 = (a16 % 200 - 100).astype(np.int8), (b16 % 100 - 50).astype(np.int8)   # negative bytes: u8 -> s16 sign-extends
  b8[b8 == 0] = 7
  for dt, a, b in ((dtypes.int16, a16, b16), (dtypes.int8, a8, b8)):
    ref, got = on_both(lambda x, y, _dt=dt: INT[name](x.cast(_dt), y.cast(_dt)), a, b, flags={})
    _against_reference(name, a, b, a.dtype, ref, got)


FP16 = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "max": lambda a, b: a.maximum(b), "lt": lambda a, b: a < b,
        "mad": lambda a, b: a * b + a, "exp2": lambda a, b: (a * 0.25).exp2(), "relu": lambda a, b: a.relu()}


@pytest.mark.parametrize("name", list(FP16))
def test_fp16(name):
  """fp16 ops: half registers, cov and fp16 ALU. Each op rounds to fp16 as the CPU does (exp2: within 1 fp16 ulp). mad is
  held to the a6xx's two roundings (see MESA_MAD): the CPU's a*b+a in _Float16 is evaluated in float or fused as clang and
  the host's ISA choose (C leaves the evaluation method of _Float16 to the implementation), so it is only within an ulp."""
  from tinygrad import dtypes
  fn = FP16[name]
  ref, got = on_both(lambda a, b: fn(a.cast(dtypes.half), b.cast(dtypes.half)), F32, F32B, flags={})
  if name == "exp2":
    assert_close(ref, got, 1e-3, 1e-3, name)
  elif name == "mad":
    a, b = F32.astype(np.float16), F32B.astype(np.float16)
    assert np.array_equal(got, (a * b) + a), "mad.f16: a*b rounded to fp16, then +a rounded"
    # one rounding or two: apart by at most an fp16 ulp of a*b plus one of the sum (which may cancel, so not relative to it)
    bound = np.spacing(np.abs(a * b)).astype(np.float64) + np.spacing(np.abs(got))
    assert (np.abs(ref.astype(np.float64) - got) <= bound).all(), name
  else:
    assert np.array_equal(ref, got), name


def test_int64_to_float_through_mesas_lowering_of_find_msb():
  """The a630 has no 64-bit ALU: NIR lowers i64 -> f32 with ufind_msb of each half, which Mesa's ir3 emits as
  `sel(x != 0 ? 31 - clz.b(x) : clz.b(x))` (src/freedreno/ir3/ir3_compiler_nir.c, nir_op_ufind_msb): NIR's ufind_msb(0) = -1
  holds only if clz.b(0) is -1 (all ones), and find_lsb = clz.b(bfrev(x)) needs the same. With clz.b(0) = 32 every value
  whose high word is 0 converted to 0. C defines int64 -> float (rounded to nearest even), so the CPU is the reference."""
  from tinygrad import dtypes
  v = np.concatenate([np.arange(-4, 5), [2**31 - 1, 2**31, 2**32 + 7, 2**40 + 12345, -(2**40) - 3, 2**62 + 2**39 + 1, -(2**63)],
                      np.random.default_rng(11).integers(-2**62, 2**62, 64)]).astype(np.int64)
  ref, got = on_both(lambda x: x.cast(dtypes.float32), v, flags={})
  assert np.array_equal(ref, v.astype(np.float32)) and np.array_equal(got, ref), (got[:16], ref[:16])


def test_sin_of_large_arguments_is_what_mesas_range_reduction_computes():
  """Mesa reduces a 32-bit fsin/fcos argument before the a6xx sin/cos (src/freedreno/ir3/ir3_nir_trig.py):
  `(('fsin', 'x@32'), ('fsin', ('!ffma_old', 6.2831853, ('ffract', ('!ffma_old', 0.15915494, 'x', 0.5)), -3.14159265)))`.
  In fp32 that phase is coarse for large x (x = 1e6: x/2pi + 0.5 = 159155.4375, ulp 1/64), so the a630 gives sin(-pi/8), not
  sin(1e6) = -0.34999: tinygrad's test_ops sin/cos/tan fail there on the hardware too. Held exactly (mad rounding twice, as
  Mesa's mad does), with the small arguments within the SFU bound."""
  from tinygrad import Tensor
  x = np.array([1e6, 1e5, 12345.678, 3.0, -2.5, 0.1], np.float32)
  with executing():
    got = Tensor(x, device="QCOM").sin().numpy()
  t = x * np.float32(0.15915494) + np.float32(0.5)   # each op rounds to fp32, as mad.f32 does
  y = (t - np.floor(t)) * np.float32(6.2831853) + np.float32(-3.14159265)
  want = np.sin(y.astype(np.float64)).astype(np.float32)
  assert abs(got[0] - np.sin(-np.pi / 8)) < 1e-6 and abs(float(np.sin(1e6)) - got[0]) > 0.03, got[0]
  assert_close(want, got, SFU_RTOL, SFU_ATOL, "sin after Mesa's range reduction")
  assert_close(np.sin(x[3:].astype(np.float64)).astype(np.float32), got[3:], 1e-5, 1e-5, "sin of small arguments")


# Mesa's ir3 turns a*b+c into mad.f32/mad.f16 and says why it may: "fuse fadd+fmul late to get something we can turn into
# mad.f32/f16. [...] Since for us, mad is not fused, we don't have this restriction." (src/freedreno/ir3/
# ir3_nir_opt_algebraic_late.py, Mesa main). So the a6xx rounds a*b to the type, then the sum: two roundings, not an FMA.
MESA_MAD = "ir3_nir_opt_algebraic_late.py: mad is not fused"


def test_mad_f32_rounds_twice_as_mesa_states():
  """c = -(a*b rounded): two roundings give exactly 0, one rounding (an FMA) gives a*b's rounding error. The kernel must
  hold a mad.f32 (else this tests add and mul), and the data must tell the two apart (else it cannot fail)."""
  from tinygrad import Tensor

  from backend.emu.ir3.decode import decode
  a, b = F32 * np.float32(1.37), F32B * np.float32(0.91)
  c = -(a * b)
  fused = (a.astype(np.float64) * b + c).astype(np.float32)
  assert (fused != 0).sum() > len(a) // 2, "the data must separate one rounding from two"
  shaders: list[bytes] = []
  with executing() as node:
    node.on_dispatch, was = (lambda d: shaders.append(d.shader)), node.on_dispatch
    try:
      got = (Tensor(a, device="QCOM") * Tensor(b, device="QCOM") + Tensor(c, device="QCOM")).numpy()
    finally:
      node.on_dispatch = was
  ops = {i.op for sh in shaders for i in decode(sh).instrs}
  assert "mad.f32" in ops, (MESA_MAD, sorted(ops))
  assert np.array_equal(got, (a * b) + c) and not got.any(), (MESA_MAD, got[:8])


CASTS = [("float32", "int32"), ("float32", "half"), ("half", "float32"), ("int32", "float32"), ("int32", "half"), ("float32", "uint8"),
         ("int32", "uint8"), ("uint8", "float32"), ("int32", "int8"), ("float32", "bool"), ("bool", "float32"), ("half", "int32")]
NP = {"float32": np.float32, "half": np.float16, "int32": np.int32, "uint8": np.uint8, "int8": np.int8, "bool": np.bool_}


def _cast_reference(data, src, dst):
  """numpy with IEEE rounding (to nearest even) into floats and, into integers, NIR's conversions as tinygrad's IR3 path builds them:
  a float truncates toward zero (f2i32: tinygrad/renderer/nir.py casts float -> uint8/uint16 through int32, since SPIR-V's
  OpConvertFToU is undefined for a narrower result), and a narrowing integer conversion keeps the low bits. Returns the values
  and where C defines the same conversion (a float that truncates into the destination's range; a signed narrowing in range)."""
  x = data
  if dst == "bool":
    return x != 0, np.ones(x.shape, bool)
  if dst in ("float32", "half"):
    return x.astype(NP[dst]), np.ones(x.shape, bool)
  exact = np.trunc(x.astype(np.float64)).astype(np.int64) if x.dtype.kind == "f" else x.astype(np.int64)
  info = np.iinfo(NP[dst])
  in_range = (exact >= info.min) & (exact <= info.max)
  defined = in_range if (x.dtype.kind == "f" or info.min < 0) else np.ones(x.shape, bool)
  return _wrap(exact, NP[dst]), defined


@pytest.mark.parametrize("src,dst", CASTS)
def test_casts_bit_exact(src, dst):
  """Every cast against the stated reference (_cast_reference): the emulator on all data, out-of-range float -> uint8 and int32 ->
  int8 included; the CPU where C defines the conversion."""
  from tinygrad import dtypes
  small = SMALL.copy()
  small[:64] %= 100   # a quarter in int8's range
  data = {"float32": (F32 * 30).astype(np.float32), "half": F32.astype(np.float16), "int32": small, "uint8": (SMALL % 256).astype(np.uint8),
          "bool": F32 > 0}[src]
  d = getattr(dtypes, dst)
  ref, got = on_both(lambda a: a.cast(d), data, flags={})
  want, defined = _cast_reference(data, src, dst)
  assert np.array_equal(got, want), (src, dst, "emulated vs reference", got[:6], want[:6])
  assert defined.sum() >= len(data) // 5, (src, dst, int(defined.sum()))
  assert np.array_equal(ref[defined], want[defined]), (src, dst, "CPU vs reference where C defines it", ref[defined][:6], want[defined][:6])
  if (src, dst) in (("float32", "uint8"), ("int32", "int8")):
    assert (~defined).sum() > 20   # the data does reach the conversions C leaves open, so the emulator is held to NIR's there


@pytest.mark.parametrize("shape,axis", [((257,), None), ((64, 96), 1), ((64, 96), 0), ((4, 8, 300), (0, 2)), ((3, 100000), 1)])
def test_reductions(shape, axis):
  a = RNG.standard_normal(shape).astype(np.float32)
  ref, got = on_both(lambda t: t.sum(axis), a, flags={})
  assert_close(ref, got, F32_REDUCE_RTOL, F32_REDUCE_ATOL * np.sqrt(a.size), "sum")
  ref, got = on_both(lambda t: t.max(axis), a, flags={})
  assert np.array_equal(ref, got)


@pytest.mark.parametrize("m,k,n", [(1, 64, 33), (17, 31, 9), (64, 48, 40)])
def test_matmul_fp32(m, k, n):
  a, b = RNG.standard_normal((m, k)).astype(np.float32), RNG.standard_normal((k, n)).astype(np.float32)
  ref, got = on_both(lambda x, y: x @ y, a, b, flags={})
  assert_close(ref, got, 1e-5, 1e-5 * k, "matmul")


def test_softmax_and_gather():
  a = RNG.standard_normal((8, 77)).astype(np.float32)
  ref, got = on_both(lambda t: t.softmax(-1), a, flags={})
  assert_close(ref, got, SFU_RTOL * 4, 1e-7, "softmax")
  idx = RNG.integers(0, a.size, 300).astype(np.int32)
  ref, got = on_both(lambda t, i: t.reshape(-1)[i], a, idx, flags={})
  assert np.array_equal(ref, got)


CONVS = {
  "3x3": dict(padding=1), "1x1": dict(), "3x3 stride 2": dict(padding=1, stride=2), "depthwise": dict(padding=1, groups=12),
}


@pytest.mark.parametrize("name", list(CONVS))
def test_conv2d_image_path_under_openpilot_flags(name):
  """Under openpilot's flags (IMAGE=2 FLOAT16=1 NOLOCALS=1). tinygrad keeps these small convolutions in buffers; the image
  path (RGBA16F isam/stib) is exercised by the reference models (test_qcom_exec)."""
  kw = CONVS[name]
  x = RNG.standard_normal((1, 12, 16, 32)).astype(np.float32)
  w = RNG.standard_normal((12 if "groups" in kw else 16, 1 if "groups" in kw else 12, 1 if name == "1x1" else 3,
                           1 if name == "1x1" else 3)).astype(np.float32)
  ref, got = on_both(lambda a, b: a.conv2d(b, **kw).relu(), x, w)
  assert_close(ref, got, FP16_RTOL, FP16_ATOL * 3, name)


def test_tinyjit_replays_with_changing_input_buffers():
  from tinygrad import Tensor, TinyJit
  from tinygrad.helpers import Context
  w = RNG.standard_normal((16, 8)).astype(np.float32)
  with executing(), Context(**QCOM_FLAGS):
    wt = Tensor(w, device="QCOM").realize()
    step = TinyJit(lambda x: (x @ wt).relu().realize())
    for i in range(5):
      x = RNG.standard_normal((4, 16)).astype(np.float32)
      got = step(Tensor(x, device="QCOM")).numpy()
      assert_close(np.maximum(x @ w, 0), got, FP16_RTOL, FP16_ATOL * 4, f"jit call {i}")


# ---- faults ----

def _bend(d):
  """Tamper hook: the first buffer pointer of tinygrad's IR3 kernels (c0.x/c0.y; see consts layout) moved 1 MiB past its buffer."""
  c = bytearray(d.consts)
  lo = int.from_bytes(c[0:4], "little")
  c[0:4] = ((lo + (1 << 20)) & 0xffffffff).to_bytes(4, "little")
  return dataclasses.replace(d, consts=bytes(c))


@contextlib.contextmanager
def fault_policy(node, policy: str):
  """The shared node's fault policy for the block (read per job, so switching between steps is safe)."""
  was = node.fault_policy
  node.fault_policy = policy
  try:
    yield node
  finally:
    node.fault_policy = was


@contextlib.contextmanager
def planted_faults(node):
  """For a test that makes the shared node fault on purpose: the entries its faults add to the node's logs (stats.faults,
  stats.reported) are taken out again when the block ends. The node is this process's QCOM device's, so whatever a test
  leaves in those logs is seen by every later test on it (test_backend_qcom.py asserts they hold no fault), in whichever
  order pytest or xdist runs them. The monotonic counters (page_faults, a queue's FAULTS) stay: tests read them as deltas."""
  faults, reported = list(node.stats.faults), list(node.stats.reported)
  try:
    yield node
  finally:
    node.stats.faults[:], node.stats.reported[:] = faults, reported


def test_pointer_outside_the_submit_faults_and_names_the_kernel():
  """A global load through a pointer the kernel was not given (a constant bent by 1 MiB past its buffer) is a GPU fault in
  strict mode, reported through the MSM fault path with the kernel and the instruction."""
  from tinygrad import Tensor

  from backend.msm import MSMFault
  with executing() as node, fault_policy(node, "strict"), planted_faults(node):
    a = Tensor(np.arange(64, dtype=np.float32), device="QCOM").realize()
    node.tamper = _bend
    try:
      with pytest.raises(MSMFault, match="instruction .*(ldg|stg).*(no mapped BO|not listed|past the end)"):
        (a * 2).numpy()
    finally:
      node.tamper = None
    assert np.array_equal((a * 2).numpy(), np.arange(64) * 2.0)   # the device stays usable


def test_pointer_fault_without_hang_returns_a_wrong_answer():
  """The default (kernel) policy, like msm: the same bent pointer is a page fault that does not hang, so the step returns with
  no error and an unchanged FAULTS count, and the output is wrong; only the node's log names the kernel and the instruction."""
  from tinygrad import Tensor
  with executing() as node, fault_policy(node, "kernel"), planted_faults(node):
    it = _emu().iface
    a = Tensor(np.arange(64, dtype=np.float32), device="QCOM").realize()
    want = np.arange(64) * 3.0 + 1
    faults, page = it._fault_count(), node.stats.page_faults
    node.tamper = _bend
    try:
      got = (a * 3 + 1).numpy()   # returns: no MSMFault, no timeout
    finally:
      node.tamper = None
    assert it._fault_count() == faults and node.stats.page_faults > page
    assert re.search(r"page fault, no hang \(not reported\): kernel .*instruction .*(ldg|stg)", node.stats.faults[-1])
    assert not np.array_equal(got, want)   # the faulting dispatch's work is lost: nothing in the UAPI said so
    assert np.array_equal((a * 3 + 1).numpy(), want)


def test_planted_faults_leave_the_shared_node_logs_as_found():
  """The two tests above fault the process's shared node on purpose. Their log entries stayed behind, and a later test on
  that node in the same process (test_backend_qcom.py's elementwise and JIT-replay tests: `not node.stats.faults`) failed
  on faults it never caused, whenever xdist happened to give one worker these tests first."""
  node = _emu().iface.node
  before = list(node.stats.faults), list(node.stats.reported)
  test_pointer_outside_the_submit_faults_and_names_the_kernel()
  test_pointer_fault_without_hang_returns_a_wrong_answer()
  assert (node.stats.faults, node.stats.reported) == before


def test_unimplemented_instruction_is_a_clear_error():
  from backend.emu.executor import Dispatch
  from backend.emu.ir3.execute import ShaderFault, run_dispatch
  # 'emit' (cat0 opcode 7, a geometry-shader instruction) is not something a compute dispatch runs: it must say so
  prog = (0).to_bytes(8, "little") + _encode_cat0(7) + _encode_cat0(6)
  d = Dispatch((1, 1, 1), (1, 1, 1), 0, prog, bytes(4096), b"", b"", b"", {}, 0)
  with pytest.raises(ShaderFault, match=r"kernel k: instruction 1 'emit': not implemented"):
    run_dispatch(d, None, kernel="k")
  with pytest.raises(ShaderFault, match=r"kernel k: .*no match"):   # words Mesa cannot decode are refused before running
    run_dispatch(dataclasses.replace(d, shader=_encode_cat0(12) + _encode_cat0(6)), None, kernel="k")


def _encode_cat0(opc: int) -> bytes:
  # cat0: opc_cat (bits 61-63) = 0, opcode in bits 55-58
  return ((opc & 0xf) << 55).to_bytes(8, "little")


def test_level_b_is_selected_by_environment(tmp_path):
  import subprocess
  import sys
  code = ("import backend; backend.install()\nfrom tinygrad import Device\nfrom tinygrad.helpers import DEV\nDEV.value='EMU+QCOM:IR3'\n"
          "print(Device['QCOM'].iface.node.execute)")
  outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "EMU_EXEC": v},
                         cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120).stdout.strip() for v in ("1", "0")]
  assert outs == ["True", "False"], outs


@pytest.mark.slow
def test_decoder_agrees_with_mesa_on_the_full_reference_program(tmp_path):
  """Every kernel of the full-size program (vision 794 M MACs + policy) under openpilot's flags, captured at level A."""
  from tinygrad.helpers import DEV, Context

  from backend.emu.ir3.decode import check_fields, decode
  from compile.onnx_model import load_model_info
  from compile.programs.driving_step import DrivingProgram
  from compile.refmodels.driving import write_models
  from modeld_msm.named_program import host_of, host_tensors
  from selfdrive_glue.nv12 import nv12_info
  write_models(tmp_path, "full", 0)
  node = _emu().iface.node
  seen: dict[bytes, None] = {}
  old, was, old_dev = node.on_dispatch, node.execute, DEV.value
  node.on_dispatch = lambda d: seen.setdefault(d.shader, None)
  node.set_execute(False)
  try:
    DEV.value = "EMU+QCOM:IR3"
    with Context(**QCOM_FLAGS):
      nv = nv12_info(1928, 1208)
      prog = DrivingProgram(load_model_info(tmp_path / "driving_vision.onnx", "vision"), load_model_info(tmp_path / "driving_policy.onnx", "policy"),
                            nv, "QCOM")
      host = host_tensors(host_of())
      from tinygrad import Tensor
      frame = Tensor(np.zeros(nv.size, np.uint8), device="QCOM")
      v, p = prog.run_policy(frame, frame, host["desire"], host["traffic_convention"], host["tfm"], host["big_tfm"])
      v.numpy()
  finally:
    node.on_dispatch, DEV.value = old, old_dev
    node.set_execute(was)
  n = 0
  for sh in seen:
    pr = decode(sh)
    for ins, m in zip(pr.instrs, pr.mesa):
      assert ins.render() == m.text and check_fields(ins, m) == [], (m.text, check_fields(ins, m))
      n += 1
  assert len(seen) >= 50 and n > 10000, (len(seen), n)
