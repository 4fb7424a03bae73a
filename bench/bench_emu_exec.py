"""Emulator level B: how fast the a630 interpreter runs the car's program, and how close its numbers are to the CPU.

  python bench/bench_emu_exec.py --size tiny|full [--steps N] [--workdir DIR]

Builds (or reuses, in --workdir) the reference models plus a QCOM artifact (captured on EMU under openpilot's flags) and a
CPU artifact of the same models, then runs the same frames through `ModelState` on both: EMU with execution on
(`EMU_EXEC=1`) and the CPU; EMU twice, once per executor (EMU_NATIVE=0: the numpy closures, EMU_NATIVE=1: native runs).
Prints the CPU model and features, per-step wall time of each, each executor's throughput (fiber-instructions per
second) and whether their outputs are bit-identical, the largest output differences to the CPU, and the program's top 10
kernels by executed work.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(size: str, work: Path) -> tuple[Path, Path]:
  models, q, c = work / f"models-{size}", work / f"qcom-{size}", work / f"cpu-{size}"
  cli = [sys.executable, "-m", "cli.main"]
  if not (models / "driving_policy.onnx").exists():
    subprocess.run([*cli, "models", "--size", size, "-o", models], check=True, cwd=REPO)
  for dev, out in (("QCOM", q), ("CPU", c)):
    if not (out / "manifest.json").exists():
      print(f"[bench] compiling the {dev} artifact ({size})", flush=True)
      subprocess.run([*cli, "compile", "--vision", models / "driving_vision.onnx", "--policy", models / "driving_policy.onnx",
                      "--camera", "1928x1208", "--device", dev, "-o", out], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
  return q, c


def run(artifact: Path, dev: str, frames, steps: int):
  from tinygrad.helpers import DEV

  from modeld_msm.model_state import ModelState
  os.environ["MODELD_DEV"] = dev
  old = DEV.value
  try:
    ms = ModelState(artifact)
    tfm = np.array([[2.9, 0.0, 219.0], [0.0, 2.9, 465.0], [0.0, 0.0, 1.0]], np.float32)
    big = np.array([[1.25, 0.0, 645.0], [0.0, 1.25, 415.0], [0.0, 0.0, 1.0]], np.float32)
    outs, times = [], []
    for i in range(steps):
      t = time.perf_counter()
      out, raw = ms.run(frames[i % len(frames)], frames[(i + 1) % len(frames)], tfm, big, np.zeros(8, np.float32),
                        np.array([[1, 0]], np.float32), False)
      times.append(time.perf_counter() - t)
      outs.append({"raw (vision+policy)": raw.copy(), **{k: np.array(v, copy=True) for k, v in out.items()}})
    return outs, times
  finally:
    DEV.value = old


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--size", choices=("tiny", "full"), default="tiny")
  ap.add_argument("--steps", type=int, default=2)
  ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "modeld-msm" / "bench-emu")
  args = ap.parse_args()
  args.workdir.mkdir(parents=True, exist_ok=True)
  from artifact.cpu_info import cpu_info
  print(f"CPU: {cpu_info().summary()}")
  q, c = build(args.size, args.workdir)
  import backend
  backend.install()
  from selfdrive_glue.nv12 import nv12_info
  rng = np.random.default_rng(0)
  frames = [rng.integers(0, 256, nv12_info(1928, 1208).size, dtype=np.uint8) for _ in range(3)]
  os.environ["EMU_EXEC"] = "1"
  ref, t_cpu = run(c, "CPU", frames, args.steps)
  from tinygrad import Device
  # each executor in the same run: the numpy closures (the checked reference path) and the native runs (the default)
  per_exec = {}
  for name, flag in (("closures", "0"), ("native", "1")):
    os.environ["EMU_NATIVE"] = flag
    node = Device["QCOM"].iface.node if "QCOM" in Device._opened_devices else None
    before = (node.exec_total.instrs, node.exec_total.seconds) if node else (0, 0.0)
    got, t_emu = run(q, "EMU+QCOM:IR3", frames, args.steps)
    node = Device["QCOM"].iface.node
    per_exec[name] = (got, t_emu, node.exec_total.instrs - before[0], node.exec_total.seconds - before[1])
  same = all(a["raw (vision+policy)"].tobytes() == b["raw (vision+policy)"].tobytes() for a, b in zip(per_exec["closures"][0], per_exec["native"][0]))
  per_kernel: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0.0])
  recent = list(node.counts)[-min(len(node.counts), 4096):]
  for name, cnt in recent:
    k = per_kernel[name or "?"]
    k[0] += 1
    k[1] += cnt.instrs
    k[2] += cnt.seconds
  print(f"\n| {args.size} | executor | steps | CPU step (s) | EMU step, median (s) | EMU first step (s) | EMU/CPU | fiber-instr/s |")
  print("|---|---|---|---|---|---|---|---|")
  for name, (_, t_emu, instrs, secs) in per_exec.items():
    warm = t_emu[1:] or t_emu   # the first step also builds the handlers (and, natively, the run plans)
    print(f"| {args.size} | {name} | {args.steps} | {np.median(t_cpu):.3f} | {np.median(warm):.2f} | {t_emu[0]:.2f} | "
          f"{np.median(warm) / np.median(t_cpu):.0f}x | {instrs / max(secs, 1e-9):.3g} |")
  t_c, t_n = (np.median(per_exec[k][1][1:] or per_exec[k][1]) for k in ("closures", "native"))
  print(f"native vs closures: {t_c / t_n:.2f}x faster per step; outputs bit-identical: {same}; dispatches run: {node.stats.dispatches}")
  got = per_exec["native"][0]
  print("\nlargest |EMU - CPU| per output over the steps:")
  for key in ref[0]:
    d = max(float(np.abs(np.asarray(g[key], np.float64) - np.asarray(r[key], np.float64)).max()) for g, r in zip(got, ref))
    scale = max(float(np.abs(np.asarray(r[key], np.float64)).max()) for r in ref)
    print(f"  {key:24s} max|diff| {d:.4g}   max|ref| {scale:.4g}")
  print("\ntop 10 kernels by executed fiber-instructions (last steps):")
  print("| kernel | dispatches | fiber-instr | interp s |")
  print("|---|---|---|---|")
  for name, (n, ins, sec) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:10]:
    print(f"| {name} | {n} | {ins:.3g} | {sec:.2f} |")


if __name__ == "__main__":
  main()
