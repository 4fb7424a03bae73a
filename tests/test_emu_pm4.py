"""The emulator's PM4 decoding (backend/emu/pm4.py) on packets built here, bit by bit, from the a6xx header layout.

The emulator tests run streams tinygrad builds, which never hold a bad header, a packet that ends exactly at the buffer's
end or an opcode's optional dwords; here the headers come from our own builder (parity from a population count, not
from the decoder's nibble table) and every payload field is set to a distinct value and read back by name."""
from __future__ import annotations

import pytest
from tinygrad.runtime.autogen import mesa
from tinygrad.runtime.ops_qcom import pkt4_hdr, pkt7_hdr, qreg

from backend.emu import pm4


def _parity(v: int) -> int:
  """The bit that makes the count of ones in (v, bit) odd."""
  return (bin(v).count("1") + 1) % 2


def t7(op: int, cnt: int, flip: int = 0) -> int:
  """A type-7 header: 0x7 in the top nibble, opcode in 16..22 with its parity in 23, count in 0..13 with its parity in 15."""
  return (7 << 28 | _parity(op) << 23 | op << 16 | _parity(cnt) << 15 | cnt) ^ flip


def t4(reg: int, cnt: int, flip: int = 0) -> int:
  """A type-4 header: 0x4 in the top nibble, register in 8..25 with its parity in 27, count in 0..6 with its parity in 7."""
  return (4 << 28 | _parity(reg) << 27 | reg << 8 | _parity(cnt) << 7 | cnt) ^ flip


@pytest.mark.parametrize("v", [0, 1, 2, 3, 0xf, 0x10, 0x11, 0x7f, 0x80, 0x3fff, 0x12345, 0x3ffff, 0x2aaaa, 0xffffffff, 1 << 40])
def test_parity_bit_makes_the_ones_odd(v):
  assert pm4.odd_parity(v) == _parity(v)


def test_our_header_builder_is_tinygrads():
  # so the packets below are the ones tinygrad's queue emits
  for op, cnt in ((mesa.CP_EXEC_CS, 4), (mesa.CP_EVENT_WRITE, 3), (mesa.CP_WAIT_FOR_IDLE, 0), (mesa.CP_LOAD_STATE6_FRAG, 0x3fff)):
    assert t7(op, cnt) == pkt7_hdr(op, cnt)
  for reg, cnt in ((0x1234, 2), (0x3ffff, 0x7f), (0xa9b0, 1)):
    assert t4(reg, cnt) == pkt4_hdr(reg, cnt)


@pytest.mark.parametrize("op", sorted(pm4.OPCODES))
def test_type7_packets_of_every_opcode(op):
  stream = [0xdead, t7(op, 3), 11, 12, 13, t7(op, 0)]
  p = pm4.decode(stream, 1)
  assert (p.kind, p.code, p.payload, p.pos, p.size) == (7, op, (11, 12, 13), 1, 4)
  assert p.name == pm4.OPCODES[op] and p.name.startswith("CP_")
  last = pm4.decode(stream, 5)   # no payload, the buffer's last dword
  assert (last.payload, last.size, last.pos) == ((), 1, 5)


@pytest.mark.parametrize("reg,cnt", [(0, 1), (0x1234, 2), (0x3ffff, 1), (0xa9b0, 0x7f)])
def test_type4_packets_carry_their_register_and_count(reg, cnt):
  stream = [t4(reg, cnt), *range(100, 100 + cnt)]
  p = pm4.decode(stream, 0)
  assert (p.kind, p.code, p.payload, p.size) == (4, reg, tuple(range(100, 100 + cnt)), 1 + cnt)
  assert p.name == f"REG[{reg:#x}]"


def test_largest_type7_count():
  stream = [t7(mesa.CP_LOAD_STATE6_FRAG, 0x3fff), *range(0x3fff)]
  assert pm4.decode(stream, 0).size == 0x4000
  with pytest.raises(pm4.PM4Error, match="runs past the end"):
    pm4.decode(stream[:-1], 0)


