"""IR3 (a6xx) instructions as data: what each instruction of a program is, not what it does (see execute.py).

Mesa's decoder (mesa_isa.py) splits the 64-bit words into fields and prints them; this module turns each instruction
into an `Instr` (category, opcode, types, dst/src operands with their modifiers, flags, repeat/nop counts, branch
target) and can print it back. `render(instr) == Mesa's text` and the field cross-check (`check_fields`) are what the
corpus test walks over every instruction the reference programs use.
"""
from __future__ import annotations

import functools
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any

from backend.emu.ir3.mesa_isa import MesaInstr, disassemble

COMPS = "xyzw"
# register numbers above the general file, as scalar indices (reg * 4 + component)
REG_A0 = 61 * 4
_TYPES = {"f32", "f16", "u32", "u16", "s32", "s16", "u8", "s8", "b32", "b16"}
_FLAG = re.compile(r"\((sy|ss|jp|sat|ul|ei|rpt\d|nop\d)\)\s*")
_REG = re.compile(r"^(h?)([rcpa])(\d+)\.([xyzw])$")
_REL = re.compile(r"^(h?)([rc])<a0\.x\s*([+-])\s*(\d+)>$")   # a0-relative: r<a0.x + 5>, c<a0.x + 2>
_MODS = ("(absneg)", "(neg)", "(abs)", "(r)")   # (absneg) is -|x|
# a6xx float immediates of cat2/cat3 are an index into a fixed table (FLUT); Mesa prints the value's name
FLUT = {"0.0": (0, 0.0), "0.5": (1, 0.5), "1.0": (2, 1.0), "2.0": (3, 2.0), "e": (4, math.e), "pi": (5, math.pi), "1/pi": (6, 1 / math.pi),
        "1/log2(e)": (7, 1 / math.log2(math.e)), "log2(e)": (8, math.log2(math.e)), "1/log2(10)": (9, 1 / math.log2(10)),
        "log2(10)": (10, math.log2(10)), "4.0": (11, 4.0)}


class DecodeError(ValueError):
  """An instruction this decoder cannot represent (names it and Mesa's text)."""


@dataclass(frozen=True)
class Operand:
  kind: str                  # 'r' register, 'c' const, 'p' predicate, 'a' address reg, 'imm', 'fimm' (float table), 'mem', 'tex', 'samp',
                             # 'rel': a0-relative register or const (space 'r'/'c', scalar index a0.x + offset)
  index: int = 0             # scalar register index (n*4 + comp) / immediate bits / tex-samp slot
  half: bool = False
  mods: tuple[str, ...] = ()   # '(neg)', '(abs)', '(r)' in printed order
  invert: bool = False       # '!p0.x'
  fval: float = 0.0          # 'fimm'
  space: str = ""            # 'mem': 'g' global, 'l' shared, 'p' private
  base: Operand | None = None   # 'mem': address register
  offset: int = 0            # 'mem': byte offset
  text: str = ""             # how Mesa printed an immediate (keeps hex/decimal/half spelling)

  @property
  def neg(self) -> bool:
    return "(neg)" in self.mods or "(absneg)" in self.mods

  @property
  def abs(self) -> bool:
    return "(abs)" in self.mods or "(absneg)" in self.mods

  @property
  def rpt(self) -> bool:
    return "(r)" in self.mods

  def render(self) -> str:
    if self.kind in ("r", "c", "p", "a"):
      return "".join(self.mods) + ("!" if self.invert else "") + ("h" if self.half else "") + f"{self.kind}{self.index // 4}.{COMPS[self.index % 4]}"
    if self.kind == "rel":
      sign = "-" if self.offset < 0 else "+"
      return "".join(self.mods) + ("h" if self.half else "") + f"{self.space}<a0.x {sign} {abs(self.offset)}>"
    if self.kind == "mem":
      assert self.base is not None
      off = f"+{self.offset}" if self.offset > 0 else (str(self.offset) if self.offset < 0 else "")
      return f"{self.space}[{self.base.render()}{off}]"
    if self.kind in ("imm", "fimm"):
      return "".join(self.mods) + self.text
    return self.text


@dataclass(frozen=True)
class Instr:
  index: int
  raw: int
  text: str                  # Mesa's disassembly of this instruction
  cat: int
  name: str                  # full mnemonic as printed, e.g. 'cmps.s.lt', 'cov.f16f32', 'ldg.u32'
  op: str                    # base opcode: 'cmps.s', 'cov', 'ldg', 'stib.b', 'add.f'
  dst: tuple[Operand, ...]   # usually one; swz has two
  srcs: tuple[Operand, ...]
  flags: frozenset[str] = frozenset()   # sy ss jp sat ul ei
  repeat: int = 0
  nop: int = 0
  cond: str = ""             # cmps: lt le gt ge eq ne
  types: tuple[str, ...] = ()  # cat1: (src, dst); cat5: (result type,); cat6: (memory type,)
  count: int = 1             # cat6 components
  target: int | None = None  # branch target (instruction index)
  extra: dict = field(default_factory=dict, compare=False, hash=False)   # cat5/cat6 details (wrmask, dim, typed, ...)

  def render(self) -> str:
    return self.text if self.extra.get("verbatim") else _render(self)


