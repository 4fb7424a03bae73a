"""Level B: runs one CP_EXEC_CS dispatch of IR3 machine code over all its fibers (SIMT, vectorised with numpy).

Every fiber of a batch of whole workgroups is one lane of a numpy vector; an instruction runs across all the lanes
that are at its PC at once. Control flow is per lane: each lane has a PC, the lowest PC among live lanes runs next
(divergent branches and loops reconverge by themselves), and predicated blocks (predt/predf/prede) narrow the mask.
Barriers are met by construction: a lane that reaches one waits until every lane below it has caught up.

Registers: a full file (r0.x..r63.w, with r48 holding the workgroup id) and a half file. With SP_CS_CNTL_0.MERGEDREGS
the half file aliases the full one as the a6xx documents (hrN.c is the low/high 16 bits of full scalar (N*4+c)/2);
tinygrad leaves it off, so the files are separate. Memory: global through the GEM objects by IOVA (`Memory.region`,
which faults on unmapped or, in strict mode, unlisted BOs), shared per workgroup, private per fiber.
"""
from __future__ import annotations

import dataclasses
import functools
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinygrad.runtime.autogen import mesa

from backend.emu.executor import Dispatch, GpuFault
from backend.emu.ir3 import alu, native
from backend.emu.ir3.compiled import compile_instr
from backend.emu.ir3.decode import REG_A0, DecodeError, Instr, Operand, Program, decode
from backend.emu.ir3.memory import MEM_BYTES, GlobalMemory, Images, from_bytes, load_bytes, merged, store_bytes, to_bytes
from backend.emu.pm4 import field as _field

NREGS = 64 * 4
DEFAULT_BATCH = 1 << 14   # fibers run together (whole workgroups); bounds the register file to ~16 MiB


class ShaderFault(GpuFault):
  """A fault or an unimplemented instruction while executing a kernel: names the kernel and the instruction."""


@dataclass
class Counts:
  """Dynamic work of one dispatch, per fiber-instruction: what the timeline's cost model is fed."""
  fibers: int = 0
  instrs: int = 0          # fiber-instructions, all categories
  alu: int = 0             # cat1-3
  sfu: int = 0             # cat4
  tex: int = 0             # cat5 texel fetches (per component group)
  mem_load: int = 0        # bytes read by cat6
  mem_store: int = 0       # bytes written by cat6
  seconds: float = 0.0
  read: frozenset[tuple[int, int]] = frozenset()      # address ranges [lo, hi) the dispatch read, for the ordering check
  written: frozenset[tuple[int, int]] = frozenset()   # and wrote (a UAV's whole image counts as written)
  by_category: dict[int, int] = field(default_factory=dict)

  def add(self, other: Counts) -> None:
    for k in ("fibers", "instrs", "alu", "sfu", "tex", "mem_load", "mem_store", "seconds"):
      setattr(self, k, getattr(self, k) + getattr(other, k))
    for c, v in other.by_category.items():
      self.by_category[c] = self.by_category.get(c, 0) + v