@pytest.mark.parametrize("hdr,what", [
  (t7(mesa.CP_EXEC_CS, 4, flip=1 << 15), "bad type-7 header parity"),     # the count's parity bit
  (t7(mesa.CP_EXEC_CS, 4, flip=1 << 23), "bad type-7 header parity"),     # the opcode's
  (t4(0x1234, 2, flip=1 << 7), "bad type-4 header parity"),
  (t4(0x1234, 2, flip=1 << 27), "bad type-4 header parity"),
  (t7(0x7e, 0), "unknown opcode 0x7e"),
  (t7(0, 0), "unknown opcode 0x0"),
  (0, "unsupported packet header"),
  (5 << 28, "unsupported packet header"),
  (6 << 28 | 0x123, "unsupported packet header"),
  (0xf << 28, "unsupported packet header"),
  (3 << 28, "unsupported packet header"),
])
def test_malformed_headers_are_refused_by_kind(hdr, what):
  with pytest.raises(pm4.PM4Error, match=what) as e:
    pm4.decode([0, 0, hdr, 1, 2, 3, 4], 2)
  assert "at dword 2" in str(e.value)


@pytest.mark.parametrize("make,cnt", [(lambda c: t7(mesa.CP_MEM_WRITE, c), 3), (lambda c: t4(0x1234, c), 3)])
def test_a_packet_must_fit_the_buffer_exactly(make, cnt):
  fits = [make(cnt), 1, 2, 3]
  assert pm4.decode(fits, 0).size == 4
  with pytest.raises(pm4.PM4Error, match="at dword 0 runs past the end of the buffer"):
    pm4.decode(fits[:-1], 0)
  with pytest.raises(pm4.PM4Error, match="runs past the end"):
    pm4.decode([0, *fits[:-1]], 1)


def test_name_of_an_opcode_outside_the_table():
  assert pm4.Packet(7, 0x55, (), 0, 1).name == "CP_0x55" and pm4.Packet(4, 0x55, (), 0, 1).name == "REG[0x55]"


def test_addr64_puts_hi_above_lo():
  assert pm4.addr64(0xfffff000, 0x1) == 0x1_fffff000 and pm4.addr64(0x10, 0xabcd) == 0xabcd_0000_0010 and pm4.addr64(0, 0) == 0


def _pkt(op, *payload):
  return pm4.decode([t7(op, len(payload)), *payload], 0)


@pytest.mark.parametrize("poll,want", [(mesa.POLL_MEMORY, True), (mesa.POLL_REGISTER, False)])
def test_wait_reg_mem_fields(poll, want):
  w = pm4.wait_reg_mem(_pkt(mesa.CP_WAIT_REG_MEM, qreg.cp_wait_reg_mem_0(function=mesa.WRITE_EQ, poll=poll), 0x2000_0040, 0x3, 77, 0xff00, 32))
  assert w == pm4.WaitRegMem(mesa.WRITE_EQ, want, 0x3_2000_0040, 77, 0xff00)


@pytest.mark.parametrize("is64", [True, False])
def test_reg_to_mem_fields(is64):
  r = pm4.reg_to_mem(_pkt(mesa.CP_REG_TO_MEM, qreg.cp_reg_to_mem_0(reg=mesa.REG_A6XX_CP_ALWAYS_ON_COUNTER, cnt=5, _64b=is64), 0x1000, 0x2))
  assert r == pm4.RegToMem(mesa.REG_A6XX_CP_ALWAYS_ON_COUNTER, 5, is64, 0x2_0000_1000)