def _flags_prefix(i: Instr, order: tuple[str, ...]) -> str:
  out = ""
  for f in order:
    if f.startswith("rpt"):
      out += f"(rpt{i.repeat})"
    elif f.startswith("nop"):
      out += f"(nop{i.nop}) "
    else:
      out += f"({f})"
  return out


def _render(i: Instr) -> str:
  ops = [o.render() for o in i.dst] + [o.render() for o in i.srcs]
  if i.target is not None:
    ops.append(f"#{i.target - i.index}")
  if i.cat == 6 and i.op in ("ldg", "ldl", "ldp", "stg", "stl", "stp"):
    ops.append(str(i.count))
  pre = _flags_prefix(i, i.extra["flag_order"])
  mid = i.extra.get("cat5_prefix", "")
  return (pre + i.name + ((" " + mid + ", ".join(ops)) if ops else "")).rstrip()


def _split_operands(s: str) -> list[str]:
  return [t.strip() for t in s.split(",")] if s.strip() else []


def _int(s: str) -> int:
  return int(s, 16) if s.lower().lstrip("-").startswith("0x") else int(s)


def parse_operand(tok: str) -> Operand:
  mods: list[str] = []
  rest = tok
  while True:
    for m in _MODS:
      if rest.startswith(m):
        mods.append(m)
        rest = rest[len(m):]
        break
    else:
      break
  invert = rest.startswith("!")
  rest = rest.removeprefix("!")
  if (am := _REL.match(rest)):
    return Operand("rel", half=bool(am[1]), mods=tuple(mods), space=am[2], offset=int(am[4]) * (-1 if am[3] == "-" else 1))
  if (rm := _REG.match(rest)):
    return Operand(rm[2], int(rm[3]) * 4 + COMPS.index(rm[4]), bool(rm[1]), tuple(mods), invert)
  if (mm := re.match(r"^([glp])\[(.+?)([+-]\d+)?\]$", rest)):
    return Operand("mem", space=mm[1], base=parse_operand(mm[2]), offset=int(mm[3] or 0))
  if (pm := re.match(r"^(h?)\((.+)\)$", rest)):
    if pm[2] in FLUT:
      idx, val = FLUT[pm[2]]
      return Operand("fimm", idx, fval=val, half=bool(pm[1]), mods=tuple(mods), text=rest)
    if re.match(r"^-?(0x[0-9a-f]+|\d+)$", pm[2]):
      return Operand("imm", _int(pm[2]), half=bool(pm[1]), mods=tuple(mods), text=rest)
  if re.match(r"^-?(0x[0-9a-f]+|\d+)$", rest):
    return Operand("imm", _int(rest), mods=tuple(mods), text=rest)
  if (tm := re.match(r"^([st])#(\d+)$", rest)):
    return Operand("samp" if tm[1] == "s" else "tex", int(tm[2]), text=rest)
  raise DecodeError(f"operand '{tok}' is not a form this decoder knows")


_CAT1 = re.compile(r"^(mov|cov)\.([a-z]+\d+)([a-z]+\d+)$")


