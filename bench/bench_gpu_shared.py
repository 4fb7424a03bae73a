#!/usr/bin/env python3
"""The a630 shared by three: modeld (driving model), dmonitoringmodeld (driver monitoring) and a 60 Hz compositor, on one
ring without preemption (mainline msm). Each model process has its own submitqueue; both run at 20 Hz on frames camerad
captures together.

  .venv/bin/python bench/bench_gpu_shared.py [--artifact QCOM_DRIVING] [--dm-artifact QCOM_DM] [--size full|tiny] [--work DIR]
                                             [--compositor-ms 5 2] [--seconds 20] [--phases 10]

Each model's frame is its real program: the QCOM artifact is stepped once on the emulated render node, the kernels it
dispatches are recorded in ring order, and each is costed by the a630 time the compile estimated from executing it (the
artifact's `kernel_us`, emulator level B). `backend.timeline.simulate_shared` then plays both against the compositor for
each policy, averaged over camera/vsync phases; every model's p99 is also given against its time with the GPU to itself
(the compositor only, same policy). Without artifacts the reference models of --size are written and compiled for QCOM
first (full: several minutes; --work DIR keeps them there for the next run). The compositor's job per vsync is an
assumption (5 ms, backend/timeline.py); --compositor-ms gives the table for each value asked.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend import timeline as tl  # noqa: E402
from bench.bench_gpu_priority import step_dispatches  # noqa: E402

# on-device host times of openpilot's own processes over KGSL (openpilot PR #37866), the figures to compare with
KGSL_MS = {"modeld": (24.5, 28.0), "dmonitoringmodeld": (13.0, 19.0)}


def build(size: str, work: Path) -> tuple[Path, Path]:
  if all((work / n / "manifest.json").exists() for n in ("driving", "dmonitoring")):
    print(f"using the {size} artifacts compiled before in {work}")
    return work / "driving", work / "dmonitoring"
  cli = [sys.executable, "-m", "cli.main"]
  m = work / "models"
  subprocess.run([*cli, "models", "--size", size, "-o", str(m)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
  subprocess.run([*cli, "models", "--contract", "dmonitoring", "--size", size, "-o", str(m)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
  out = []
  for name, args in (("driving", ["--vision", str(m / "driving_vision.onnx"), "--policy", str(m / "driving_policy.onnx")]),
                     ("dmonitoring", ["--dmonitoring", str(m / "dmonitoring_model.onnx")])):
    t = time.perf_counter()
    r = subprocess.run([*cli, "compile", *args, "--device", "QCOM", "-o", str(work / name)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
      raise SystemExit(f"compile failed:\n{r.stdout}\n{r.stderr}")
    print(f"compiled the {size} {name} model for QCOM on EMU in {time.perf_counter() - t:.0f} s", flush=True)
    out.append(work / name)
  return out[0], out[1]


def programs(driving: Path, dm: Path) -> dict[str, list[float]]:
  os.environ["MODELD_DEV"] = "EMU+QCOM:IR3"
  import numpy as np

  from modeld_msm.dm_core import DMonitoringCore
  from modeld_msm.model_state import ModelState
  ms = ModelState(driving)
  z, eye = np.zeros(ms.nv12.size, np.uint8), np.eye(3, dtype=np.float32)
  drive, _ = step_dispatches(lambda: ms.run(z, z, eye, eye, np.zeros(8, np.float32), np.array([[1, 0]], np.float32), False),
                             (ms.step.jit, ms.warp.jit), ms.device)
  core = DMonitoringCore(dm)
  dmon, _ = step_dispatches(lambda: core.run(z), (core.program.jit,), ms.device)
  out = {}
  for name, art, order in (("modeld", driving, drive), ("dmonitoringmodeld", dm, dmon)):
    us = json.loads((art / "metadata.json").read_text())["kernel_us"]
    if missing := sorted({k for k, _, _ in order if k not in us}):
      raise SystemExit(f"{art}: no a630 time for {len(missing)} kernels ({missing[:3]}); recompile it")
    out[name] = [us[k] for k, _, _ in order]
  return out


def machine() -> str:
  from artifact.cpu_info import cpu_info
  c = cpu_info()
  return f"{c.model} ({platform.machine()}, {os.cpu_count()} cores; ISA {' '.join(sorted(c.flags & {'avx2', 'fma', 'avx512f', 'avx512_fp16'}))})"


def table(progs: dict[str, list[float]], setups, comp_us: float, seconds: float, phases: int) -> None:
  print(f"\nboth models at 20 Hz (frames captured together) beside a {comp_us / 1e3:g} ms compositor job every "
        f"{tl.VSYNC_US / 1e3:.1f} ms (prio {tl.COMPOSITOR_PRIO}); {phases} vsync phases x {seconds:.0f} s each. "
        "x alone = p99 over the same policy's p99 with the GPU to itself (compositor only)\n")
  head = f"{'policy':<52} {'miss/s':>6} {'UI wait':>7} {'modeld p50':>10} {'p99':>6} {'x alone':>7} {'DM p50':>6} {'p99':>6} {'x alone':>7}  (ms)"
  print(head)
  print("-" * len(head))
  for label, pols, yields in setups:
    clients = [tl.Client(n, tuple(p), pols[n], yield_to=yields if n == "dmonitoringmodeld" else None) for n, p in progs.items()]
    shared = tl.sweep_shared(clients, seconds, phases, comp_us)
    alone = {c.name: tl.sweep_shared([tl.Client(c.name, c.program_us, c.policy)], seconds, phases, comp_us).models[c.name] for c in clients}
    cells = []
    for n in progs:
      r = shared.models[n]
      lat = r.latencies_ms
      cells.append(f"{lat[len(lat) // 2] if lat else 0:>{10 if n == 'modeld' else 6}.2f} {r.model_p99_ms:>6.2f} "
                   f"{r.model_p99_ms / max(alone[n].model_p99_ms, 1e-9):>7.2f}")
    print(f"{label:<52} {shared.misses_per_s:>6.2f} {shared.compositor_wait_max_ms:>7.2f} {' '.join(cells)}")
  load = (sum(sum(p) for p in progs.values()) / tl.MODEL_PERIOD_US + comp_us / tl.VSYNC_US) * 100
  print(f"GPU load: {load:.0f} % of the a630's time (both models' frames every {tl.MODEL_PERIOD_US / 1e3:g} ms + the compositor)"
        + ("; over 100 %: no submit policy keeps both at 20 Hz" if load > 100 else ""))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--artifact", type=Path, help="QCOM driving artifact (default: compile --size)")
  ap.add_argument("--dm-artifact", type=Path, help="QCOM driver-monitoring artifact (default: compile --size)")
  ap.add_argument("--size", choices=("full", "tiny"), default="full")
  ap.add_argument("--work", type=Path, help="keep the compiled artifacts here and reuse them next time (default: a temp dir)")
  ap.add_argument("--compositor-ms", type=float, nargs="+", default=[tl.COMPOSITOR_US / 1e3],
                  help=f"the compositor's GPU time per vsync, one table each (default {tl.COMPOSITOR_US / 1e3:g})")
  ap.add_argument("--seconds", type=float, default=20.0, help="simulated seconds per vsync phase (default 20)")
  ap.add_argument("--phases", type=int, default=10, help="camera/vsync phases averaged (default 10)")
  args = ap.parse_args()
  print(f"machine: {machine()} (the simulation's numbers do not depend on it)")
  with tempfile.TemporaryDirectory(prefix="bench-gpu-shared-") as tmp:
    work = args.work or Path(tmp)
    work.mkdir(parents=True, exist_ok=True)
    driving, dm = (args.artifact, args.dm_artifact) if args.artifact and args.dm_artifact else build(args.size, work)
    progs = programs(driving, dm)
  for name, p in progs.items():
    print(f"{name}: {len(p)} dispatches, {sum(p) / 1e3:.1f} ms of a630 time per frame (from execution; largest {max(p) / 1e3:.2f} ms)")

  from backend import chunking
  budget = chunking.budget_us()
  ours = tl.Policy(f"lowest prio, <= {budget / 1e3:g} ms chunks, 1 in flight", 2, 0, 1, chunk_us=budget)
  setups = [
    ("KGSL-style: prio 0, one submit per graph, both", {n: tl.STOCK for n in progs}, None),
    (f"ours: {ours.name}, both", {n: ours for n in progs}, None),
    ("ours, DM yields to modeld between chunks", {n: ours for n in progs}, "modeld"),
    ("ours, 2 chunks in flight", {n: tl.Policy("2 in flight", 2, 0, 2, chunk_us=budget) for n in progs}, None),
  ]
  for b in (1000.0, 1500.0, 4000.0):
    setups.append((f"lowest prio, <= {b / 1e3:g} ms chunks, 1 in flight, both", {n: tl.Policy("b", 2, 0, 1, chunk_us=b) for n in progs}, None))
  setups.append(("lowest prio, <= 1.5 ms chunks, DM yields", {n: tl.Policy("b", 2, 0, 1, chunk_us=1500.0) for n in progs}, "modeld"))
  for comp_ms in args.compositor_ms:
    table(progs, setups, comp_ms * 1e3, args.seconds, args.phases)
  print(f"\non a comma device over KGSL (openpilot PR #37866, host time): modeld {KGSL_MS['modeld'][0]}-{KGSL_MS['modeld'][1]} ms, "
        f"dmonitoringmodeld {KGSL_MS['dmonitoringmodeld'][0]}-{KGSL_MS['dmonitoringmodeld'][1]} ms")
  return 0


if __name__ == "__main__":
  sys.exit(main())
