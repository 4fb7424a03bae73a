"""Pointwise (1x1) convolutions of the full reference vision model: our kernel (compile/cpu/pointwise.py) against
tinygrad's own kernel for the same convolution, and both against the machine's measured fp32 peak, in one run.

For every distinct pointwise convolution shape of the model (batch 1, fp32, as the CPU artifact computes it):
  * tinygrad: `x.conv2d(w, b)` captured in a TinyJit under BEAM=--beam (1 by default, as the shipped search records;
    0 = tinygrad's heuristic), split into the CPU thread count's parts and run on all cores (artifact/cpu_threads.py);
  * ours: the same convolution through compile/cpu/pointwise.py in a TinyJit, same parts, same cores.
Both JITs are replayed as a loaded artifact replays its step (artifact/cpu_replay.py). Each call is timed cold, with the
caches as a step leaves them (every level evicted, the inputs read back in, the output cold: compile/tuning/tune.py's
measure), and warm, back to back; the two kernels take turns. Medians are printed with the ratio tinygrad / ours.

  .venv/bin/python bench/bench_pointwise.py [--beam 1] [--reps 15]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def pointwise_shapes(vision: Path) -> list[tuple[int, int, int, int, int]]:
  """(cin, cout, H, W, count) of every pointwise Conv of the model with batch 1, in graph order, one row per shape."""
  import onnx
  from onnx import helper, shape_inference
  m = shape_inference.infer_shapes(onnx.load(str(vision)))
  dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*m.graph.value_info, *m.graph.input, *m.graph.output)}
  inits = {i.name: list(i.dims) for i in m.graph.initializer}
  rows: dict[tuple[int, int, int, int], int] = {}
  for n in m.graph.node:
    if n.op_type != "Conv" or n.input[1] not in inits or inits[n.input[1]][2:] != [1, 1]:
      continue
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    x = dims.get(n.input[0])
    if not x or x[0] != 1 or attrs.get("group", 1) != 1 or any(s != 1 for s in attrs.get("strides", [1, 1])):
      continue
    key = (x[1], inits[n.input[1]][0], x[2], x[3])
    rows[key] = rows.get(key, 0) + 1
  return [(*k, c) for k, c in rows.items()]


def _time(fns: dict, bufs: dict, reps: int, cold: bool) -> dict[str, float]:
  """Median seconds a call, the callables taking turns; cold: caches emptied and inputs read back before each call, else
  back to back (warm caches, the worker threads awake)."""
  from compile.tuning.tune import _StepCaches
  caches = _StepCaches() if cold else None
  times: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      for _ in range(1 if cold else 3):
        if caches is not None:
          caches.evict([t.uop.base.buffer for t in bufs[k]])
        t = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - t)
  return {k: float(np.median(v)) for k, v in times.items()}


def bench_shape(cin: int, cout: int, h: int, w: int, beam: int, reps: int) -> dict[str, float]:
  from tinygrad import Tensor, TinyJit
  from tinygrad.helpers import Context

  from artifact import cpu_replay
  from compile.cpu import pointwise as cpu_pointwise
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal((1, cin, h, w), dtype=np.float32)).realize()
  wt, b = rng.standard_normal((cout, cin, 1, 1), dtype=np.float32), rng.standard_normal(cout, dtype=np.float32)
  W, B = Tensor(wt).realize(), Tensor(b).realize()
  wpad, bpad = (Tensor(a).realize() for a in cpu_pointwise.pad(wt, b))
  tg = TinyJit(lambda t: t.conv2d(W, B).realize())
  ours = TinyJit(lambda t: cpu_pointwise.conv(t, wpad, bpad, cout).realize())
  with Context(BEAM=beam):
    for _ in range(3):
      a, o = tg(x), ours(x)
  err = float(np.abs(a.numpy() - o.numpy()).max())
  # replayed as artifacts run (artifact/cpu_replay.py): the kernel and a few us of call, not tinygrad's JIT dispatch
  tg_r, ours_r = cpu_replay.CpuReplay(tg, "CPU"), cpu_replay.CpuReplay(ours, "CPU")
  tg_r(x), ours_r(x)
  fns, bufs = {"tinygrad": lambda: tg_r(x), "ours": lambda: ours_r(x)}, {"tinygrad": [x, W, B], "ours": [x, wpad, bpad]}
  cold, warm = _time(fns, bufs, reps, cold=True), _time(fns, bufs, reps, cold=False)
  return {**cold, **{f"{k}_warm": v for k, v in warm.items()}, "max_diff": err}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--beam", type=int, default=1, help="BEAM for tinygrad's kernel (0: its heuristic)")
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--seed", type=int, default=0, help="seed of the reference models")
  args = ap.parse_args()
  from artifact import cpu_threads
  from artifact.cpu_info import cpu_info
  from bench.bench_compile import peak_gflops
  from compile.refmodels import driving as refmodels
  cpu_threads.install("CPU")
  with tempfile.TemporaryDirectory(prefix="bench-pointwise-") as td:
    refmodels.write_models(td, "full", args.seed)
    shapes = pointwise_shapes(Path(td) / "driving_vision.onnx")
  peak = peak_gflops()
  print(f"CPU: {cpu_info().summary()}; {cpu_threads.count()} parts per kernel; measured fp32 peak {peak:.0f} GFLOP/s (numpy sgemm 1024)")
  print(f"tinygrad: BEAM={args.beam}; cold: each call with caches evicted and inputs read back (as in a step), warm: back to "
        f"back; medians of {args.reps} rounds")
  print(f"{'cin->cout':>11s} {'HxW':>7s} {'n':>2s} | cold: {'tinygrad ms':>11s} {'GFLOP/s':>7s} {'ours ms':>8s} {'GFLOP/s':>7s} "
        f"{'of peak':>7s} {'tg/ours':>7s} | warm: {'tinygrad':>8s} {'ours':>6s} {'of peak':>7s} {'tg/ours':>7s} | {'max diff':>8s}")
  tot = {"tinygrad": 0.0, "ours": 0.0}
  for i, (cin, cout, h, w, n) in enumerate(shapes):
    r = bench_shape(cin, cout, h, w, args.beam, args.reps)
    gf = 2 * cin * cout * h * w / 1e9
    for k in tot:
      tot[k] += n * r[k]
    print(f"{f'{cin}->{cout}':>11s} {f'{h}x{w}':>7s} {n:2d} |       {r['tinygrad'] * 1e3:11.3f} {gf / r['tinygrad']:7.1f} "
          f"{r['ours'] * 1e3:8.3f} {gf / r['ours']:7.1f} {100 * gf / r['ours'] / peak:6.1f}% {r['tinygrad'] / r['ours']:6.2f}x |       "
          f"{r['tinygrad_warm'] * 1e3:8.3f} {r['ours_warm'] * 1e3:6.3f} {100 * gf / r['ours_warm'] / peak:6.1f}% "
          f"{r['tinygrad_warm'] / r['ours_warm']:6.2f}x | {r['max_diff']:8.1e}", flush=True)
    print(f"  [{i + 1}/{len(shapes)}]", file=sys.stderr, flush=True)
  print(f"all pointwise convolutions of one vision call, cold: tinygrad {tot['tinygrad'] * 1e3:.2f} ms, ours {tot['ours'] * 1e3:.2f} ms "
        f"({tot['tinygrad'] / tot['ours']:.2f}x)")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  raise SystemExit(main())