def decode_instr(m: MesaInstr) -> Instr:
  text = m.text
  cat = m.raw >> 61
  pos, flag_order, flags, repeat, nop = 0, [], set(), 0, 0
  while (fm := _FLAG.match(text, pos)):
    f = fm[1]
    flag_order.append(f)
    if f.startswith("rpt"):
      repeat = int(f[3:])
    elif f.startswith("nop"):
      nop = int(f[3:])
    else:
      flags.add(f)
    pos = fm.end()
  body = text[pos:]
  name, _, rest = body.partition(" ")
  extra: dict = {"flag_order": tuple(flag_order)}
  target = None
  toks = _split_operands(rest)
  if toks and toks[-1].startswith("#"):
    target = m.index + int(toks.pop()[1:])
  base: dict[str, Any] = dict(index=m.index, raw=m.raw, text=text, cat=cat, name=name, flags=frozenset(flags), repeat=repeat, nop=nop, target=target)
  try:
    if cat == 0 or cat == 7:
      return Instr(op=name, dst=(), srcs=tuple(parse_operand(t) for t in toks), extra=extra, **base)
    if cat == 1:
      if not (cm := _CAT1.match(name)) and not name.startswith("swz.") and not name.startswith("mova"):
        raise DecodeError(f"cat1 '{name}'")
      ops = [parse_operand(t) for t in toks]
      if name == "mova":
        # 'mova a0.x, hr0.y': the address register takes the (16-bit) source; relative operands index by it
        return Instr(op="mova", dst=(ops[0],), srcs=tuple(ops[1:]), types=("s16", "s16"), extra=extra, **base)
      if name.startswith("swz."):
        _, st, dt = _CAT1.match("mov." + name[4:]).groups()  # type: ignore[union-attr]
        return Instr(op="swz", dst=tuple(ops[:2]), srcs=tuple(ops[2:]), types=(st, dt), extra=extra, **base)
      if cm is None:
        raise DecodeError(f"cat1 '{name}'")
      return Instr(op=cm[1], dst=(ops[0],), srcs=tuple(ops[1:]), types=(cm[2], cm[3]), extra=extra, **base)
    if cat in (2, 3, 4):
      parts = name.split(".")
      cond = parts[2] if parts[0] == "cmps" and len(parts) == 3 else ""
      op = ".".join(parts[:2]) if cond else name
      ops = [parse_operand(t) for t in toks]
      return Instr(op=op, dst=(ops[0],), srcs=tuple(ops[1:]), cond=cond, extra=extra, **base)
    if cat == 5:
      return _decode_cat5(base, name, rest, extra)
    if cat == 6:
      return _decode_cat6(base, name, toks, extra)
  except DecodeError as e:
    raise DecodeError(f"instruction {m.index} '{text}': {e}") from None
  raise DecodeError(f"instruction {m.index} '{text}': category {cat} is not decoded")


def _decode_cat5(base: dict, name: str, rest: str, extra: dict) -> Instr:
  # '(f32)(xyzw)r9.x, r8.x, s#0, t#0'
  pm = re.match(r"^\(([a-z]\d+)\)\(([xyzw]+)\)", rest)
  if pm is None:
    raise DecodeError("cat5 without (type)(wrmask)")
  extra["cat5_prefix"] = pm[0]
  extra["wrmask"] = sum(1 << COMPS.index(c) for c in pm[2])
  parts = name.split(".")
  extra["mods"] = tuple(parts[1:])
  ops = [parse_operand(t) for t in _split_operands(rest[pm.end():])]
  return Instr(op=parts[0], dst=(ops[0],), srcs=tuple(ops[1:]), types=(pm[1],), **base, extra=extra)


def _decode_cat6(base: dict, name: str, toks: list[str], extra: dict) -> Instr:
  parts = name.split(".")
  if parts[-1].startswith("base") and parts[-1][4:].isdigit():
    # bindless: '...imm.base1' names descriptor set 1 (SP_CS_BINDLESS_BASE(1)); the slot indexes into it
    extra["bindless"] = int(parts[-1][4:])
    parts = parts[:-1]
  if parts[0] in ("ldg", "ldl", "ldp", "stg", "stl", "stp"):
    ops = [parse_operand(t) for t in toks[:-1]]
    count = int(toks[-1])
    if parts[0].startswith("ld"):
      return Instr(op=parts[0], dst=(ops[0],), srcs=tuple(ops[1:]), types=(parts[1],), count=count, extra=extra, **base)
    return Instr(op=parts[0], dst=(), srcs=tuple(ops), types=(parts[1],), count=count, extra=extra, **base)
  if parts[0] in ("stib", "ldib"):
    # 'stib.b.typed.2d.f32.4.imm r2.x, r1.z, 0'
    extra.update(typed="typed" in parts, dim=next((p for p in parts if p.endswith("d") and p[0].isdigit()), "1d"),
                 slot_mode=parts[-1])
    tp = next(p for p in parts[2:] if p in _TYPES)
    count = int(next(p for p in parts[2:] if p.isdigit()))
    ops = [parse_operand(t) for t in toks]
    op = ".".join(parts[:2])
    if parts[0] == "ldib":
      return Instr(op=op, dst=(ops[0],), srcs=tuple(ops[1:]), types=(tp,), count=count, extra=extra, **base)
    return Instr(op=op, dst=(), srcs=tuple(ops), types=(tp,), count=count, extra=extra, **base)
  if parts[0] == "ldc":
    # 'ldc.offset0.4.imm r2.x, r1.z, 0': `count` dwords from component `offset` of vec4 number r1.z of UBO 0
    extra.update(component=int(parts[1].removeprefix("offset")), slot_mode=parts[3])
    ops = [parse_operand(t) for t in toks]
    return Instr(op="ldc", dst=(ops[0],), srcs=tuple(ops[1:]), types=("u32",), count=int(parts[2]), extra=extra, **base)
  if parts[0] == "resinfo":
    # 'resinfo.b.untyped.3d.u32.1.imm r1.z, 0': the UAV's size; the dimension is the components asked for
    extra.update(dim=parts[3], slot_mode=parts[-1])
    ops = [parse_operand(t) for t in toks]
    return Instr(op="resinfo.b", dst=(ops[0],), srcs=tuple(ops[1:]), types=(parts[4],), extra=extra, **base)
  if parts[0] == "atomic":
    # global 'atomic.g.add.untyped.1d.u32.1.g r1.w, r1.y, r0.y' (dst, 64-bit address pair, value),
    # shared 'atomic.max.untyped.1d.u32.1.l r1.y, l[r1.x], r0.x', SSBO/image 'atomic.b.add.typed.2d.u32.1.imm ...'
    space = parts[1] if parts[1] in ("g", "b") else parts[-1]
    fn = parts[2] if parts[1] in ("g", "b") else parts[1]
    tp = next(p for p in parts[2:] if p in _TYPES)
    extra.update(atomic=fn, typed="typed" in parts, dim=next((p for p in parts if p.endswith("d") and p[0].isdigit()), "1d"))
    ops = [parse_operand(t) for t in toks]
    return Instr(op=f"atomic.{space}", dst=(ops[0],), srcs=tuple(ops[1:]), types=(tp,), extra=extra, **base)
  raise DecodeError(f"cat6 '{name}' is not decoded")


