"""Executes decoded PM4 for one job at a time on the emulated ring: registers, memory effects, waits, dispatch records.

Level A: a compute dispatch is recorded with its full state (shader, constants, descriptors, sizes) and handed to
`on_dispatch`; it is not executed. Level B (`shader_exec`, backend/emu/ir3): the recorded dispatch is then executed
against the job's memory, in ring order, before the next packet.
"""
from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tinygrad.runtime.autogen import mesa

from backend.emu import pm4


class GpuFault(Exception):
  """What the GPU did wrong on this job; the node records it and retires the job (a hang: the queue's fault count rises)."""
  page = False   # an SMMU page fault: on the msm kernel it does not hang the GPU and is not counted (RenderNode fault_policy)


class PageFault(GpuFault):
  """An access the SMMU refuses (unmapped, freed, past a BO's end, or, strict, in a BO not listed in the submit)."""
  page = True


class Memory(Protocol):
  def view(self, iova: int, size: int, what: str) -> memoryview:
    ...   # raises GpuFault (unmapped, or not listed in strict mode)
  def check(self, iova: int, size: int, what: str) -> None:
    ...
  def region(self, iova: int, what: str) -> tuple[int, int, int]:
    ...   # (start iova, size, host address) of the BO holding iova; faults like view()


_FUNCS: dict[int, Callable[[int, int], bool]] = {
  mesa.WRITE_ALWAYS: lambda v, r: True, mesa.WRITE_LT: lambda v, r: v < r, mesa.WRITE_LE: lambda v, r: v <= r, mesa.WRITE_EQ: lambda v, r: v == r,
  mesa.WRITE_NE: lambda v, r: v != r, mesa.WRITE_GE: lambda v, r: v >= r, mesa.WRITE_GT: lambda v, r: v > r}
ALWAYS_ON_HZ = 19.2e6
CONST_WRITTEN_BYTES = 2048   # tinygrad fills the first 2 KiB of a kernel's constants; the rest of the 4 KiB window belongs to neighbours


def always_on_counter() -> int:
  return int(time.monotonic_ns() * ALWAYS_ON_HZ / 1e9)


@dataclass
class Dispatch:
  """Everything an IR3 interpreter needs to run one CP_EXEC_CS."""
  groups: tuple[int, int, int]
  local_size: tuple[int, int, int]
  shader_iova: int
  shader: bytes
  consts: bytes
  textures: bytes
  uavs: bytes
  samplers: bytes
  regs: dict[int, int]
  pvt_mem_iova: int
  ubos: bytes = b""      # UBO descriptors (ldc): tinygrad's runtime loads none, its arguments are pushed as consts


@dataclass
class Frame:
  iova: int
  dwords: int
  pos: int = 0


@dataclass
class ExecState:
  """Resumable position of a job: a stack of IB frames (INDIRECT_BUFFER pushes)."""
  frames: list[Frame]
  loads: dict[tuple[int, int], tuple[int, bytes]] = field(default_factory=dict)   # (block, type) -> (iova, bytes)
  # dispatches since the last CP_WAIT_FOR_IDLE, which the a630 may still be running: (kernel, ranges read, ranges written)
  in_flight: list[tuple[str, Ranges, Ranges]] = field(default_factory=list)


Ranges = frozenset[tuple[int, int]]   # [lo, hi) GPU addresses


def _common(a: Ranges, b: Ranges) -> int | None:
  """The lowest address in both, or None."""
  hits = [max(lo, lo2) for lo, hi in a for lo2, hi2 in b if lo < hi2 and lo2 < hi]
  return min(hits) if hits else None


def order_hazard(in_flight: list[tuple[str, Ranges, Ranges]], name: str, read: Ranges, written: Ranges) -> str | None:
  """What a dispatch issued without a wait for idle would race with: memory an unfinished dispatch writes that it reads or
  writes, or memory it writes that an unfinished dispatch reads. None when it races with nothing."""
  for other, o_read, o_written in in_flight:
    if (at := _common(read | written, o_written)) is not None:
      return f"{name} touches {at:#x}, which {other} writes, still running (no CP_WAIT_FOR_IDLE between them)"
    if (at := _common(written, o_read)) is not None:
      return f"{name} writes {at:#x}, which {other} reads, still running (no CP_WAIT_FOR_IDLE between them)"
  return None


def _cp_stalls(e: GpuFault) -> GpuFault:
  """A page fault on the CP's own fetch (its commands, an IB, a wait address): it cannot run past that, so the ring stalls
  and the kernel's hangcheck recovers it, a counted hang under either fault policy (unlike a packet's or a shader's access)."""
  if not e.page:
    return e
  return GpuFault(f"{e}; the CP cannot fetch past it (a hang)")


