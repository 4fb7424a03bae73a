#!/usr/bin/env python3
"""GPU sharing on the a630 (one ring, no preemption under msm): the real compiled program's per-frame GPU work at 20 Hz against a
60 Hz compositor, for our submit policy vs upstream PR #17224's (priority 0, one submit per graph) vs other chunk sizes.

  .venv/bin/python bench/bench_gpu_priority.py [--artifact QCOM_ARTIFACT] [--size full|tiny] [--seconds 20] [--phases 10]

The frame's GPU work is not synthetic: a QCOM artifact is loaded on the emulated render node (MODELD_DEV=EMU+QCOM:IR3) and one full
step is run; every CP_EXEC_CS the emulator records is matched (by shader address) to the tinygrad kernel it launches and costed with
that kernel's FLOP and byte estimates by `backend.timeline.dispatch_us`. That list of dispatch times is then scheduled against the
compositor by `backend.timeline.simulate`, averaged over camera/vsync phases. Without --artifact, the reference models of --size are
written and compiled for QCOM first (full: about a minute or more).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend import timeline as tl  # noqa: E402


def build_artifact(size: str, work: Path) -> Path:
  """Reference models of `size` compiled for QCOM through the CLI (the same path a release build takes)."""
  models, art = work / f"models_{size}", work / f"qcom_{size}"
  cli = [sys.executable, "-m", "cli.main"]
  subprocess.run([*cli, "models", "--size", size, "-o", str(models)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
  t = time.perf_counter()
  r = subprocess.run([*cli, "compile", "--vision", str(models / "driving_vision.onnx"), "--policy", str(models / "driving_policy.onnx"),
                      "--device", "QCOM", "-o", str(art)], cwd=ROOT, capture_output=True, text=True)
  if r.returncode:
    raise SystemExit(f"compile failed:\n{r.stdout}\n{r.stderr}")
  print(f"compiled the {size} models for QCOM on EMU in {time.perf_counter() - t:.0f} s")
  return art


def step_dispatches(step, jits, device: str, executed: bool = False) -> tuple[list[tuple[str, int, int]], list]:
  """[(kernel name, flops, bytes)] of every dispatch one call of `step` makes on the emulated render node, in ring order
  (matched by shader address to the kernels of `jits`), and, when executed (level B), each one's executed work
  (ir3.execute.Counts) in the same order. The first call binds the graphs and is not counted."""
  from tinygrad import Device
  from tinygrad.engine import realize
  from tinygrad.uop.ops import Ops, sym_infer
  dev = Device[device]
  node = dev.iface.node
  step()
  dev.synchronize()
  seen: list = []
  node.on_dispatch = seen.append
  node.set_execute(executed)
  n0 = len(node.counts)
  step()
  dev.synchronize()
  node.on_dispatch = None
  counts = [c for _, c in list(node.counts)[n0:]] if executed else []
  if executed and len(counts) != len(seen):
    raise SystemExit(f"executed {len(counts)} of {len(seen)} dispatches (the node keeps {node.counts.maxlen} records)")
  kernels = {}
  for jit in jits:
    for u in jit.captured._linear.toposort():
      if u.op is Ops.PROGRAM and (rt := realize.runtime_cache.get((u.key, device))) is not None:
        est = u.src[0].arg.estimates
        kernels[int(rt.lib_gpu.va_addr)] = (u.arg.function_name, int(sym_infer(est.ops, {})), int(sym_infer(est.mem, {})))
  missing = [d.shader_iova for d in seen if d.shader_iova not in kernels]
  if missing or not seen:
    raise SystemExit(f"{len(missing)} of {len(seen)} dispatches could not be matched to a kernel of the artifact")
  return [kernels[d.shader_iova] for d in seen], counts


def frame_dispatches(artifact: Path, executed: bool = False) -> tuple[list[tuple[str, int, int]], dict, list]:
  """[(kernel name, flops, bytes)] for every dispatch of one full step of the artifact, in ring order, plus the device's settings
  and, when executed (emulator level B), each dispatch's executed work (ir3.execute.Counts) in the same order."""
  os.environ["MODELD_DEV"] = "EMU+QCOM:IR3"
  import numpy as np
  from tinygrad import Device

  from modeld_msm.model_state import ModelState
  ms = ModelState(artifact)
  z, eye = np.zeros(ms.nv12.size, np.uint8), np.eye(3, dtype=np.float32)
  disp, counts = step_dispatches(lambda: ms.run(z, z, eye, eye, np.zeros(8, np.float32), np.array([[1, 0]], np.float32), False),
                                 (ms.step.jit, ms.warp.jit), ms.device, executed)
  s = Device[ms.device].iface.settings
  return disp, {"prio": s.priority, "chunk": s.chunk_kernels, "inflight": s.inflight}, counts


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--artifact", type=Path, help="a QCOM artifact (modeld-msm compile --device QCOM); default: compile --size")
  ap.add_argument("--size", choices=("full", "tiny"), default="full", help="reference models to compile when no --artifact (default full)")
  ap.add_argument("--seconds", type=float, default=20.0, help="simulated seconds per vsync phase (default 20)")
  ap.add_argument("--phases", type=int, default=10, help="camera/vsync phases averaged (default 10)")
  ap.add_argument("--executed", action="store_true", help="cost each dispatch from its executed work (emulator level B) and add "
                  "policies that chunk by estimated GPU time")
  args = ap.parse_args()

  with tempfile.TemporaryDirectory(prefix="bench-gpu-prio-") as work:
    art = args.artifact or build_artifact(args.size, Path(work))
    disp, ours, counts = frame_dispatches(art, args.executed)
  prog = [tl.dispatch_us(f, b) for _, f, b in disp]
  if args.executed:
    est = prog
    prog = [tl.executed_us(c.alu, c.sfu, c.tex, c.mem_load + c.mem_store) for c in counts]
    print(f"\ncost from execution: {sum(prog) / 1e3:.1f} ms per frame (FLOP/byte estimate: {sum(est) / 1e3:.1f} ms); "
          f"{sum(c.instrs for c in counts):.3g} fiber-instructions, {sum(c.tex for c in counts):.3g} texel fetches")
  big = sorted(zip(prog, (n for n, _, _ in disp)), reverse=True)[:3]
  print(f"\nartifact {art}: one full step = {len(prog)} dispatches recorded by the emulator, {sum(f for _, f, _ in disp) / 1e9:.2f} GFLOP, "
        f"{sum(b for _, _, b in disp) / 1e6:.0f} MB; a630 timeline cost {sum(prog) / 1e3:.1f} ms alone "
        f"(largest: {', '.join(f'{n} {us / 1e3:.2f} ms' for us, n in big)})")

  import json

  from backend import chunking
  stock = tl.STOCK
  timed = bool(json.loads((art / "metadata.json").read_text()).get("kernel_us")) and chunking.budget_us()
  policies = [stock,
              tl.Policy(f"ours (defaults): prio {ours['prio']}, chunks of <= {timed / 1e3:g} ms, {ours['inflight']} in flight", ours["prio"], 0,
                        ours["inflight"], chunk_us=timed) if timed else
              tl.Policy(f"ours (defaults): prio {ours['prio']}, {ours['chunk'] or 'one'}-kernel chunks, {ours['inflight']} in flight",
                        ours["prio"], ours["chunk"], ours["inflight"]),
              tl.Policy(f"previous default: prio {ours['prio']}, 16-kernel chunks, 1 in flight", ours["prio"], 16, 1),
              tl.Policy("prio 0, 64-kernel chunks, 2 in flight", 0, 64, 2),
              tl.Policy("lowest prio, one submit per graph", 2, 0, 1)]
  policies += [tl.Policy(f"lowest prio, {c}-kernel chunks, {n} in flight", 2, c, n) for c in (8, 16, 32, 128) for n in (1, 2)]
  policies += [tl.Policy(f"lowest prio, chunks of <= {b / 1e3:g} ms, 1 in flight", 2, 0, 1, chunk_us=b) for b in (1500.0, 2500.0, 4000.0)]
  print(f"{len(prog)}-dispatch frame at 20 Hz beside a {tl.COMPOSITOR_US / 1e3:.0f} ms compositor job every {tl.VSYNC_US / 1e3:.1f} ms "
        f"(prio {tl.COMPOSITOR_PRIO}); {args.phases} vsync phases x {args.seconds:.0f} s simulated each\n")
  print(f"{'model submit policy':<52} {'submits':>7} {'vsync miss/s':>12} {'x stock':>7} {'UI wait max':>11} {'model p50':>9} {'p99':>7} "
        f"{'max':>7}  (ms)")
  res = [tl.sweep(prog, p, args.seconds, args.phases) for p in policies]
  base = res[0].misses_per_s
  for r in res:
    p = r.policy
    n_sub = len(tl.chunk_by_time(prog, p.chunk_us)) if p.chunk_us else (1 if p.chunk_kernels == 0 else -(-len(prog) // p.chunk_kernels))
    lat = r.latencies_ms
    p50 = lat[len(lat) // 2] if lat else 0.0
    ratio = "-" if base == 0 else f"{r.misses_per_s / base:.2f}"
    print(f"{p.name:<52} {n_sub:>7} {r.misses_per_s:>12.2f} {ratio:>7} {r.compositor_wait_max_ms:>11.2f} {p50:>9.2f} {r.model_p99_ms:>7.2f} "
          f"{r.model_max_ms:>7.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
