"""Each instruction of a program turned once into a closure `fn(batch, mask)` with its operands resolved.

The interpreter's generic handlers (execute.py) re-read the Instr on every execution: operand kinds, modifiers, type
tables, op widths. That Python work cost more than the numpy work it drives on the lane counts tinygrad's kernels have
(hundreds to a few thousand lanes). Here it is done once per program; what runs per execution are the same numpy
operations, in the same order and dtypes, as the generic path, so registers, memory, faults and counts are bit-identical.
Anything outside the fast forms (special registers, predicate destinations, const operands of a mov, non-global memory)
keeps calling the generic handler.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from backend.emu.ir3 import alu
from backend.emu.ir3.decode import REG_A0, Instr, Operand
from backend.emu.ir3.memory import MEM_BYTES, from_bytes, load_bytes, store_bytes, to_bytes

Handler = Callable[[Any, Any], None]   # (Batch, mask or None)
_KEYS = itertools.count()
_VIEW = {("f", False): np.float32, ("f", True): np.float16, ("s", False): np.int32, ("s", True): np.int16}


def compile_instr(ins: Instr, generic: Callable, op_half: bool) -> Handler:
  fn: Handler | None = None
  if ins.cat in (2, 3):
    fn = _alu(ins, op_half)
  elif ins.cat == 1:
    fn = _mov(ins)
  elif ins.cat == 5:
    fn = _isam(ins)
  elif ins.cat == 6 and ins.op in ("ldg", "stg"):
    fn = _global(ins, generic)
  elif ins.cat == 6 and ins.op == "stib.b":
    fn = _stib(ins, generic)
  if fn is None:
    def fn(b, mask, _ins=ins, _g=generic):
      _g(b, _ins, mask)
  return fn


def _reg_ok(o: Operand, last: int) -> bool:
  return o.kind == "r" and o.index + last < REG_A0


def _store(L, d: int, dhalf: bool, bits, mask) -> None:
  """Lanes.write of a register destination, bits already in the destination's dtype."""
  row = L.hrow(d) if dhalf else L.full[d]
  if mask is None:
    row[...] = bits
  else:
    np.copyto(row, bits, where=mask, casting="unsafe")


def _store_res(L, d: int, dhalf: bool, res, mask) -> None:
  """_store(to_bits(res)): an fp32 or integer result for a full register over every lane goes straight into the row
  (fp32 is copied as is, integers take the same wrapping cast astype makes), without the intermediate copy."""
  if mask is None and not dhalf and type(res) is np.ndarray:
    if res.dtype == np.float32:
      L.f32[d] = res
      return
    if res.dtype.kind in "biu":
      L.full[d] = res
      return
  _store(L, d, dhalf, alu.to_bits(res, dhalf), mask)


def _src_reader(o: Operand, step: int, half: bool, kind: str) -> Callable[[Any], Any]:
  """What execute._typed returns for this source and step, as a function of the Lanes."""
  if o.kind == "r":
    idx = o.index + (step if o.rpt else 0)
    vt = _VIEW.get((kind, o.half))
    if o.half:
      def raw(L, _i=idx):
        return L.hrow(_i)
    else:
      def raw(L, _i=idx):
        return L.full[_i]
    if vt is None:
      base = raw
    else:
      def base(L, _raw=raw, _vt=vt):
        return _raw(L).view(_vt)
  elif o.kind in ("imm", "fimm"):
    if o.kind == "imm":
      bits: Any = np.uint16(o.index & 0xffff) if (half or o.half) else np.uint32(o.index & 0xffffffff)
    else:
      bits = np.float16(o.fval).view(np.uint16) if (half or o.half) else np.float32(o.fval).view(np.uint32)
    value = apply_mods(o, alu.bits_as(bits, half, kind))   # lane-independent: computed once

    def const(L, _v=value):
      return _v
    return const
  else:   # consts: the file is per dispatch, so the typed value is made once per batch (Lanes.memo)
    key = next(_KEYS)

    def base(L, _o=o, _s=step, _h=half, _k=kind, _key=key):
      if (v := L.memo.get(_key)) is None:
        v = L.memo[_key] = alu.bits_as(L.read(_o, _s, _h, kind=_k), _h, _k)
      return v
  if not (o.abs or o.neg):
    return base

  def modified(L, _b=base, _o=o):
    return apply_mods(_o, _b(L))
  return modified