@dataclass(frozen=True)
class Program:
  digest: str
  instrs: tuple[Instr, ...]
  mesa: tuple[MesaInstr, ...]

  def __len__(self) -> int:
    return len(self.instrs)

  def listing(self, at: int | None = None, context: int = 0) -> str:
    lo, hi = (0, len(self.instrs)) if at is None else (max(0, at - context), min(len(self.instrs), at + context + 1))
    return "\n".join(f"{'>' if i == at else ' '}{i:4d}  {self.instrs[i].text}" for i in range(lo, hi))


@functools.lru_cache(maxsize=1024)
def _decode_cached(program: bytes) -> Program:
  mi = disassemble(program)
  return Program(hashlib.sha256(program).hexdigest()[:16], tuple(decode_instr(m) for m in mi), tuple(mi))


def decode(program: bytes) -> Program:
  """Decodes a whole program (cached by content: a program is decoded once however often it is dispatched)."""
  return _decode_cached(bytes(program))


# *** cross-check against Mesa's own field values ***

_FLAG_FIELDS = {"SY": "sy", "SS": "ss", "JP": "jp", "SAT": "sat", "UL": "ul", "EI": "ei"}


def check_fields(i: Instr, m: MesaInstr) -> list[str]:
  """Disagreements between our representation and the fields Mesa decoded (empty when they agree)."""
  out = []
  f: dict[str, int] = {}
  for k, v in m.fields:
    f.setdefault(k, v)   # first occurrence: the instruction's own field, not a nested one of the same name
  for k, flag in _FLAG_FIELDS.items():
    if k in f and bool(f[k]) != (flag in i.flags):
      out.append(f"flag {flag}: ours {flag in i.flags}, Mesa {f[k]}")
  if "REPEAT" in f and f["REPEAT"] != i.repeat:
    out.append(f"repeat: ours {i.repeat}, Mesa {f['REPEAT']}")
  if "NOP" in f and f["NOP"] != i.nop:
    out.append(f"nop: ours {i.nop}, Mesa {f['NOP']}")
  if i.cat in (1, 2, 3, 4) and "DST" in f and i.dst and i.dst[0].kind == "r":
    if f["DST"] != i.dst[0].index:
      out.append(f"dst: ours {i.dst[0].index}, Mesa {f['DST']}")
  if i.cat in (2, 3, 4):
    regs = [v for k, v in m.fields if k in ("GPR",)]
    ours = [o.index // 4 for o in (*i.dst, *i.srcs) if o.kind == "r" and o.index < REG_A0]
    if sorted(regs) != sorted(ours):
      out.append(f"gpr numbers: ours {ours}, Mesa {regs}")
    consts = [v for k, v in m.fields if k == "CONST"]
    ours_c = [o.index // 4 for o in i.srcs if o.kind == "c"]
    if consts and sorted(consts) != sorted(ours_c):
      out.append(f"const numbers: ours {ours_c}, Mesa {consts}")
    imms = [v for k, v in m.fields if k == "IMMED"]
    ours_i = [o.index & 0xffffffff for o in i.srcs if o.kind in ("imm", "fimm")]
    if imms and [x & 0x7ff for x in imms] != [x & 0x7ff for x in ours_i]:
      out.append(f"immediates: ours {ours_i}, Mesa {imms}")
  return out