class Lanes:
  """Register state of one batch of fibers."""

  def __init__(self, n: int, merged: bool, consts: np.ndarray, rows: int = NREGS):
    self.n = n
    # only the rows a program can reach are allocated: clearing all 256 rows of 16k lanes was most of a batch's setup
    self.full = np.zeros((rows, n), np.uint32)
    self.half = self.full.view(np.uint16).reshape(rows, n, 2) if merged else np.zeros((rows, n), np.uint16)
    self.f32, self.i32 = self.full.view(np.float32), self.full.view(np.int32)   # typed rows for the compiled fast paths
    self.memo: dict[int, Any] = {}   # compiled const operands, typed once per batch
    self.merged = merged
    self.pred = np.zeros((4, n), np.bool_)
    self.consts = consts

  # made on first use: only programs with a0-relative operands need them, and a Lanes is made for every batch
  @functools.cached_property
  def a0(self) -> np.ndarray:
    """a0.x per lane (mova): the scalar index relative operands add to their offset."""
    return np.zeros(self.n, np.int64)

  @functools.cached_property
  def lanes(self) -> np.ndarray:
    return np.arange(self.n)

  def hrow(self, h: int) -> np.ndarray:
    return self.half[h >> 1, :, h & 1] if self.merged else self.half[h]

  def read(self, o: Operand, step: int, half_ctx: bool, consecutive: bool = False, kind: str = "u") -> Any:
    """Raw bits of an operand for iteration `step` of a (rptN) instruction (or component `step` of a vector operand when
    `consecutive`); a scalar (0-d) for consts/immediates. A half read of the (32-bit) const file is demoted as
    SP_MODE_CNTL.CONSTANT_DEMOTION_ENABLE (set by tinygrad's QCOM runtime) asks: fp32 -> fp16 for float ops, else the low 16 bits."""
    k = o.kind
    idx = o.index + (step if (o.rpt or consecutive) else 0)
    if k == "r":
      if idx >= REG_A0:
        raise alu.Unimplemented(f"reading special register {o.render()}")
      return self.hrow(idx) if o.half else self.full[idx]
    if k == "c":
      v = self.consts[idx]
      if not o.half:
        return v
      return np.float32(v.view(np.float32)).astype(np.float16).view(np.uint16) if kind == "f" else np.uint16(v & 0xffff)
    if k == "imm":
      return np.uint16(o.index & 0xffff) if (half_ctx or o.half) else np.uint32(o.index & 0xffffffff)
    if k == "fimm":
      return (np.float16(o.fval).view(np.uint16) if (half_ctx or o.half) else np.float32(o.fval).view(np.uint32))
    if k == "p":
      return self.pred[o.index].astype(np.uint32)
    if k == "rel":
      return self._relative(o, step if (o.rpt or consecutive) else 0)
    raise alu.Unimplemented(f"operand {o.render()}")

  def _rel_index(self, o: Operand, step: int) -> np.ndarray:
    """Per-lane scalar index of an a0-relative operand; outside its file (the general registers below a0 = r61.x, or the
    1024 consts) is a fault: the hardware would reach some other state there, which no program of ours intends."""
    idx = self.a0 + (o.offset + step)
    if o.half and o.space != "r":
      raise alu.Unimplemented(f"half relative const {o.render()}")
    rows = self.full.shape[0] * (2 if o.half and self.merged else 1)   # a merged half file is the full file's halves
    top = min(REG_A0, rows) if o.space == "r" else len(self.consts)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= top):
      bad = int(idx.max()) if int(idx.max()) >= 0 else int(idx.min())
      raise GpuFault(f"relative operand {o.render()} reaches scalar {bad}, outside the {'register' if o.space == 'r' else 'const'} file")
    return idx

  def _relative(self, o: Operand, step: int) -> np.ndarray:
    idx = self._rel_index(o, step)
    if o.space == "c":
      return self.consts[idx]
    if not o.half:
      return self.full[idx, self.lanes]
    return self.half[idx >> 1, self.lanes, idx & 1] if self.merged else self.half[idx, self.lanes]

  def write(self, o: Operand, step: int, bits, mask: np.ndarray | None) -> None:
    idx = o.index + step
    if o.kind == "rel" and o.space == "r":
      sel = self.lanes if mask is None else np.flatnonzero(mask)
      ridx = self._rel_index(o, step)[sel]
      v = np.broadcast_to(np.asarray(bits).astype(np.uint16 if o.half else np.uint32, casting="unsafe"), (self.n,))[sel]
      if not o.half:
        self.full[ridx, sel] = v
      elif self.merged:
        self.half[ridx >> 1, sel, ridx & 1] = v
      else:
        self.half[ridx, sel] = v
      return
    if o.kind == "p":
      row = self.pred[idx]
      bits = np.asarray(bits) != 0
    elif o.kind != "r" or idx >= REG_A0:
      raise alu.Unimplemented(f"writing {o.render()}")
    else:
      row = self.hrow(idx) if o.half else self.full[idx]
      bits = np.asarray(bits, row.dtype) if np.asarray(bits).dtype != row.dtype else bits
    if mask is None:
      row[...] = bits
    else:
      np.copyto(row, bits, where=mask, casting="unsafe")


