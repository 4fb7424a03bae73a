"""Local sizes for kernels compiled for QCOM on the emulated render node: every dividing size, ranked by the a630 model.

Under openpilot's flags (NOLOCALS=1) tinygrad leaves each launch's local size to `optimize_local_size`, which times
candidates made of powers of two and the whole dimension. Under tinygrad 0.14's IR3 launch only a local size that divides
the global one can run (the group count goes into CP_EXEC_CS as an integer; docs/a630-time.md), so a 1350-wide kernel
gets 2-fiber workgroups: 3 % of each 64-lane wave. Here the candidates are every divisor of each dimension within the
launch's limits, ranked by `a630_cost.shape_cost` (issued waves on the busiest of the two SPs), and the choice is put in
tinygrad's own `local_size_cache` before its search runs, so the search finds it and applies it like one of its own:
tinygrad's program, queue and graph code is untouched. Other devices (and QCOM on a real kernel interface) keep
tinygrad's search. Pure arithmetic on the shape: the same kernel gets the same size in every capture.
"""
from __future__ import annotations

import itertools
import math

from tinygrad.device import Device
from tinygrad.engine import realize
from tinygrad.helpers import all_int, to_tuple
from tinygrad.uop.ops import Ops, PatternMatcher, UOp, UPat

from backend import a630_cost

MAX_LOCAL_DIM = 1024   # per dimension, the most SP_CS_NDRANGE_0's local size fields take (tinygrad checks the same)


def divisors(n: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted({*small, *(n // d for d in small)})


def candidates(global_size: tuple[int, ...], max_threads: int) -> list[tuple[int, ...]]:
  """Every local size that divides the global size dimension by dimension, each dimension at most 1024, and whose
  fibers fit the program's `max_threads` (what its registers allow)."""
  limit = min(max_threads, MAX_LOCAL_DIM)
  dims = [[d for d in divisors(g) if d <= MAX_LOCAL_DIM] for g in global_size]
  return [ls for ls in itertools.product(*dims) if math.prod(ls) <= limit]


def choose(global_size: tuple[int, ...], max_threads: int) -> tuple[int, ...]:
  """The candidate with the least modelled cost; ties go to the smallest size in tinygrad's order (as its search's min
  over (time, size) breaks them), so a dimension the divisors do not help keeps the size the power-of-two search took."""
  fibers = math.prod(global_size)
  return min(candidates(global_size, max_threads), key=lambda ls: (a630_cost.shape_cost(fibers // math.prod(ls), math.prod(ls)), ls))


def _emulated_qcom(device: str) -> bool:
  return device.split(":")[0] == "QCOM" and getattr(getattr(Device[device], "iface", None), "node", None) is not None


def _optimize_local_size(call: UOp, prg: UOp) -> UOp | None:
  device = to_tuple(prg.device)[0]
  if (prg.arg.local_size is None and all_int(prg.arg.global_size) and prg.key not in realize.local_size_cache
      and _emulated_qcom(device) and Device[device].renderer.has_local):
    max_threads = realize.get_runtime(device, prg, cache=False).max_threads
    realize.local_size_cache[prg.key] = choose(tuple(prg.arg.global_size), max_threads)
  return realize.optimize_local_size(call, prg)


_upstream_pm = realize.pm_optimize_local_size


def install() -> None:
  """Puts our choice in front of tinygrad's search (compile_linear reads `pm_optimize_local_size` when it runs). Idempotent."""
  if realize.pm_optimize_local_size is _upstream_pm:
    realize.pm_optimize_local_size = PatternMatcher([
      (UPat(Ops.CALL, src=(UPat(Ops.PROGRAM, name="prg"),), name="call", allow_any_len=True), _optimize_local_size),
    ])


def installed() -> bool:
  return realize.pm_optimize_local_size is not _upstream_pm
