"""Loading pickled TinyJits without running Python code.

Plain unpickling calls whatever a pickle names (`os.system` included), so an artifact whose manifest was rewritten to
match its tampered pickles would run its payload on load. Here every global a pickle asks for must be on a reviewed
list of data classes (jit_pickle_allowlist.json, one reason per entry); anything else is refused by name before it is
imported, and the top-level object must be a TinyJit.

What this does not cover: a JIT's kernels are machine code by design (CPU: native code run in this process; QCOM: a630
code run by the GPU). That they are the ones the release build made is what bundle signatures (compile/signing.py) prove.
"""
from __future__ import annotations

import io
import json
import pickle
from functools import cache
from pathlib import Path
from typing import Any

from modeld_msm.errors import UserError

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
