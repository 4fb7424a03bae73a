"""Pickled TinyJits: written reproducible and lean (`pickle_programs`), loaded without running Python code.

Plain unpickling calls whatever a pickle names (`os.system` included), so an artifact whose manifest was rewritten to
match its tampered pickles would run its payload on load. Here every global a pickle asks for must be on a reviewed
list of data classes (jit_pickle_allowlist.json, one reason per entry); anything else is refused by name before it is
imported, and the top-level object must be a TinyJit.

What this does not cover: a JIT's kernels are machine code by design (CPU: native code run in this process; QCOM: a630
code run by the GPU). That they are the ones the release build made is what bundle signatures (artifact/signing.py) prove.
"""
from __future__ import annotations

import enum
import io
import json
import pickle
from functools import cache
from pathlib import Path
from typing import Any

from selfdrive_glue.errors import UserError

ALLOWLIST = Path(__file__).with_name("jit_pickle_allowlist.json")


class PickleRefused(UserError):
  pass


@cache
def allowed_classes() -> frozenset[str]:
  return frozenset(json.loads(ALLOWLIST.read_text())["classes"])


def unpickle_programs(*blobs: bytes, names: tuple[str, ...] = ()) -> tuple[Any, ...]:
  """Unpickle JITs pickled by one compile process, giving their buffers fresh identities in this process.

  tinygrad names a device buffer by a per-process counter (BUFFER uop `ParamArg.slot`) and deduplicates uops by value,
  so an unpickled buffer named like a live one *is* that one (tinygrad issue #15682): a JIT loaded after other tensors
  exist, or tensors made after loading, silently share memory with the JIT's queues and weights. Every buffer slot is
  renamed to a new counter value; one table serves all blobs so the queues shared by the policy and warp JITs stay shared.
  names label the blobs in errors.
  """
  from tinygrad.engine.jit import _TinyJit  # what TinyJit() returns (TinyJit itself is a function in 0.14)
  fresh: dict[tuple, int] = {}
  out = []
  for i, blob in enumerate(blobs):
    name = names[i] if i < len(names) else f"pickle {i}"
    try:
      obj = _JitUnpickler(io.BytesIO(blob), fresh, name).load()
    except PickleRefused:
      raise
    except Exception as e:
      raise PickleRefused(f"{name} is not a loadable TinyJit ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(obj, _TinyJit):
      raise PickleRefused(f"{name} holds a {type(obj).__name__}, not a TinyJit")
    out.append(obj)
  return tuple(out)


class _JitUnpickler(pickle.Unpickler):
  def __init__(self, f, fresh: dict[tuple, int], name: str):
    super().__init__(f)
    self.fresh, self.name = fresh, name

  def find_class(self, module: str, name: str) -> Any:
    # checked before super() imports anything: importing a module can itself run code
    if f"{module}.{name}" not in allowed_classes():
      raise PickleRefused(f"{self.name} asks for {module}.{name}, which is not a class a tinygrad JIT needs "
                          f"(allowed: {ALLOWLIST.name}); the file was tampered with or built by another tinygrad")
    cls = super().find_class(module, name)
    from tinygrad.uop.ops import UOp
    return self._make_uop if cls is UOp else cls

  def _make_uop(self, op, dtype=None, src=(), arg=None, tag=None, metadata=None, _buffer=None):
    from dataclasses import replace

    from tinygrad.uop.ops import Ops, UOp
    if op is Ops.BUFFER and arg is not None and hasattr(arg, "slot") and getattr(arg, "device", None) is not None:
      key = (arg.slot, arg.device, arg.dtype)
      if key not in self.fresh:
        self.fresh[key] = next(UOp.unique_num)
      arg = replace(arg, slot=self.fresh[key])
    return UOp(op, dtype, src, arg, tag, metadata, _buffer)


def pickle_programs(*jits: Any) -> tuple[bytes, ...]:
  """Pickle the captured JITs of one compile: reproducibly, and without the contents of their scratch memory.

  - Reproducible: the same capture gives the same bytes. Buffer slots (per-process counters, renamed on load anyway) are
    renumbered in order of first appearance, one table for all blobs so buffers the JITs share keep one name; and equal
    strings are memoized by value (the C pickler memoizes by identity, and whether two equal strings are one object varies
    from run to run, e.g. a ParamArg's device).
  - Small: a buffer every JIT writes before it reads (scratch_buffers: the memory planner's arena of intermediates, the
    outputs) is pickled unallocated; its contents are overwritten before they are read, so they are dead weight.
  """
  scratch = {id(b) for b in scratch_buffers(*jits)}
  slots: dict[tuple, int] = {}
  out = []
  for jit in jits:
    f = io.BytesIO()
    p = _CanonicalPickler(f, slots, scratch)
    p.dump(jit)
    p.clear_memo()
    out.append(f.getvalue())
  return tuple(out)


def scratch_buffers(*jits: Any) -> list[Any]:
  """The device buffers whose contents no JIT reads before writing them, over one run of each JIT's calls in order.

  Byte ranges are followed per base buffer (the arena is written and read through views); a read of a range not written
  earlier in the same JIT, a call whose writes tinygrad cannot name, or a view whose extent is unknown keeps the buffer."""
  from tinygrad.uop.ops import Ops
  state: dict[Any, bool] = {}
  for jit in jits:
    written: dict[Any, list[tuple[int, int]]] = {}
    for call in _calls(jit.captured._linear):
      args, (outs, ins), known = _call_access(call)
      for i, arg in enumerate(args):
        if arg.op is Ops.PARAM:
          continue  # a JIT input: not pickled
        if (span := _span(arg)) is None:   # unknown extent: whatever it touches is kept
          for b in arg.toposort():
            if b.op is Ops.BUFFER:
              state[b] = False
          continue
        base, lo, hi = span
        if not known or i in ins:
          state[base] = state.get(base, True) and _covered(written.get(base, []), lo, hi)
        if known and i in outs:
          state.setdefault(base, True)
          written.setdefault(base, []).append((lo, hi))
  return [b.realized for b, ok in state.items() if ok and b.realized is not None and b.realized._base is None]


def _calls(linear: Any):
  from tinygrad.uop.ops import Ops
  for call in linear.src:
    if call.src[0].op is Ops.CUSTOM_FUNCTION and call.src[0].arg == "graph":
      yield from call.src[0].src[0].src   # a graph's kernels, in order
    else:
      yield call


def _call_access(call: Any) -> tuple[tuple, tuple[tuple[int, ...], tuple[int, ...]], bool]:
  """(argument uops, (written, read) argument indices, whether tinygrad knows them for this kind of call)."""
  from tinygrad.engine.realize import get_call_arg_uops, get_call_outs_ins
  from tinygrad.uop.ops import Ops
  known = call.src[0].op in (Ops.PROGRAM, Ops.COPY)
  return get_call_arg_uops(call), get_call_outs_ins(call), known


def _span(arg: Any) -> tuple[Any, int, int] | None:
  """(base BUFFER uop, first byte, end byte) an argument covers, or None when it is not one contiguous range of one buffer."""
  from tinygrad.uop.ops import Ops
  if arg.op is Ops.BUFFER:
    return arg, 0, arg.nbytes()
  if (cv := arg.contiguous_view()) is None or cv[0].op is not Ops.BUFFER:
    return None
  base, off = cv
  lo = off * base.dtype.itemsize
  return base, lo, lo + arg.nbytes()


def _covered(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
  for a, b in sorted(ranges):
    if a > lo:
      break   # a gap at lo: no later range (sorted) starts before it
    lo = max(lo, b)
  return lo >= hi


# the pure-Python pickler; typeshed describes little of it beyond dump()
_PyPickler: Any = pickle._Pickler


class _CanonicalPickler(_PyPickler):
  """The pure-Python pickler (its memo can be keyed by value) with tinygrad's buffers and uops reduced our way."""
  dispatch = dict(_PyPickler.dispatch)

  def __init__(self, f, slots: dict[tuple, int], scratch: set[int]):
    # protocol 4, as pickle.dumps writes: the same opcodes and globals (jit_pickle_allowlist.json), so artifacts written
    # either way load alike
    super().__init__(f, protocol=4)
    from tinygrad.device import Buffer
    from tinygrad.uop.ops import UOp
    self.slots, self.scratch = slots, scratch
    self.strings: dict[str, int] = {}
    self.dispatch_table = {UOp: self._reduce_uop, Buffer: self._reduce_buffer}

  def save_str(self, obj: str) -> None:
    if (i := self.strings.get(obj)) is not None:
      self.write(self.get(i))
      return
    _PyPickler.save_str(self, obj)
    self.strings[obj] = self.memo[id(obj)][0]
  dispatch[str] = save_str

  def reducer_override(self, obj):
    # an enum member by value, as most Pythons pickle it: some 3.11 releases (Debian bookworm's 3.11.2, an aarch64 build
    # box's) reduce IntEnum members to builtins.getattr(cls, name), which the loader never admits (getattr reaches anything)
    if isinstance(obj, enum.Enum):
      return type(obj), (obj._value_,)
    return NotImplemented

  def _reduce_uop(self, u):
    from dataclasses import replace

    from tinygrad.uop.ops import Ops
    fn, args = u.__reduce__()
    # metadata is tinygrad's trace of which Tensor call made a uop; uops are interned by value, so whether a captured
    # one carries it depends on what ran earlier in the process (after a backward pass it does): not needed to run, not
    # reproducible, and not a class the loader admits
    args = (*args[:5], None, *args[6:])
    if u.op is Ops.BUFFER and hasattr(arg := args[3], "slot") and getattr(arg, "device", None) is not None:
      slot = self.slots.setdefault((arg.slot, arg.device, arg.dtype), len(self.slots))
      args = (*args[:3], replace(arg, slot=slot), *args[4:])
    return fn, args

  def _reduce_buffer(self, b):
    if id(b) in self.scratch:   # allocated on first use after loading, like any unrealized buffer
      return type(b), (b.device, b.size, b.dtype, None, b.options, None, b.uop_refcount)
    return b.__reduce_ex__(self.proto)
