"""Where a bound graph's command stream is cut into submits: by each kernel's estimated a630 time, else every N kernels.

The compositor's job waits behind at most the chunk in the ring (no preemption on a630 under msm), so a chunk's GPU time is
what bounds the UI's wait; a kernel count only bounds it loosely (one chunk of 16 small kernels is 0.1 ms, of 16 big
convolutions 5+ ms). Costs are per kernel name, from the emulator's execution of the same program at compile time
(`executed_us` of its dynamic counts), shipped in the artifact and registered before its JITs are loaded.
  MSM_CHUNK_US unset: DEFAULT_CHUNK_US when every kernel of the graph has a cost, else MSM_CHUNK_KERNELS;
  MSM_CHUNK_US=0: always MSM_CHUNK_KERNELS; MSM_CHUNK_US=X: chunks of about X us (a longer kernel is a chunk of its own).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

DEFAULT_CHUNK_US = 2500.0   # bench_gpu_priority --executed: no vsync miss with 2.5 ms chunks at 60 Hz
_costs: dict[str, float] = {}
_gate: Callable[[], object] | None = None
_idle: Callable[[], object] | None = None
log = logging.getLogger(__name__)


def set_submit_gate(gate: Callable[[], object] | None) -> None:
  """A call made before every chunk is given to the kernel (None: none). The process above sets it (dmonitoringmodeld's
  GPU turn, modeld_msm/gpu_turn.py, holds its chunks back while modeld's frame is in flight); it must bound its own wait."""
  global _gate
  _gate = gate


def before_submit() -> None:
  if _gate is not None:
    _gate()


def set_idle_hook(hook: Callable[[], object] | None) -> None:
  """A call made when this process's last submitted chunk has retired and none waits (None: none): modeld's GPU turn
  takes its frame's mark down there, so the DM does not wait through modeld's CPU work after its GPU work."""
  global _idle
  _idle = hook


def on_idle() -> None:
  if _idle is not None:
    _idle()


def set_kernel_costs(costs: dict[str, float]) -> None:
  """Estimated GPU microseconds per kernel name (replaces what was registered before)."""
  _costs.clear()
  _costs.update({str(k): float(v) for k, v in costs.items()})


def kernel_costs() -> dict[str, float]:
  return dict(_costs)


def budget_us() -> float | None:
  raw = os.environ.get("MSM_CHUNK_US")
  if raw is None:
    return DEFAULT_CHUNK_US
  value = float(raw)
  if value < 0:
    raise RuntimeError(f"MSM_CHUNK_US={raw} must be >= 0 (0: chunk by MSM_CHUNK_KERNELS)")
  return value or None


def cuts(exec_ends: list[int], exec_names: list[str], n: int, chunk_kernels: int) -> list[int]:
  """Dword positions [0, ..., n] where submits start and end."""
  budget = budget_us()
  if budget and exec_names and all(name in _costs for name in exec_names):
    inner, acc = [], 0.0
    for prev_end, name in zip([0, *exec_ends], exec_names):
      us = _costs[name]
      if acc and acc + us > budget:   # the previous kernels fill a chunk; this one starts the next
        inner.append(prev_end)
        acc = 0.0
      acc += us
    return [0, *inner, n]
  if budget and exec_names and _costs and os.environ.get("MSM_CHUNK_US"):
    missing = sorted({x for x in exec_names if x not in _costs})
    log.warning("MSM_CHUNK_US set but %d kernels have no cost (e.g. %s); chunking by %d kernels", len(missing), missing[0], chunk_kernels)
  return [0, *([e for e in exec_ends[chunk_kernels - 1::chunk_kernels] if e < n] if chunk_kernels else []), n]
