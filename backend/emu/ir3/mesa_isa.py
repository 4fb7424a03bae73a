"""Mesa's own a6xx decoder (exported by tinymesa): one call per program gives every instruction's raw word, its
disassembly text and its decoded fields. Only what an instruction *is* comes from here; executing it is ours."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from tinygrad.runtime.autogen import mesa

_libc = ctypes.CDLL(None)
_libc.open_memstream.restype = ctypes.c_void_p
_libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
_libc.fputs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
_libc.fflush.argtypes = [ctypes.c_void_p]
_libc.fclose.argtypes = [ctypes.c_void_p]
_libc.free.argtypes = [ctypes.c_void_p]
GPU_ID = 630
_MARK = "\x1e"   # written before every instruction so the text splits per instruction


@dataclass(frozen=True)
class MesaInstr:
  index: int
  raw: int                              # the 64-bit instruction word
  text: str                             # Mesa's disassembly, flags and operands as it prints them
  fields: tuple[tuple[str, int], ...]   # every decoded field in decode order (nested bitsets flattened)


def disassemble(program: bytes) -> list[MesaInstr]:
  """Every instruction of an IR3 program, decoded by Mesa (branch targets print as relative offsets '#n')."""
  if len(program) % 8:
    raise ValueError(f"an IR3 program is a whole number of 64-bit instructions, got {len(program)} bytes")
  buf, size = ctypes.c_void_p(), ctypes.c_size_t()
  fp = _libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
  raws: list[int] = []
  fields: list[list[tuple[str, int]]] = []

  @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p)
  def pre(_data, n, instr):
    raws.append(ctypes.c_uint64.from_address(instr).value)
    fields.append([])
    _libc.fputs(_MARK.encode(), fp)

  @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_char), ctypes.POINTER(mesa.struct_isa_decode_value))
  def field(_data, name, val):
    fields[-1].append((ctypes.string_at(name).decode(), int(val.contents.num)))

  opts = mesa.struct_isa_decode_options(GPU_ID, True, 0, False, field_cb=field, pre_instr_cb=pre)
  try:
    mesa.ir3_isa_disasm(program, len(program), ctypes.cast(fp, ctypes.POINTER(mesa.struct__IO_FILE)), opts)
  finally:
    _libc.fclose(fp)
    text = ctypes.string_at(buf, size.value).decode() if buf.value else ""
    _libc.free(buf)
  lines = [t.strip() for t in text.split(_MARK)[1:]]
  if len(lines) != len(raws):
    raise ValueError(f"Mesa decoded {len(raws)} instructions but printed {len(lines)}")
  return [MesaInstr(i, r, t, tuple(f)) for i, (r, t, f) in enumerate(zip(raws, lines, fields))]
