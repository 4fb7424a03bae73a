"""PM4 decoding for the a6xx packets tinygrad's QCOM queue emits: what a packet is, not what it does (see executor.py)."""
from __future__ import annotations

from dataclasses import dataclass

from tinygrad.runtime.autogen import mesa


class PM4Error(Exception):
  """Malformed command stream: bad header, bad parity, unknown opcode, truncated packet."""


def odd_parity(v: int) -> int:
  """The a6xx header parity bit: makes the xor of all nibbles of (v, bit) equal 1."""
  x = 0
  while v:
    x ^= v & 0xf
    v >>= 4
  return (0x9669 >> x) & 1


OPCODES = {getattr(mesa, n): n for n in ("CP_EVENT_WRITE", "CP_WAIT_REG_MEM", "CP_REG_TO_MEM", "CP_MEM_WRITE", "CP_WAIT_FOR_IDLE",
                                          "CP_WAIT_MEM_WRITES", "CP_SET_MARKER", "CP_LOAD_STATE6_FRAG", "CP_EXEC_CS", "CP_INDIRECT_BUFFER",
                                          "CP_RUN_OPENCL", "CP_NOP")}


@dataclass(frozen=True)
class Packet:
  kind: int            # 4 (register write) or 7 (opcode)
  code: int            # first register (type 4) or opcode (type 7)
  payload: tuple[int, ...]
  pos: int             # dword index of the header
  size: int            # header + payload, in dwords

  @property
  def name(self) -> str:
    return f"REG[{self.code:#x}]" if self.kind == 4 else OPCODES.get(self.code, f"CP_{self.code:#x}")


def decode(dw, pos: int) -> Packet:
  """Decodes the packet whose header is dw[pos]; dw is any indexable sequence of u32."""
  hdr = dw[pos]
  if hdr >> 28 == 7:
    cnt, op = hdr & 0x3fff, (hdr >> 16) & 0x7f
    if (hdr >> 15) & 1 != odd_parity(cnt) or (hdr >> 23) & 1 != odd_parity(op):
      raise PM4Error(f"bad type-7 header parity {hdr:#010x} at dword {pos}")
    if op not in OPCODES:
      raise PM4Error(f"unknown opcode {op:#x} at dword {pos}")
    kind, code = 7, op
  elif hdr >> 28 == 4:
    cnt, reg = hdr & 0x7f, (hdr >> 8) & 0x3ffff
    if (hdr >> 7) & 1 != odd_parity(cnt) or (hdr >> 27) & 1 != odd_parity(reg):
      raise PM4Error(f"bad type-4 header parity {hdr:#010x} at dword {pos}")
    kind, code = 4, reg
  else:
    raise PM4Error(f"unsupported packet header {hdr:#010x} at dword {pos}")
  if pos + 1 + cnt > len(dw):
    raise PM4Error(f"{hdr:#010x} at dword {pos} runs past the end of the buffer")
  return Packet(kind, code, tuple(dw[pos + 1:pos + 1 + cnt]), pos, 1 + cnt)


def field(value: int, name: str) -> int:
  return (value & getattr(mesa, f"{name}__MASK")) >> getattr(mesa, f"{name}__SHIFT")


def addr64(lo: int, hi: int) -> int:
  return lo | (hi << 32)


# *** payload layouts of the opcodes that carry addresses ***

@dataclass(frozen=True)
class LoadState:
  state_type: int
  state_src: int
  state_block: int
  num_unit: int
  dst_off: int
  addr: int | None     # indirect source
  inline: tuple[int, ...]

  @property
  def unit_bytes(self) -> int:
    """Bytes per unit: 16 B constants, 128 B shader groups, 64 B texture/UAV descriptors, 16 B samplers, 8 B UBO
    descriptors (A6XX_UBO: base low, base high | size in vec4 << 17)."""
    if self.state_block == mesa.SB6_CS_TEX:
      return 16 if self.state_type == mesa.ST6_SHADER else 64
    if self.state_type == mesa.ST6_UAV:
      return 64
    if self.state_type == mesa.ST6_UBO:
      return 8
    return 128 if self.state_type == mesa.ST6_SHADER else 16


def load_state6(p: Packet) -> LoadState:
  d0 = p.payload[0]
  src = field(d0, "CP_LOAD_STATE6_0_STATE_SRC")
  indirect = src == mesa.SS6_INDIRECT
  return LoadState(field(d0, "CP_LOAD_STATE6_0_STATE_TYPE"), src, field(d0, "CP_LOAD_STATE6_0_STATE_BLOCK"), field(d0, "CP_LOAD_STATE6_0_NUM_UNIT"),
                   field(d0, "CP_LOAD_STATE6_0_DST_OFF"), addr64(p.payload[1] & ~3, p.payload[2]) if indirect else None,
                   () if indirect else p.payload[3:])


@dataclass(frozen=True)
class WaitRegMem:
  function: int
  poll_memory: bool
  addr: int
  ref: int
  mask: int


def wait_reg_mem(p: Packet) -> WaitRegMem:
  d = p.payload
  return WaitRegMem(field(d[0], "CP_WAIT_REG_MEM_0_FUNCTION"), field(d[0], "CP_WAIT_REG_MEM_0_POLL") == mesa.POLL_MEMORY,
                    addr64(d[1], d[2]), d[3], d[4])


@dataclass(frozen=True)
class RegToMem:
  reg: int
  cnt: int
  is64: bool
  addr: int


def reg_to_mem(p: Packet) -> RegToMem:
  d = p.payload
  return RegToMem(field(d[0], "CP_REG_TO_MEM_0_REG"), field(d[0], "CP_REG_TO_MEM_0_CNT"), bool(d[0] & mesa.CP_REG_TO_MEM_0_64B), addr64(d[1], d[2]))


@dataclass(frozen=True)
class EventWrite:
  event: int
  addr: int | None
  value: int | None


def event_write(p: Packet) -> EventWrite:
  d = p.payload
  ev = field(d[0], "CP_EVENT_WRITE_0_EVENT")
  return EventWrite(ev, addr64(d[1], d[2]) if len(d) >= 3 else None, d[3] if len(d) >= 4 else None)


def exec_cs_groups(p: Packet) -> tuple[int, int, int]:
  d = p.payload
  return (field(d[1], "CP_EXEC_CS_1_NGROUPS_X"), field(d[2], "CP_EXEC_CS_2_NGROUPS_Y"), field(d[3], "CP_EXEC_CS_3_NGROUPS_Z"))


def indirect_buffer(p: Packet) -> tuple[int, int]:
  """(iova, size in dwords)."""
  return addr64(p.payload[0], p.payload[1]), p.payload[2] & 0xfffff
