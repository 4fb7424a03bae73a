#!/usr/bin/env python3
"""Submits in flight per queue (MSM_INFLIGHT) against model latency and the UI, on the a630 timeline model (backend/timeline.py):
one ring, no preemption, a 60 Hz compositor job (5 ms assumed) at priority 0, the driving model every 50 ms at the lowest
priority cut into chunks. A chunk past the limit waits in the MSM interface's FIFO (never dropped) and goes to the kernel as
an earlier one retires; the kernel orders only what it was given, so what sits in the ring ahead of a vsync is what delays it.

  .venv/bin/python bench/bench_inflight.py [--chunk-kernels 16] [--seconds 10] [--phases 6]

The program is `timeline.full_size_program()` (a vision+policy sized model, ~25 ms of a630 time). Printed per limit: model
latency p50/p99/max, vsyncs missed per second, the compositor's longest wait. All rows come from this one run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from artifact.cpu_info import cpu_info  # noqa: E402
from backend import timeline as tl  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--chunk-kernels", type=int, default=16)
  ap.add_argument("--seconds", type=float, default=10.0)
  ap.add_argument("--phases", type=int, default=6)
  a = ap.parse_args()
  if a.chunk_kernels < 1 or a.seconds <= 0 or a.phases < 1:
    ap.error("--chunk-kernels and --phases must be >= 1, --seconds > 0")
  prog = tl.full_size_program()
  print(f"CPU: {cpu_info().summary()} (a simulation: the numbers are the a630 model's, not this CPU's)")
  print(f"program: {len(prog)} kernels, {sum(prog) / 1e3:.1f} ms of GPU time; chunks of {a.chunk_kernels} kernels; "
        f"compositor {tl.COMPOSITOR_US / 1e3:.0f} ms per vsync at prio {tl.COMPOSITOR_PRIO}\n")
  print("| in flight | model p50 ms | model p99 ms | model max ms | vsync misses /s | compositor max wait ms |")
  print("|---|---|---|---|---|---|")
  base = None
  for n in (1, 2, 4, 8, 16):
    r = tl.sweep(prog, tl.Policy(f"{n} in flight", 2, a.chunk_kernels, n), a.seconds, a.phases)
    base = base or r
    print(f"| {n} | {r.model_p50_ms:.1f} | {r.model_p99_ms:.1f} | {r.model_max_ms:.1f} | {r.misses_per_s:.2f} | "
          f"{r.compositor_wait_max_ms:.1f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