def test_event_write_with_and_without_its_optional_dwords():
  d0 = qreg.cp_event_write_0(event=mesa.CACHE_FLUSH_TS)
  assert pm4.event_write(_pkt(mesa.CP_EVENT_WRITE, d0, 0x40, 0x1, 9)) == pm4.EventWrite(mesa.CACHE_FLUSH_TS, 0x1_0000_0040, 9)
  assert pm4.event_write(_pkt(mesa.CP_EVENT_WRITE, d0, 0x40, 0x1)) == pm4.EventWrite(mesa.CACHE_FLUSH_TS, 0x1_0000_0040, None)
  assert pm4.event_write(_pkt(mesa.CP_EVENT_WRITE, d0, 0x40)) == pm4.EventWrite(mesa.CACHE_FLUSH_TS, None, None)
  assert pm4.event_write(_pkt(mesa.CP_EVENT_WRITE, d0)) == pm4.EventWrite(mesa.CACHE_FLUSH_TS, None, None)


def test_exec_cs_groups_in_xyz_order():
  p = _pkt(mesa.CP_EXEC_CS, 0, qreg.cp_exec_cs_1(ngroups_x=7), qreg.cp_exec_cs_2(ngroups_y=5), qreg.cp_exec_cs_3(_ngroups_z=3))
  assert pm4.exec_cs_groups(p) == (7, 5, 3)


def test_indirect_buffer_address_and_20_bit_size():
  assert pm4.indirect_buffer(_pkt(mesa.CP_INDIRECT_BUFFER, 0x8000, 0x4, 0x123)) == (0x4_0000_8000, 0x123)
  assert pm4.indirect_buffer(_pkt(mesa.CP_INDIRECT_BUFFER, 0x8000, 0x4, 0xfff_00010)) == (0x4_0000_8000, 0x10)   # bits above 20 are not size
  assert pm4.indirect_buffer(_pkt(mesa.CP_INDIRECT_BUFFER, 0, 0, 0xfffff))[1] == 0xfffff


def _load_state(state_type, block, src, *rest, num_unit=5, dst_off=3):
  d0 = qreg.cp_load_state6_0(state_type=state_type, state_src=src, state_block=block, num_unit=num_unit, dst_off=dst_off)
  return pm4.load_state6(_pkt(mesa.CP_LOAD_STATE6_FRAG, d0, *rest))


def test_load_state6_indirect_reads_the_address_4_byte_aligned():
  s = _load_state(mesa.ST6_UAV, mesa.SB6_CS_SHADER, mesa.SS6_INDIRECT, 0x1000_0007, 0x5, num_unit=9, dst_off=4)
  assert (s.state_type, s.state_src, s.state_block, s.num_unit, s.dst_off) == (mesa.ST6_UAV, mesa.SS6_INDIRECT, mesa.SB6_CS_SHADER, 9, 4)
  assert s.addr == 0x5_1000_0004 and s.inline == ()


def test_load_state6_direct_carries_its_data_inline():
  s = _load_state(mesa.ST6_CONSTANTS, mesa.SB6_CS_SHADER, mesa.SS6_DIRECT, 0, 0, 21, 22, 23, 24)
  assert s.addr is None and s.inline == (21, 22, 23, 24) and s.num_unit == 5 and s.dst_off == 3


@pytest.mark.parametrize("state_type,block,unit", [
  (mesa.ST6_SHADER, mesa.SB6_CS_TEX, 16),      # samplers
  (mesa.ST6_CONSTANTS, mesa.SB6_CS_TEX, 64),   # texture descriptors
  (mesa.ST6_UAV, mesa.SB6_CS_SHADER, 64),
  (mesa.ST6_UBO, mesa.SB6_CS_SHADER, 8),
  (mesa.ST6_SHADER, mesa.SB6_CS_SHADER, 128),
  (mesa.ST6_CONSTANTS, mesa.SB6_CS_SHADER, 16),
])
def test_unit_bytes_per_state_type_and_block(state_type, block, unit):
  assert _load_state(state_type, block, mesa.SS6_INDIRECT, 0, 0).unit_bytes == unit