def apply_mods(o: Operand, v):
  """(abs) then (neg) of a typed source, as the generic handlers apply them."""
  if o.abs:
    v = np.abs(v)
  if o.neg:
    v = -v
  return v


def _alu(ins: Instr, op_half: bool) -> Handler | None:
  op = ins.op
  if ins.cat == 2:
    if op in alu.CMPS:
      if ins.cond not in ("lt", "le", "gt", "ge", "eq", "ne"):
        return None
      kind, f = alu.CMPS[op], alu._cmp(ins.cond)
    elif op in alu.CAT2:
      kind, f = alu.CAT2[op]
    else:
      return None
  elif op in alu.CAT3:
    kind, f = alu.CAT3[op]
  else:
    return None
  dst, last = ins.dst[0], ins.repeat
  if not _reg_ok(dst, last) or any(o.kind not in ("r", "c", "imm", "fimm") or (o.kind == "r" and not _reg_ok(o, last))
                                   for o in ins.srcs):
    return None
  sat = "sat" in ins.flags and kind == "f"
  dhalf = dst.half
  steps = [(dst.index + s, tuple(_src_reader(o, s, o.half if o.kind == "r" else op_half, kind) for o in ins.srcs))
           for s in range(last + 1)]
  if (f in _IN_PLACE and not sat and not dhalf and not op_half and kind in _TYPED_FILE
      and not any(o.kind == "r" and o.half for o in ins.srcs)):
    return _in_place(f, _TYPED_FILE[kind], steps, _alu_run(f, steps, dhalf, sat))
  if len(steps) == 1 and len(ins.srcs) == 2 and not sat:
    (d, (ra, rb)), = steps

    def run2(b, mask):
      L = b.L
      _store_res(L, d, dhalf, f(ra(L), rb(L)), mask)
    return run2
  if op == "mad.f32" and last == 0 and not sat and not dhalf and all(o.kind == "r" and not o.half and not o.mods for o in ins.srcs):
    ia, ib, ic = (o.index for o in ins.srcs)
    return _mad_f32(dst.index, ia, ib, ic, _alu_run3(f, dst.index, dhalf, steps[0][1]))
  if len(steps) == 1 and len(ins.srcs) == 3 and not sat:
    return _alu_run3(f, steps[0][0], dhalf, steps[0][1])
  return _alu_run(f, steps, dhalf, sat)


def _alu_run(f, steps, dhalf: bool, sat: bool) -> Handler:
  def run(b, mask):
    L = b.L
    for d, readers in steps:
      res = f(*[r(L) for r in readers])
      if sat:
        res = np.clip(res, 0, 1)
      _store_res(L, d, dhalf, res, mask)
  return run


# ufuncs whose result has the dtype of their (all 32-bit, same-kind) sources: they can write the register row directly
_IN_PLACE = (np.add, np.multiply, np.subtract, np.fmin, np.fmax, np.minimum, np.maximum, np.bitwise_and, np.bitwise_or,
             np.bitwise_xor)
_TYPED_FILE = {"f": "f32", "u": "full", "s": "i32"}   # the Lanes attribute viewing the full file in the op's type


def _in_place(f, file: str, steps, slow: Handler) -> Handler:
  """A 32-bit op over every lane, computed straight into its destination row: the same ufunc loop and dtype as
  f(...) + to_bits + the row copy, one pass instead of three."""
  if len(steps) == 1 and len(steps[0][1]) == 2:
    (d, (ra, rb)), = steps

    def ip2(b, mask):
      if mask is not None:
        return slow(b, mask)
      L = b.L
      f(ra(L), rb(L), out=getattr(L, file)[d])
    return ip2

  def ip(b, mask):
    if mask is not None:
      return slow(b, mask)
    L = b.L
    for d, readers in steps:
      f(*[r(L) for r in readers], out=getattr(L, file)[d])
  return ip


def _alu_run3(f, d: int, dhalf: bool, readers) -> Handler:
  ra, rb, rc = readers

  def run3(b, mask):
    L = b.L
    _store_res(L, d, dhalf, f(ra(L), rb(L), rc(L)), mask)
  return run3


def _mad_f32(d: int, ia: int, ib: int, ic: int, slow: Handler) -> Handler:
  """alu.CAT3['mad.f32'] over every lane, in place: a*b rounded to fp32, then +c rounded (the a6xx mad is not fused)."""
  def mad(b, mask):
    if mask is not None:
      return slow(b, mask)
    f32 = b.L.f32
    t = np.multiply(f32[ia], f32[ib])
    np.add(t, f32[ic], out=f32[d])
  return mad


