#!/usr/bin/env python3
"""A QCOM matrix-vector product with and without tinygrad's reduce split, on the emulated a630, costed by the a630 model.

  .venv/bin/python bench/bench_matvec_split.py [--k 8192] [--n 1024] [--split-threshold 4096]

The shape defaults to the driving policy's largest matvec (r_256_4_2048_4: 1024 outputs, 8192 inputs). Each variant runs
in its own process under openpilot's QCOM flags (FLOAT16 NOLOCALS IMAGE=2; tinygrad reads REDUCEOP_SPLIT_THRESHOLD
once): a TinyJit of x @ W, one frame executed on the emulated node (level B), every dispatch costed by
`backend.a630_cost` as `bench_a630.py` does, under the shipped constants, at `hide_waves` 8 (the top of its range, where
latency hiding needs many waves) and over the band. The weight re-layout kernels both variants run are listed but left
out of the matvec's sum. Also prints each variant's largest difference from a float64 product (the split reorders the sum).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend import a630_cost as ac  # noqa: E402

FLAGS = {"DEV": "EMU+QCOM:IR3", "FLOAT16": "1", "NOLOCALS": "1", "IMAGE": "2", "JIT_BATCH_SIZE": "0"}


def child(k: int, n: int) -> dict:
  import backend
  backend.install()
  import numpy as np
  from tinygrad import Device, Tensor, TinyJit

  from bench.bench_a630 import record_frame
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1, k)).astype(np.float16)
  w_np = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
  w = Tensor(w_np).realize()
  jit = TinyJit(lambda t: t.matmul(w).contiguous())
  for _ in range(2):
    jit(Tensor(x).realize()).realize()
  out: list = []
  frame = record_frame(lambda: out.append(jit(Tensor(x).realize()).numpy()), {"model": jit}, Device.DEFAULT)
  mv = [d.work for d in frame if d.work.name.startswith("r_")]   # the reductions; E_ kernels re-lay out W and x
  err = float(np.abs(out[-1].astype(np.float64) - x.astype(np.float64) @ w_np.astype(np.float64)).max())
  return {"kernels": [(d.work.name, d.local, d.groups, t) for d, t in zip(frame, ac.dispatch_us([d.work for d in frame]))],
          "us": ac.frame_us(mv), "hide8_us": ac.frame_us(mv, replace(ac.DEFAULT, hide_waves=8.0)), "band_us": ac.band_us(mv), "err": err}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--k", type=int, default=8192, help="inputs (the reduction)")
  ap.add_argument("--n", type=int, default=1024, help="outputs")
  ap.add_argument("--split-threshold", type=int, default=4096, help="REDUCEOP_SPLIT_THRESHOLD of the split variant (tinygrad's default: 32768)")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    print(json.dumps(child(args.k, args.n)))
    return 0
  from bench.bench_a630 import machine
  print(f"machine: {machine()} (the estimates do not depend on it)")
  res = {}
  for name, extra in (("unsplit", {}), ("split", {"REDUCEOP_SPLIT_THRESHOLD": str(args.split_threshold)})):
    env = {k: v for k, v in os.environ.items() if k != "REDUCEOP_SPLIT_THRESHOLD"} | FLAGS | extra
    cmd = [sys.executable, __file__, "--child", "--k", str(args.k), "--n", str(args.n)]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
      raise SystemExit(f"the {name} run failed:\n{r.stderr[-3000:]}")
    res[name] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\n{name} ({args.k} -> {args.n}):")
    for kname, local, groups, us in res[name]["kernels"]:
      print(f"  {kname:<28} {us:8.1f} us  local {'x'.join(map(str, local))} x groups {'x'.join(map(str, groups))}")
    m = res[name]
    print(f"  matvec {m['us']:.1f} us (hide_waves 8: {m['hide8_us']:.1f}; band {m['band_us'][0]:.1f}-{m['band_us'][1]:.1f}); "
          f"max |diff| vs float64 {m['err']:.3g}")
  u, s = res["unsplit"], res["split"]
  print(f"\nsplit / unsplit: {s['us'] / u['us']:.3f} (shipped constants), {s['hide8_us'] / u['hide8_us']:.3f} (hide_waves 8), "
        f"{s['band_us'][1] / u['band_us'][1]:.3f} (band top)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