class Batch:
  """One batch of whole workgroups through the program."""

  def __init__(self, prog: Program, d: Dispatch, consts: np.ndarray, gmem: GlobalMemory, images: Images, wg_ids: np.ndarray,
               counts: Counts, kernel: str):
    lx, ly, lz = d.local_size
    wsize = lx * ly * lz
    nwg = len(wg_ids)
    self.n = n = nwg * wsize
    self.prog, self.gmem, self.images, self.counts, self.kernel = prog, gmem, images, counts, kernel
    self.ubos = d.ubos
    self.active = n   # lanes the current instruction runs on
    cntl0 = d.regs.get(mesa.REG_A6XX_SP_CS_CNTL_0, 0)
    cfg = d.regs.get(mesa.REG_A6XX_SP_CS_CONST_CONFIG_0, 0xfcfcfcfc)
    lid_reg, wgid_reg = _field(cfg, "A6XX_SP_CS_CONST_CONFIG_0_LOCALIDREGID"), _field(cfg, "A6XX_SP_CS_CONST_CONFIG_0_WGIDCONSTID")
    if (rows := _ROWS.get(prog.digest)) is None:
      rows = _ROWS[prog.digest] = _rows_used(prog)
    rows = max([rows] + [r + 3 for r in (lid_reg, wgid_reg) if r != 0xfc])
    self.L = L = Lanes(n, bool(cntl0 & mesa.A6XX_SP_CS_CNTL_0_MERGEDREGS), consts, min(NREGS, rows))
    local = np.arange(wsize, dtype=np.uint32)
    lid = (local % lx, (local // lx) % ly, local // (lx * ly))
    for c in range(3):
      if lid_reg != 0xfc:
        L.full[lid_reg + c] = np.tile(lid[c], nwg)
      if wgid_reg != 0xfc:
        L.full[wgid_reg + c] = np.repeat(wg_ids[:, c].astype(np.uint32), wsize)
    cntl1 = d.regs.get(mesa.REG_A6XX_SP_CS_CNTL_1, 0)
    self.shared_bytes = (_field(cntl1, "A6XX_SP_CS_CNTL_1_SHARED_SIZE") + 1) * 1024
    self.nwg = nwg
    self._shared: np.ndarray | None = None
    self.lane_wg = np.repeat(np.arange(nwg, dtype=np.int64), wsize)
    pvt = d.regs.get(mesa.REG_A6XX_SP_CS_PVT_MEM_PARAM, 0)
    self.pvt_bytes = _field(pvt, "A6XX_SP_CS_PVT_MEM_PARAM_MEMSIZEPERITEM") * 512
    self._private: np.ndarray | None = None
    self.lane_ids = np.arange(n, dtype=np.int64)

  # shared and private memory are made on first use: most kernels have neither, and clearing a batch's worth of them
  # (up to 32 KiB per workgroup) cost more than many whole dispatches
  @property
  def shared(self) -> np.ndarray:
    if self._shared is None:
      self._shared = np.zeros(self.nwg * self.shared_bytes, np.uint8)
    return self._shared

  @property
  def private(self) -> np.ndarray:
    if self._private is None:
      self._private = np.zeros(self.n * self.pvt_bytes, np.uint8) if self.pvt_bytes else np.zeros(0, np.uint8)
    return self._private

  # *** the SIMT loop ***

  def run(self) -> None:
    prog, n = self.prog, self.n
    alive = np.ones(n, np.bool_)
    all_alive = True                    # no lane has ended yet: uniform instructions need no mask
    pcs: np.ndarray | None = None       # per-lane PCs, only while lanes diverge
    pc = 0
    pred_stack: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []   # (lanes at predt, p0.x at predt, lanes enabled now)
    handlers, blocks = _handlers(prog)
    instrs, nprog = prog.instrs, len(prog)
    counts, by_category = self.counts, self.counts.by_category
    while True:
      if pcs is None:
        at = None if all_alive else alive
      else:
        live = pcs[alive]
        if live.size == 0:
          return
        pc = int(live.min())
        at = alive & (pcs == pc)
        if at.sum() == live.size:      # every live lane is here again: back to one PC
          pcs, at = None, (None if all_alive else alive)
      if pc >= nprog:
        raise self.fault(nprog - 1, "ran past the end of the program (no 'end')")
      ins = instrs[pc]
      mask = at
      if pred_stack:
        mask = pred_stack[-1][2] if mask is None else (mask & pred_stack[-1][2])
      if pcs is None and handlers[pc] is not None:
        # one PC for all lanes and no flow instruction up to the block's end: the mask holds for the whole block
        if (blk := blocks.get(pc)) is None:
          blk = blocks[pc] = _block(prog, handlers, pc)
        hs, work, cat_work, end = blk
        self.active = active = n if mask is None else int(np.count_nonzero(mask))
        counts.instrs += active * work
        for c, w in cat_work:
          by_category[c] = by_category.get(c, 0) + active * w
        try:
          for h, closures in hs:
            if not closures:
              h(self, mask)
              pc += 1
            elif h(self, mask):   # a native run of len(closures) instructions
              pc += len(closures)
            else:                 # it could not run here: its instructions one by one, so a fault names the right one
              for c in closures:
                c(self, mask)
                pc += 1
        except ShaderFault:
          raise
        except (alu.Unimplemented, GpuFault) as e:
          raise self._fault_from(pc, e) from None
        continue
      cat = ins.cat
      nxt = pc + 1
      self.active = active = n if mask is None else int(np.count_nonzero(mask))
      work = active * (ins.repeat + 1)
      counts.instrs += work
      by_category[cat] = by_category.get(cat, 0) + work
      try:
        if cat == 0 or cat == 7:
          op = ins.op
          if op == "end":
            if at is None:
              return
            alive &= ~at
            all_alive = False
            if not alive.any():
              return
          elif op == "nop" or op.startswith(("bar", "fence")):
            pass   # lanes run in lockstep and memory is coherent: a barrier is met when every lower-PC lane has caught up
          elif op == "jump":
            nxt = ins.target  # type: ignore[assignment]
          elif op in ("br", "brao", "braa"):
            cond = self._branch_cond(ins)
            taken = cond if mask is None else (cond & mask)
            sel = mask if mask is not None else np.ones(n, np.bool_)
            n_taken, n_sel = int(np.count_nonzero(taken)), int(np.count_nonzero(sel))
            if n_taken == n_sel:
              nxt = ins.target  # type: ignore[assignment]
            elif n_taken:
              if pcs is None:
                pcs = np.full(n, pc, np.int64)
              pcs[sel] = pc + 1
              pcs[taken] = ins.target
              continue
          elif op == "predt":
            entry = np.ones(n, np.bool_) if mask is None else mask.copy()
            cond = self.L.pred[0].copy()
            pred_stack.append((entry, cond, entry & cond))
          elif op == "predf":
            if not pred_stack:
              raise alu.Unimplemented("predf without predt")
            entry, cond, _ = pred_stack.pop()
            pred_stack.append((entry, cond, entry & ~cond))
          elif op == "prede":
            if not pred_stack:
              raise alu.Unimplemented("prede without predt")
            pred_stack.pop()
          else:
            raise alu.Unimplemented(f"flow instruction '{op}'")
        else:
          handlers[pc](self, mask)  # type: ignore[misc]
      except ShaderFault:
        raise
      except (alu.Unimplemented, GpuFault) as e:
        raise self._fault_from(pc, e) from None
      if pcs is None:
        pc = nxt
      else:
        pcs[at] = nxt

  def _fault_from(self, pc: int, e: alu.Unimplemented | GpuFault) -> ShaderFault:
    if isinstance(e, alu.Unimplemented):
      return self.fault(pc, f"not implemented: {e}")
    f = self.fault(pc, str(e))
    f.page = e.page   # still a page fault, now naming the kernel
    return f

  def fault(self, pc: int, msg: str) -> ShaderFault:
    return ShaderFault(f"kernel {self.kernel}: instruction {pc} '{self.prog.instrs[pc].text}': {msg}\n{self.prog.listing(pc, 3)}")

  def _branch_cond(self, ins: Instr) -> np.ndarray:
    conds = [self.L.pred[o.index] ^ o.invert for o in ins.srcs if o.kind == "p"]
    if ins.op == "br":
      if not conds:
        raise alu.Unimplemented("br without a predicate")
      return conds[0]
    return (conds[0] | conds[1]) if ins.op == "brao" else (conds[0] & conds[1])


# *** per-category handlers (chosen once per instruction, cached per program) ***

def _op_half(ins: Instr) -> bool:
  """Width an ALU op works at: each register source is read from its own file (a 32-bit source of a 16-bit result is used
  whole, e.g. 'shr.b hr2.z, r3.y, 16'); consts and immediates take the width of the register sources, or the destination's
  when there are none. The result is narrowed or widened to the destination."""
  regs = [o.half for o in ins.srcs if o.kind == "r"]
  return all(regs) if regs else (ins.dst[0].half and ins.dst[0].kind == "r")


def _typed(L: Lanes, o: Operand, step: int, half: bool, kind: str) -> np.ndarray:
  v = alu.bits_as(L.read(o, step, half, kind=kind), half, kind)
  if o.abs:
    v = np.abs(v)
  if o.neg:
    v = -v
  return v


def _cat1(b: Batch, ins: Instr, mask) -> None:
  L = b.L
  st, dt = ins.types
  if ins.op == "swz":
    vals = [np.array(L.read(s, 0, s.half), copy=True) for s in ins.srcs]   # a swap: read both before writing either
    for dst, v in zip(ins.dst, vals):
      L.write(dst, 0, v, mask)
    return
  if ins.op == "mova":
    if ins.dst[0].kind != "a" or ins.dst[0].index != 0:
      raise alu.Unimplemented(f"mova to {ins.dst[0].render()}")
    v = np.broadcast_to(L.read(ins.srcs[0], 0, True), (b.n,)).astype(np.uint16).view(np.int16)   # a0.x is 16-bit signed
    if mask is None:
      L.a0[:] = v
    else:
      np.copyto(L.a0, v, where=mask)
    return
  if ins.op not in ("mov", "cov"):
    raise alu.Unimplemented(f"cat1 '{ins.op}'")
  dst, src = ins.dst[0], ins.srcs[0]
  for s in range(ins.repeat + 1):
    res: Any
    if src.kind == "fimm":
      fv = np.float32(src.fval) if st == "f32" else np.float16(src.fval)
      res = fv.astype(alu.NP_TYPES[dt]) if dt != st else fv
    elif src.kind == "imm":
      res = alu.convert(np.uint32(src.index & 0xffffffff), st, dt, False)
    else:
      res = alu.convert(L.read(src, s, src.half), st, dt, src.half)
    L.write(dst, s, alu.to_bits(res, dst.half), mask)


def _cat2(b: Batch, ins: Instr, mask) -> None:
  op = ins.op
  kind = alu.CMPS.get(op) or (alu.CAT2[op][0] if op in alu.CAT2 else None)
  if kind is None:
    raise alu.Unimplemented(f"cat2 '{op}'")
  _alu_repeats(b.L, ins, kind, lambda *srcs: alu.cat2(op, ins.cond, list(srcs)), mask)


def _cat3(b: Batch, ins: Instr, mask) -> None:
  if ins.op not in alu.CAT3:
    raise alu.Unimplemented(f"cat3 '{ins.op}'")
  kind, fn = alu.CAT3[ins.op]
  _alu_repeats(b.L, ins, kind, fn, mask)


def _alu_repeats(L, ins: Instr, kind: str, fn, mask) -> None:
  """cat2/cat3: each (rpt) repetition reads its sources typed as `kind`, computes, saturates floats under (sat), writes."""
  dst, half = ins.dst[0], _op_half(ins)
  for s in range(ins.repeat + 1):
    res = fn(*[_typed(L, o, s, o.half if o.kind == "r" else half, kind) for o in ins.srcs])
    if "sat" in ins.flags and kind == "f":
      res = np.clip(res, 0, 1)
    L.write(dst, s, alu.to_bits(res, dst.half), mask)


def _cat4(b: Batch, ins: Instr, mask) -> None:
  L = b.L
  if ins.op not in alu.CAT4:
    raise alu.Unimplemented(f"cat4 '{ins.op}'")
  dst, src = ins.dst[0], ins.srcs[0]
  for s in range(ins.repeat + 1):
    v = _typed(L, src, s, src.half, "f").astype(np.float32)
    L.write(dst, s, alu.to_bits(alu.CAT4[ins.op](v), dst.half), mask)
    b.counts.sfu += b.active


def _coords(L: Lanes, coord: Operand, n: int) -> list[np.ndarray]:
  """The integer texel coordinates of an image access: `n` consecutive full registers from `coord` (x, y, then the
  slice of a 3D image or the layer of a 2D array)."""
  if coord.kind != "r" or coord.half or coord.index + n > REG_A0:
    raise alu.Unimplemented(f"image coordinates in {coord.render()}")
  return [L.full[coord.index + k].view(np.int32) for k in range(n)]


def _cat5(b: Batch, ins: Instr, mask) -> None:
  mods = ins.extra["mods"]
  if ins.op not in ("isam",) or any(m in mods for m in ("o", "p", "s2en")) or ("3d" in mods and "a" in mods):
    raise alu.Unimplemented(f"texture instruction '{ins.name}'")
  dset = next((int(m[4:]) for m in mods if m.startswith("base") and m[4:].isdigit()), None)   # bindless: 'isam.base0'
  if any(m.startswith("base") for m in mods) and dset is None:
    raise alu.Unimplemented(f"texture instruction '{ins.name}'")
  L = b.L
  dst, coord = ins.dst[0], ins.srcs[0]
  tex = next(o.index for o in ins.srcs if o.kind == "tex")
  layered = "3d" in mods or "a" in mods
  x, y, *z = _coords(L, coord, 3 if layered else 2)
  texels = b.images.fetch(tex, x, y, mask, z[0] if z else None, dset)   # (4, n) float32
  comp = 0
  for c in range(4):
    if ins.extra["wrmask"] >> c & 1:
      L.write(dst, comp, alu.to_bits(texels[c], dst.half), mask)   # rounded to the destination's precision
      comp += 1
  b.counts.tex += b.active


def _address(L: Lanes, o: Operand) -> np.ndarray:
  lo = L.read(o.base, 0, False).astype(np.uint64)  # type: ignore[arg-type]
  hi = L.read(Operand("r", o.base.index + 1), 0, False).astype(np.uint64)  # type: ignore[union-attr]
  return (lo | (hi << np.uint64(32))) + np.uint64(o.offset & 0xffffffffffffffff)


def _local(b: Batch, shared: bool, memop: Operand, sel: np.ndarray, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
  """(the batch's shared or private bytes, each selected lane's byte address in them) of an l[...]/p[...] operand; an
  access of `nbytes` outside the lane's window faults."""
  base = b.L.read(memop.base, 0, False).astype(np.int64)  # type: ignore[arg-type]
  off = (np.broadcast_to(base, (b.n,))[sel] + memop.offset).astype(np.int64)
  if shared:
    buf, limit, lane_base = b.shared, b.shared_bytes, b.lane_wg[sel] * b.shared_bytes
  else:
    buf, limit, lane_base = b.private, b.pvt_bytes, b.lane_ids[sel] * b.pvt_bytes
  if off.size and (off.min() < 0 or off.max() + nbytes > limit):
    where = "shared" if shared else "private"
    raise GpuFault(f"{where} memory access at offset {int(off.max())} + {nbytes} bytes outside the {limit}-byte {where} window")
  return buf, lane_base + off


def _cat6(b: Batch, ins: Instr, mask) -> None:
  L = b.L
  op = ins.op
  sel = np.ones(b.n, np.bool_) if mask is None else mask
  if op in ("ldg", "stg", "ldl", "stl", "ldp", "stp"):
    tp = ins.types[0]
    size = MEM_BYTES[tp]
    memop = ins.srcs[0]
    if op in ("ldg", "stg"):
      addr = _address(L, memop)[sel]
      loader, storer = b.gmem.load, b.gmem.store
    else:
      buf, addr = _local(b, op in ("ldl", "stl"), memop, sel, size * ins.count)

      def loader(a, nbytes, _buf=buf):
        return load_bytes(_buf, a, nbytes)

      def storer(a, data, _buf=buf):
        store_bytes(_buf, a, data)
    # local/private forms carry no TYPE_HALF bit: an 8/16-bit type names a half register although Mesa prints it as full
    implied_half = op in ("ldl", "stl", "ldp", "stp") and size < 4
    if op.startswith("ld"):
      dst = ins.dst[0] if not implied_half else dataclasses.replace(ins.dst[0], half=True)
      raw = loader(addr, size * ins.count)          # (count*size) bytes per lane, uint8 (m, count*size)
      b.counts.mem_load += raw.size
      for c in range(ins.count):
        chunk = raw[:, c * size:(c + 1) * size]
        val = from_bytes(chunk, tp)
        full = np.zeros(b.n, np.uint16 if dst.half else np.uint32)
        full[sel] = val
        L.write(dst, c, full, mask)
    else:
      src = ins.srcs[1] if not implied_half or ins.srcs[1].kind != "r" else dataclasses.replace(ins.srcs[1], half=True)
      cols = []
      for c in range(ins.count):
        bits = np.broadcast_to(L.read(src, c, src.half, consecutive=src.kind in ("r", "c")), (b.n,))[sel]
        cols.append(to_bytes(bits, tp))
      data = np.concatenate(cols, axis=1) if cols else np.zeros((0, 0), np.uint8)
      b.counts.mem_store += data.size
      storer(addr, data)
    return
  if op == "stib.b":
    vo, co, so = ins.srcs
    x, y, *z = _coords(L, co, _image_dims(ins))
    comps = [alu.bits_as(L.read(Operand("r", vo.index + c, vo.half), 0, vo.half), vo.half, "f").astype(np.float32)
             for c in range(ins.count)]
    b.counts.mem_store += b.images.store(so.index, x, y, comps, sel, z[0] if z else None, ins.extra.get("bindless"))
    return
  if op == "ldib.b":
    # typed image load through the UAV descriptor (what Mesa emits for an image read that may see this kernel's writes)
    co, so = ins.srcs
    x, y, *z = _coords(L, co, _image_dims(ins))
    texels = b.images.load(so.index, x, y, sel, z[0] if z else None, ins.extra.get("bindless"))
    dst = ins.dst[0]
    for c in range(ins.count):
      L.write(dst, c, alu.to_bits(texels[c], dst.half), mask)
    b.counts.mem_load += b.active * ins.count * (2 if dst.half else 4)
    return
  if op == "resinfo.b":
    if ins.extra.get("slot_mode") != "imm" or ins.srcs[0].kind != "imm":
      raise alu.Unimplemented(f"image size '{ins.name}'")
    # Mesa (ir3_a6xx.c): "resinfo has no writemask and always writes out 3 components"
    for c, v in enumerate(b.images.size(ins.srcs[0].index, ins.extra.get("bindless"))):
      L.write(ins.dst[0], c, np.uint32(v), mask)
    return
  if op in ("atomic.g", "atomic.l"):
    _atomic(b, ins, sel, mask)
    return
  if op == "ldc":
    _ldc(b, ins, sel, mask)
    return
  raise alu.Unimplemented(f"memory instruction '{ins.name}'")


def _ldc(b: Batch, ins: Instr, sel: np.ndarray, mask) -> None:
  """ldc: dwords of a UBO through its descriptor (loaded by CP_LOAD_STATE6 ST6_UBO); a vec4 past the descriptor's size
  is a fault here (what the hardware returns there is not documented)."""
  L = b.L
  vec4, slot = ins.srcs
  if ins.extra.get("slot_mode") != "imm" or slot.kind != "imm":
    raise alu.Unimplemented(f"ldc '{ins.name}' (UBO index not an immediate)")
  ubos = b.ubos
  if (slot.index + 1) * 8 > len(ubos):
    raise GpuFault(f"ldc reads UBO {slot.index}, but {len(ubos) // 8} UBO descriptors were loaded (tinygrad's QCOM runtime "
                   "loads none: its kernel arguments are pushed into the const file, which a UBO load Mesa did not push cannot see)")
  lo, hi = struct.unpack_from("<II", ubos, slot.index * 8)
  base, size = lo | (_field(hi, "A6XX_UBO_1_BASE_HI") << 32), _field(hi, "A6XX_UBO_1_SIZE")   # SIZE in vec4
  row = np.broadcast_to(L.read(vec4, 0, False), (b.n,))[sel].astype(np.int64)
  first = ins.extra["component"]
  if row.size and (row.max() >= size or first + ins.count > 4 * (size - row.max())):
    raise GpuFault(f"ldc reads vec4 {int(row.max())} (+{first + ins.count} dwords) of UBO {slot.index}, which holds {size} vec4")
  raw = b.gmem.load((base + row * 16 + first * 4).astype(np.uint64), 4 * ins.count)
  b.counts.mem_load += raw.size
  for c in range(ins.count):
    full = np.zeros(b.n, np.uint32)
    full[sel] = raw[:, c * 4:(c + 1) * 4].copy().view(np.uint32).reshape(-1)
    L.write(ins.dst[0], c, full, mask)


def _image_dims(ins: Instr) -> int:
  if not ins.extra.get("typed") or ins.extra.get("slot_mode") != "imm" or ins.extra.get("dim") not in ("2d", "3d"):
    raise alu.Unimplemented(f"image access '{ins.name}'")
  return 2 if ins.extra["dim"] == "2d" else 3


def _atomic(b: Batch, ins: Instr, sel: np.ndarray, mask) -> None:
  """atomic.g (global, 64-bit address pair) and the shared-memory form: each selected lane in turn reads the old value,
  combines and writes; the destination gets the old value. Lanes of one instruction are applied in lane order (the
  hardware's order among them is unspecified: only the end value of order-independent ops is fixed)."""
  L = b.L
  tp, fn = ins.types[0], ins.extra["atomic"]
  if tp not in ("u32", "s32") or fn not in alu.ATOMICS:
    raise alu.Unimplemented(f"atomic '{ins.name}'")
  where, val = ins.srcs
  lanes = np.flatnonzero(sel)
  if ins.op == "atomic.g":   # the address is the register pair itself
    words = [b.gmem.array(int(a), 4, "atomic address") for a in _address(L, Operand("mem", base=where))[lanes]]
  else:
    buf, addr = _local(b, True, where, sel, 4)
    words = [buf[int(a):int(a) + 4] for a in addr]
  v = np.broadcast_to(L.read(val, 0, False), (b.n,))
  v2 = np.broadcast_to(L.read(Operand("r", val.index + 1), 0, False), (b.n,)) if fn == "cmpxchg" else v
  signed = tp == "s32"
  old = np.zeros(b.n, np.uint32)
  for lane, word in zip(lanes, words):
    cell = word.view(np.uint32)
    old[lane] = cell[0]
    cell[0] = alu.ATOMICS[fn](np.uint32(cell[0]), np.uint32(v[lane]), np.uint32(v2[lane]), signed)
  L.write(ins.dst[0], 0, old, mask)
  b.counts.mem_load += 4 * len(lanes)
  b.counts.mem_store += 4 * len(lanes)


_CAT_HANDLERS: dict[int, Callable] = {1: _cat1, 2: _cat2, 3: _cat3, 4: _cat4, 5: _cat5, 6: _cat6}
Block = tuple[tuple[tuple[Callable, tuple], ...], int, tuple[tuple[int, int], ...], int]
_HANDLER_CACHE: dict[tuple[str, bool], tuple[list[Callable | None], dict[int, Block]]] = {}


def _handlers(prog: Program) -> tuple[list[Callable | None], dict[int, Block]]:
  """One closure (batch, mask) per instruction, built on the program's first dispatch (flow instructions get None), and
  the straight-line blocks found so far, by entry PC; kept apart for runs with and without the native path."""
  key = (prog.digest, native.enabled())
  if (h := _HANDLER_CACHE.get(key)) is None:
    h = _HANDLER_CACHE[key] = ([
      None if i.cat in (0, 7) else compile_instr(i, _CAT_HANDLERS.get(i.cat, _unknown), _op_half(i) if i.cat in (2, 3) else False)
      for i in prog.instrs], {})
  return h


_ROWS: dict[str, int] = {}


def _rows_used(prog: Program) -> int:
  """Register rows (full or half file) any instruction can touch: each register operand (memory bases included) plus
  the most its instruction steps past it ((rpt), consecutive components, isam's wrmask and y coordinate, an address's
  high word), with room to spare."""
  top = 0
  if any(o.kind == "rel" and o.space == "r" for i in prog.instrs for o in (*i.dst, *i.srcs)):
    return NREGS   # a relative operand can reach any row of the file
  for i in prog.instrs:
    span = max(i.repeat, i.count, 4) + 1
    for o in (*i.dst, *i.srcs):
      r = o.base if o.kind == "mem" else o
      if r is not None and r.kind == "r":
        top = max(top, r.index + span)
  return top + 4


def _block(prog: Program, handlers: list[Callable | None], pc: int) -> Block:
  """The instructions from pc up to the next flow instruction (or the end): their steps (a closure, or a native run with
  the closures of its instructions: native.plan), fiber-instructions per lane in all and per category (in order of first
  appearance, as the per-instruction count would insert them), the next PC."""
  end = pc
  while end < len(handlers) and handlers[end] is not None:
    end += 1
  per_cat: dict[int, int] = {}
  for i in prog.instrs[pc:end]:
    per_cat[i.cat] = per_cat.get(i.cat, 0) + i.repeat + 1
  hs: list[Callable] = [h for h in handlers[pc:end] if h is not None]   # none is: the block stops at the first flow instruction
  steps: list[tuple[Callable, tuple]] = native.plan(prog.instrs[pc:end], hs, _op_half) if native.enabled() else [(h, ()) for h in hs]
  return tuple(steps), sum(per_cat.values()), tuple(per_cat.items()), end


def _unknown(b: Batch, ins: Instr, mask) -> None:
  raise alu.Unimplemented(f"category {ins.cat} instruction '{ins.name}'")


# *** one dispatch ***

def run_dispatch(d: Dispatch, mem, kernel: str = "", batch: int = DEFAULT_BATCH) -> Counts:
  """Executes a recorded dispatch against the job's memory; raises ShaderFault (a GpuFault) naming kernel and instruction."""
  t0 = time.perf_counter()
  try:
    prog = decode(d.shader)
  except DecodeError as e:
    raise ShaderFault(f"kernel {kernel or hex(d.shader_iova)}: {e}") from None
  kernel = kernel or f"shader@{d.shader_iova:#x} ({prog.digest})"
  consts = np.frombuffer(d.consts.ljust(4096, b"\0")[:4096], np.uint32).copy()
  gmem = GlobalMemory(mem)
  images = Images(d, gmem)
  gx, gy, gz = d.groups
  wsize = int(np.prod(d.local_size))
  wg = np.stack(np.meshgrid(np.arange(gx), np.arange(gy), np.arange(gz), indexing="ij"), -1).transpose(2, 1, 0, 3).reshape(-1, 3)
  per = max(1, batch // max(1, wsize))
  counts = Counts(fibers=len(wg) * wsize)
  with np.errstate(all="ignore"):
    for i in range(0, len(wg), per):
      Batch(prog, d, consts, gmem, images, wg[i:i + per], counts, kernel).run()
  counts.alu = sum(v for c, v in counts.by_category.items() if c in (1, 2, 3))
  counts.read, counts.written = merged(gmem.read), merged(gmem.written)
  counts.seconds = time.perf_counter() - t0
  return counts