def _mov(ins: Instr) -> Handler | None:
  if ins.op not in ("mov", "cov"):
    return None
  st, dt = ins.types
  dst, src = ins.dst[0], ins.srcs[0]
  last = ins.repeat
  if not _reg_ok(dst, last) or src.kind not in ("r", "imm", "fimm") or (src.kind == "r" and not _reg_ok(src, last)):
    return None
  dhalf = dst.half
  if src.kind != "r":   # the same value every repetition
    bits = mov_const_bits(ins, dhalf)
    ds = [dst.index + s for s in range(last + 1)]

    def run_const(b, mask):
      L = b.L
      for d in ds:
        _store(L, d, dhalf, bits, mask)
    return run_const
  shalf = src.half
  pairs = [(dst.index + s, src.index + (s if src.rpt else 0)) for s in range(last + 1)]
  # same type, same width on both sides: convert + to_bits give back the source bits
  plain = st == dt and shalf == dhalf and st in (("f16", "u16", "s16", "b16") if shalf else ("f32", "u32", "s32", "b32"))

  def run(b, mask):
    L = b.L
    for d, si in pairs:
      row = L.hrow(si) if shalf else L.full[si]
      if plain:
        _store(L, d, dhalf, row, mask)
      else:
        _store_res(L, d, dhalf, alu.convert(row, st, dt, shalf), mask)
  return run


def mov_const_bits(ins: Instr, dhalf: bool) -> Any:
  """The destination bits a mov/cov of an immediate writes (the same every repetition), as _cat1 computes them."""
  st, dt = ins.types
  src = ins.srcs[0]
  if src.kind == "fimm":
    fv = np.float32(src.fval) if st == "f32" else np.float16(src.fval)
    res: Any = fv.astype(alu.NP_TYPES[dt]) if dt != st else fv
  else:
    res = alu.convert(np.uint32(src.index & 0xffffffff), st, dt, False)
  return alu.to_bits(res, dhalf)


def _isam(ins: Instr) -> Handler | None:
  if ins.op != "isam" or any(m in ("3d", "a", "o", "p", "s2en") or m.startswith("base") for m in ins.extra["mods"]):
    return None
  dst, coord = ins.dst[0], ins.srcs[0]
  if not _reg_ok(coord, 1) or coord.half or dst.kind != "r":
    return None
  tex = next((o.index for o in ins.srcs if o.kind == "tex"), None)
  if tex is None:
    return None
  cx = coord.index
  comps = [c for c in range(4) if ins.extra["wrmask"] >> c & 1]
  if dst.index + len(comps) - 1 >= REG_A0:
    return None
  dhalf, d0 = dst.half, dst.index

  def run(b, mask):
    L = b.L
    texels = b.images.gather(tex, L.full[cx].view(np.int32), L.full[cx + 1].view(np.int32))   # (n, 4), image dtype
    if mask is None and not dhalf:
      L.f32[d0:d0 + len(comps)] = texels[:, comps].T if comps != [0, 1, 2, 3] else texels.T
    else:
      for k, c in enumerate(comps):
        _store(L, d0 + k, dhalf, alu.to_bits(texels[:, c].astype(np.float32), dhalf), mask)
    b.counts.tex += b.active
  return run


def _stib(ins: Instr, generic: Callable) -> Handler | None:
  """Typed 2D image store over every lane, all inside the image; otherwise (and for any fault) the generic path."""
  x = ins.extra
  if "bindless" in x or not x.get("typed") or x.get("dim") != "2d" or x.get("slot_mode") != "imm" or len(ins.srcs) != 3:
    return None
  vo, co, so = ins.srcs
  if not (_reg_ok(co, 1) and not co.half and _reg_ok(vo, ins.count - 1)):
    return None
  cx, v0, vhalf, count, slot = co.index, vo.index, vo.half, ins.count, so.index

  def stib(b, mask):
    if mask is not None:
      return generic(b, ins, mask)
    L = b.L
    x, y = L.full[cx].view(np.int32), L.full[cx + 1].view(np.int32)
    comps = [L.hrow(v0 + c).view(np.float16).astype(np.float32) if vhalf else L.f32[v0 + c] for c in range(count)]
    if (nbytes := b.images.store_all(slot, x, y, comps)) is None:
      return generic(b, ins, mask)
    b.counts.mem_store += nbytes
  return stib