class Executor:
  def __init__(self, on_dispatch: Callable[[Dispatch], None], pointer_check: Callable[[bytes, str], None] | None = None,
               shader_exec: Callable[[Dispatch, Memory], Any] | None = None,
               on_page_fault: Callable[[GpuFault], None] | None = None):
    """on_page_fault: set, a page fault in a packet's effect (a memory write, a state load, a dispatch or its shader) is handed to
    it and the packet is abandoned while the job runs on, as the msm kernel lets the GPU resume after an SMMU fault that does
    not hang it; unset, the fault ends the job (raised from run())."""
    self.regs: dict[int, int] = {}
    self.on_dispatch, self.pointer_check, self.shader_exec = on_dispatch, pointer_check, shader_exec
    self.on_page_fault = on_page_fault
    self.on_order_hazard: Callable[[str], None] | None = None   # level B: a dispatch racing an unfinished one (order_hazard)
    self.kernel_names: dict[int, str] = {}   # shader IOVA -> kernel name, for the hazard's message

  def run(self, st: ExecState, mem: Memory) -> bool:
    """Runs until the job ends (True) or parks on an unmet CP_WAIT_REG_MEM (False). Raises GpuFault / pm4.PM4Error."""
    while st.frames:
      fr = st.frames[-1]
      if fr.pos >= fr.dwords:
        st.frames.pop()
        continue
      try:
        dw = mem.view(fr.iova, fr.dwords * 4, "command buffer").cast("I")
      except GpuFault as e:
        raise _cp_stalls(e) from None
      while fr.pos < fr.dwords:
        p = pm4.decode(dw, fr.pos)
        if p.kind == 4:
          for i, v in enumerate(p.payload):
            self.regs[p.code + i] = v
        elif p.code == mesa.CP_WAIT_REG_MEM:
          try:
            met = self._wait_met(pm4.wait_reg_mem(p), mem)
          except GpuFault as e:
            raise _cp_stalls(e) from None
          if not met:
            return False
        elif p.code == mesa.CP_INDIRECT_BUFFER:
          fr.pos += p.size
          ib, n = pm4.indirect_buffer(p)
          try:
            mem.check(ib, n * 4, "indirect buffer")
          except GpuFault as e:
            raise _cp_stalls(e) from None
          st.frames.append(Frame(ib, n))
          break
        else:
          try:
            self._execute(p, st, mem)
          except GpuFault as e:
            if not e.page or self.on_page_fault is None:
              raise
            # the access is dropped (here: the rest of this packet, e.g. the rest of a dispatch) and the ring runs on, so the
            # job's later packets (its signal writes) still happen: the fence retires and the CPU's wait returns
            self.on_page_fault(e)
        fr.pos += p.size
    return True

  def _wait_met(self, w: pm4.WaitRegMem, mem: Memory) -> bool:
    if not w.poll_memory:
      raise GpuFault("CP_WAIT_REG_MEM on a register is not emulated")
    if w.function not in _FUNCS:
      raise GpuFault(f"CP_WAIT_REG_MEM function {w.function} is not emulated")
    v = mem.view(w.addr, 4, "wait address").cast("I")[0]
    return _FUNCS[w.function](v & w.mask, w.ref)

  def _execute(self, p: pm4.Packet, st: ExecState, mem: Memory) -> None:
    if p.code == mesa.CP_WAIT_FOR_IDLE:
      st.in_flight.clear()
      return
    if p.code in (mesa.CP_WAIT_MEM_WRITES, mesa.CP_SET_MARKER, mesa.CP_NOP):
      return   # the emulated ring is always coherent
    if p.code == mesa.CP_EVENT_WRITE:
      ev = pm4.event_write(p)
      if ev.event == mesa.CACHE_FLUSH_TS and ev.addr is not None:
        mem.view(ev.addr, 4, "CACHE_FLUSH_TS address").cast("I")[0] = ev.value or 0   # a 32-bit write, even where the reader reads 64
    elif p.code == mesa.CP_REG_TO_MEM:
      r = pm4.reg_to_mem(p)
      n = r.cnt * 4 if r.cnt else 4
      vals = (always_on_counter(),) if r.reg == mesa.REG_A6XX_CP_ALWAYS_ON_COUNTER and r.is64 else None
      out = mem.view(r.addr, n, "REG_TO_MEM address")
      if vals is not None:
        out[:8] = struct.pack("<Q", vals[0])
      else:
        out[:] = struct.pack(f"<{n // 4}I", *(self.regs.get(r.reg + i, 0) for i in range(n // 4)))
    elif p.code == mesa.CP_MEM_WRITE:
      addr = pm4.addr64(p.payload[0], p.payload[1])
      n = len(p.payload) - 2
      mem.view(addr, 4 * n, "MEM_WRITE address")[:] = struct.pack(f"<{n}I", *p.payload[2:])
    elif p.code == mesa.CP_LOAD_STATE6_FRAG:
      ls = pm4.load_state6(p)
      nbytes = ls.num_unit * ls.unit_bytes
      if ls.addr is None:
        data = struct.pack(f"<{len(ls.inline)}I", *ls.inline)
      else:
        what = f"LOAD_STATE6 source (block {ls.state_block}, type {ls.state_type})"
        data = bytes(mem.view(ls.addr, nbytes, what))
      st.loads[(ls.state_block, ls.state_type)] = (ls.addr or 0, data)
    elif p.code == mesa.CP_EXEC_CS:
      self._dispatch(p, st, mem)
    elif p.code == mesa.CP_RUN_OPENCL:
      raise GpuFault("CP_RUN_OPENCL (Qualcomm CL binaries) is not emulated; use the IR3 renderer")
    else:
      raise GpuFault(f"{p.name} is decoded but not emulated")

  def _reg64(self, reg: int) -> int:
    return self.regs.get(reg, 0) | (self.regs.get(reg + 1, 0) << 32)

  def _dispatch(self, p: pm4.Packet, st: ExecState, mem: Memory) -> None:
    cfg = self.regs.get(mesa.REG_A6XX_SP_CS_CONFIG, 0)
    nsamp, ntex, nuav = (pm4.field(cfg, f"A6XX_SP_CS_CONFIG_{n}") for n in ("NSAMP", "NTEX", "NUAV"))
    instr = self._reg64(mesa.REG_A6XX_SP_CS_BASE)
    shader_iova, shader = st.loads.get((mesa.SB6_CS_SHADER, mesa.ST6_SHADER), (0, b""))
    mem.check(instr, max(len(shader), 4), "SP_CS_BASE (shader)")
    if (pvt := self._reg64(mesa.REG_A6XX_SP_CS_PVT_MEM_BASE)) and self.regs.get(mesa.REG_A6XX_SP_CS_PVT_MEM_SIZE, 0):
      mem.check(pvt, 4, "SP_CS_PVT_MEM_BASE (stack)")
    if nsamp:
      mem.check(self._reg64(mesa.REG_A6XX_SP_CS_SAMPLER_BASE), 16 * nsamp, "SP_CS_SAMPLER_BASE")
      mem.check(self._reg64(mesa.REG_A6XX_TPL1_CS_BORDER_COLOR_BASE), 4, "TPL1_CS_BORDER_COLOR_BASE")
    textures = st.loads.get((mesa.SB6_CS_TEX, mesa.ST6_CONSTANTS), (0, b""))[1] if ntex else b""
    uavs = st.loads.get((mesa.SB6_CS_SHADER, mesa.ST6_UAV), (0, b""))[1] if nuav else b""
    if ntex:
      mem.check(self._reg64(mesa.REG_A6XX_SP_CS_TEXMEMOBJ_BASE), 64 * ntex, "SP_CS_TEXMEMOBJ_BASE")
    if nuav:
      mem.check(self._reg64(mesa.REG_A6XX_SP_CS_UAV_BASE), 64 * nuav, "SP_CS_UAV_BASE")
    for kind, descs in (("texture", textures), ("UAV", uavs)):
      for i in range(0, len(descs), 64):
        lo, hi = struct.unpack_from("<II", descs, i + 16)
        mem.check(lo | (pm4.field(hi, "A6XX_TEX_CONST_5_BASE_HI") << 32), 4, f"{kind} descriptor {i // 64} base")   # DEPTH shares the word
    consts = st.loads.get((mesa.SB6_CS_SHADER, mesa.ST6_CONSTANTS), (0, b""))[1]
    if self.pointer_check is not None:
      self.pointer_check(consts[:CONST_WRITTEN_BYTES], "kernel constants")
    nd0 = self.regs.get(mesa.REG_A6XX_SP_CS_NDRANGE_0, 0)
    lx, ly, lz = (pm4.field(nd0, f"A6XX_SP_CS_NDRANGE_0_LOCALSIZE{a}") + 1 for a in "XYZ")
    local = (lx, ly, lz)
    regs = {r: v for r, v in self.regs.items() if 0xa9b0 <= r <= 0xa9ff or 0xb980 <= r <= 0xb9ff or r == mesa.REG_A6XX_TPL1_CS_BORDER_COLOR_BASE}
    d = Dispatch(pm4.exec_cs_groups(p), local, shader_iova, shader, consts, textures, uavs,
                 st.loads.get((mesa.SB6_CS_TEX, mesa.ST6_SHADER), (0, b""))[1] if nsamp else b"", regs,
                 self._reg64(mesa.REG_A6XX_SP_CS_PVT_MEM_BASE), st.loads.get((mesa.SB6_CS_SHADER, mesa.ST6_UBO), (0, b""))[1])
    self.on_dispatch(d)
    if self.shader_exec is not None:
      c = self.shader_exec(d, mem)
      # level B knows what the dispatch read and wrote: with no wait for idle before it, the a630 may run it beside the
      # dispatches before it (the emulator runs them one after the other, so a race would not show in the results)
      if (read := getattr(c, "read", None)) is not None:
        stack = self.regs.get(mesa.REG_A6XX_SP_CS_PVT_MEM_SIZE, 0)
        if pvt and stack:   # the device's one stack: spilled registers of two overlapping dispatches would share it
          lo, size, _ = mem.region(pvt, "stack")
          written = c.written | {(lo, lo + size)}
        else:
          written = c.written
        name = self.kernel_names.get(shader_iova) or hex(shader_iova)
        if (hazard := order_hazard(st.in_flight, name, read, written)) is not None and self.on_order_hazard is not None:
          self.on_order_hazard(hazard)
        st.in_flight.append((name, read, written))
