"""Replay a loaded CPU TinyJit with its calls resolved once, not on every step.

tinygrad 0.14 replays a captured JIT by interpreting its linear program on each call: per kernel it pattern-matches the
call, resolves every argument to a buffer, checks allocation, finds the runtime and updates its counters: Python time
for every kernel of every step, a sizeable part of a full-model step on a small CPU (docs/performance-cpu.md §4). The
kernels, their order, their arguments and their launch sizes never change between calls of a loaded artifact; only the
JIT's inputs (the camera frames and the host tensors) do. So `CpuReplay` resolves each call once, keeps the buffers that
do not depend on an input, resolves the few that do on each step, and calls the same runtime objects tinygrad would, in
the same order: the same machine code on the same bytes. Anything it does not know (a copy, a graph, a multi-device
buffer, symbolic sizes) is run by tinygrad's own executor for that call.

MODELD_CPU_REPLAY=0 keeps tinygrad's executor (A/B runs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

ENABLED = os.environ.get("MODELD_CPU_REPLAY", "1") != "0"


@dataclass
class _Kernel:
  runtime: Any
  bufs: list[Any]                  # the runtime's buffer arguments; an input-dependent one is refilled each step
  inputs: list[tuple[int, Any]]    # (index into bufs, the argument uop that names a JIT input)
  global_size: tuple[int, ...]
  local_size: tuple[int, ...] | None
  vals: tuple[int | None, ...]   # None in the core_id slot: the runtime fills it per part


class CpuReplay:
  """Callable like the TinyJit it wraps (positional Tensors in, the JIT's return value out). `captured` is the JIT's
  CapturedJit, for code that inspects its calls."""

  def __init__(self, jit: Any, device: str):
    from tinygrad.engine.realize import get_call_arg_uops, get_runtime
    from tinygrad.uop.ops import Ops
    self.jit, self.device = jit, device
    self._nbytes: list[int] | None = None   # the inputs' sizes on the first call, which tinygrad runs
    cap = jit.captured
    self._steps: list[_Kernel | Any] = []
    for call in cap.linear.src:
      ast = call.src[0]
      try:
        if call.op is not Ops.CALL or ast.op is not Ops.PROGRAM or not isinstance(call.src[1].device, str):
          raise LookupError
        gs, ls = ast.arg.launch_dims({})
        vals = tuple(ast.arg.vals({}))
      except (LookupError, RuntimeError):   # not a plain kernel, or one with a size bound per call: tinygrad runs it
        self._steps.append(call)
        continue
      args = get_call_arg_uops(call)
      bufs: list[Any] = []
      inputs: list[tuple[int, Any]] = []
      for i, g in enumerate(ast.arg.globals):
        u = args[g]
        if any(x.op is Ops.PARAM for x in u.toposort()):
          inputs.append((i, u))
          bufs.append(None)
        else:
          bufs.append(u.buffer.ensure_allocated().get_buf(device))
      self._steps.append(_Kernel(get_runtime(device, ast), bufs, inputs, gs, ls, vals))

  @property
  def captured(self) -> Any:
    return self.jit.captured

  def __call__(self, *args: Any) -> Any:
    from tinygrad.device import Buffer
    from tinygrad.engine.jit import JitError, _prepare_jit_inputs
    from tinygrad.engine.realize import ExecContext, _resolve, pm_exec
    cap = self.jit.captured
    # tinygrad's own input checks, as its JIT makes them before a replay
    inputs, var_vals, names, info = _prepare_jit_inputs(args, {})
    if var_vals or names != cap.expected_names or info != cap.expected_input_info or any(u in cap._written_uops for u in inputs):
      return self.jit(*args)   # tinygrad reports the mismatch, or copies an input the JIT writes to
    # tinygrad compares the inputs' views, not their buffers' sizes: a smaller frame would be read past its end
    nbytes = [u.buffer.nbytes for u in inputs]
    if self._nbytes is None:
      ret = self.jit(*args)
      self._nbytes = nbytes
      return ret
    if nbytes != self._nbytes:
      bad = next(i for i, (a, b) in enumerate(zip(nbytes, self._nbytes)) if a != b)
      raise JitError(f"args mismatch in JIT: input {bad} has {nbytes[bad]} bytes, the first call's had {self._nbytes[bad]}")
    ctx = None
    for s in self._steps:
      if isinstance(s, _Kernel):
        for i, u in s.inputs:
          s.bufs[i] = cast(Buffer, _resolve(u, inputs).buffer).ensure_allocated().get_buf(self.device)
        s.runtime(*s.bufs, global_size=s.global_size, local_size=s.local_size, vals=s.vals)
      else:
        ctx = ctx or ExecContext({}, tuple(inputs), update_stats=False, jit=True)
        pm_exec.rewrite(s, ctx)
    return cap.ret


def wrap(jit: Any, device: str) -> Any:
  """`jit` replayed by CpuReplay on a CPU device (unless MODELD_CPU_REPLAY=0), else `jit` itself."""
  if not ENABLED or device.split(":")[0] != "CPU" or getattr(jit, "captured", None) is None:
    return jit
  return CpuReplay(jit, device)