def _global(ins: Instr, generic: Callable) -> Handler | None:
  """ldg/stg over every lane of the batch (no mask) with all addresses in one BO; otherwise the generic path, which
  also owns every fault (the fast path only proceeds where the generic one could not fault, in the same order)."""
  memop = ins.srcs[0]
  base = memop.base
  tp = ins.types[0] if ins.types else ""
  if base is None or not _reg_ok(base, 1) or base.half or tp not in MEM_BYTES:
    return None
  size = MEM_BYTES[tp]
  count = ins.count
  nbytes = size * count
  bi, off = base.index, np.uint64(memop.offset & 0xffffffffffffffff)
  sh = np.uint64(32)

  def address(L):
    return (L.full[bi].astype(np.uint64) | (L.full[bi + 1].astype(np.uint64) << sh)) + off

  if ins.op == "ldg":
    dst = ins.dst[0]
    if not _reg_ok(dst, count - 1):
      return None
    dhalf, d0 = dst.half, dst.index
    ld_unit = np.uint32 if size == 4 and not dhalf else np.uint16 if size == 2 and dhalf else None

    def ldg(b, mask):
      hit = None if mask is not None else b.gmem.single(address(b.L), nbytes, "ldg address")
      if hit is None:
        return generic(b, ins, mask)
      L = b.L
      arr, offs = hit
      if ld_unit is not None and (not dhalf or not L.merged) and arr.size % size == 0 and not (offs & (size - 1)).any():
        # whole units straight into the rows: from_bytes keeps a 4-byte load's bits, and a 2-byte one's low 16 bits are
        # all a half row keeps (s16 included); load_bytes + from_bytes would gather the same units, then copy them twice
        units, w = arr.view(ld_unit), offs >> (size >> 1)
        b.counts.mem_load += b.n * nbytes
        for c in range(count):
          np.take(units, w + c if c else w, out=L.hrow(d0 + c) if dhalf else L.full[d0 + c], mode="clip")   # in bounds: single() checked
        return
      raw = load_bytes(arr, offs, nbytes)
      b.counts.mem_load += raw.size
      for c in range(count):
        val = from_bytes(raw[:, c * size:(c + 1) * size], tp)
        row = L.hrow(d0 + c) if dhalf else L.full[d0 + c]
        if val.dtype != row.dtype:   # as the generic path: through a zeroed row of the register's width
          full = np.zeros(b.n, row.dtype)
          full[...] = val
          val = full
        row[...] = val
    return ldg
  if len(ins.srcs) < 2:
    return None
  src = ins.srcs[1]
  consecutive = src.kind in ("r", "c")
  st_unit = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
  src_rows = [src.index + c for c in range(count)] if count and src.kind == "r" and _reg_ok(src, count - 1) else None

  def stg(b, mask):
    if mask is not None:
      return generic(b, ins, mask)
    L = b.L
    addr = address(L)
    if src_rows is not None:
      # each lane's components side by side in the memory type: the bytes to_bytes + concatenate make, in one array
      units = np.empty((b.n, count), st_unit)
      for c, r in enumerate(src_rows):
        units[:, c] = L.hrow(r) if src.half else L.full[r]
      data = units.view(np.uint8)
    else:
      cols = [to_bytes(np.broadcast_to(L.read(src, c, src.half, consecutive=consecutive), (b.n,)), tp) for c in range(count)]
      data = np.concatenate(cols, axis=1) if cols else np.zeros((0, 0), np.uint8)
    b.counts.mem_store += data.size   # counted before the BO lookup, which may fault, as the generic path does
    hit = b.gmem.single(addr, data.shape[1], "stg address") if data.shape[0] == b.n else None
    if hit is None:
      b.counts.mem_store -= data.size
      return generic(b, ins, mask)
    arr, offs = hit
    if src_rows is not None and size > 1 and arr.size % size == 0 and not (offs & (size - 1)).any():
      # aligned whole units: the bytes store_bytes would write, in the same lane-major order (the last lane wins)
      w = offs >> (size >> 1)
      arr.view(st_unit)[w if count == 1 else w[:, None] + np.arange(count)] = units[:, 0] if count == 1 else units
      return
    store_bytes(arr, offs, data)
  return stg
