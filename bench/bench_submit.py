#!/usr/bin/env python3
"""Submit-path CPU cost of a big TinyJit graph on MSM (emulated node), against a KGSL-style single prebuilt submission of the
same graph, plus the compositor vsync-miss table from the a630 timeline model.

  .venv/bin/python bench/bench_submit.py [--layers 96] [--frames 30] [--artifact QCOM_ARTIFACT]

With --artifact (a `modeld-msm compile --device QCOM` output, e.g. of `modeld-msm models --size full`), the same configurations are
first measured on that real program, one process per configuration, each frame a full modeld step.

The emulated node stands in for the kernel: its GEM_SUBMIT validation is Python, so it is reported apart ("emu kernel"); the
"userspace" column is what runs in this process on the car (symbol patching, BO-table rebuild, scheduling, ioctl marshalling).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JIT_BATCH_SIZE", "100000")   # the whole program in one HCQGraph, as a big model capture ends up

import backend  # noqa: E402

backend.install()
from tinygrad import Context, Device, Tensor, TinyJit  # noqa: E402

from backend import qcom  # noqa: E402
from backend import timeline as tl  # noqa: E402
from backend import uapi as u  # noqa: E402
from backend.msm import MSMIface  # noqa: E402


class Clock:
  """Accumulates time spent in wrapped functions; nested calls of the same clock count once."""

  def __init__(self):
    self.total, self.depth = 0.0, 0

  def wrap(self, fn):
    def inner(*a, **kw):
      if self.depth:
        return fn(*a, **kw)
      self.depth += 1
      st = time.perf_counter()
      try:
        return fn(*a, **kw)
      finally:
        self.total += time.perf_counter() - st
        self.depth -= 1
    return inner


def open_device(index: int, **env):
  os.environ.update({k: str(v) for k, v in env.items()})
  with Context(DEV="EMU+QCOM:IR3"):
    dev = Device[f"QCOM:{index}"]
  for k in env:
    os.environ.pop(k)
  return dev


def build(dev, layers: int):
  ws = [Tensor.randn(16, 16, 3, 3, device=dev.device).realize() * 0.1 for _ in range(layers)]
  ws = [w.realize() for w in ws]

  @TinyJit
  def f(x):
    for w in ws:
      x = x.conv2d(w, padding=1).relu()
    return x
  return f


def measure(dev, step, frames: int, kgsl_style: bool = False) -> dict:
  """Runs step(i) + synchronize for each frame with the submit path instrumented; medians per frame."""
  it, node = dev.iface, dev.iface.node
  userspace, emu_kernel = Clock(), Clock()
  sub_h = node._handlers[u.DRM_IOCTL_MSM_GEM_SUBMIT]
  node._handlers[u.DRM_IOCTL_MSM_GEM_SUBMIT] = emu_kernel.wrap(sub_h)
  saved = {}
  for cls, attr in ((qcom.MSMComputeQueue, "submit"), (MSMIface, "pump")):
    saved[(cls, attr)] = getattr(cls, attr)
    setattr(cls, attr, userspace.wrap(saved[(cls, attr)]))
  if kgsl_style:   # KGSL keeps one prebuilt request per bound queue: no BO table, no chunks; reuse the first job as-is
    prebuilt = {}
    real_submit = qcom.MSMComputeQueue._submit

    def single(self, d):
      if self.binded_device is not d:
        return real_submit(self, d)
      if self not in prebuilt:
        prebuilt[self] = it.job(self._cmd_gem, 0, len(self._q) * 4, [])
        prebuilt[self].table, prebuilt[self].nr_bos = bytearray(it.job(self._cmd_gem, 0, 4, []).table), 1
      j = prebuilt[self]
      j.fence = 0
      it.enqueue(j)
    qcom.MSMComputeQueue._submit = single
  strict = node.strict
  node.strict = not kgsl_style   # a table-less submit only "works by luck", like the kernel without strict checks
  s0, b0, d0, f0 = it.stats["submits"], it.stats["bos"], node.stats.dispatches, len(node.stats.faults)
  user, emu = [], []
  try:
    for i in range(frames):
      u0, e0 = userspace.total, emu_kernel.total
      step(i)
      dev.synchronize()
      user.append((userspace.total - u0) - (emu_kernel.total - e0))
      emu.append(emu_kernel.total - e0)
  finally:
    for (cls, attr), fn in saved.items():
      setattr(cls, attr, fn)
    node._handlers[u.DRM_IOCTL_MSM_GEM_SUBMIT] = sub_h
    node.strict = strict
    if kgsl_style:
      qcom.MSMComputeQueue._submit = real_submit
  subs = it.stats["submits"] - s0
  return {"submits": subs / frames, "bos": (it.stats["bos"] - b0) / max(subs, 1), "kernels": (node.stats.dispatches - d0) / frames,
          "user_us": sorted(user)[frames // 2] * 1e6, "emu_us": sorted(emu)[frames // 2] * 1e6, "faults": len(node.stats.faults) - f0}


def run_config(index: int, name: str, layers: int, frames: int, kgsl_style: bool = False, **env) -> dict:
  dev = open_device(index, **env)
  f = build(dev, layers)
  inputs = [Tensor.randn(1, 16, 32, 32, device=dev.device).realize() for _ in range(2)]
  for i in range(3):
    f(inputs[i % 2]).realize()   # capture
  dev.synchronize()
  return {"name": name, **measure(dev, lambda i: f(inputs[i % 2]), frames, kgsl_style)}


# *** the real compiled program: each configuration in its own process (settings are read when the device opens) ***

ARTIFACT_CONFIGS = [
  ("KGSL-style: one prebuilt submit per graph, no BO table", True, {"MSM_CHUNK_KERNELS": 0, "MSM_INFLIGHT": 1}),
  ("MSM one submit per graph (table rebuilt)", False, {"MSM_CHUNK_KERNELS": 0, "MSM_INFLIGHT": 1}),
  ("MSM 64-kernel chunks, 2 in flight", False, {"MSM_CHUNK_KERNELS": 64, "MSM_INFLIGHT": 2}),
  ("MSM defaults: 16-kernel chunks, 1 in flight", False, {}),
]


def artifact_child(artifact: str, frames: int, kgsl_style: bool) -> dict:
  """One full modeld step per frame (host inputs in, outputs read back and parsed), as ModelState runs it on the car."""
  import numpy as np

  from modeld_msm.model_state import ModelState
  ms = ModelState(artifact)
  dev = Device[ms.device]
  bufs = [np.random.default_rng(i).integers(0, 256, ms.nv12.size, dtype=np.uint8) for i in range(3)]
  eye, tc = np.eye(3, dtype=np.float32), np.array([[1, 0]], np.float32)

  def step(i):
    ms.run(bufs[i % 3], bufs[(i + 1) % 3], eye, eye, np.zeros(8, np.float32), tc, False)
  for i in range(3):
    step(i)   # binds the graphs
  return measure(dev, step, frames, kgsl_style)


def run_artifact(artifact: str, frames: int) -> list[dict]:
  import json
  import subprocess
  rows = []
  for name, kgsl_style, env in ARTIFACT_CONFIGS:
    e = {**{k: v for k, v in os.environ.items() if not k.startswith("MSM_")}, "MODELD_DEV": "EMU+QCOM:IR3", **{k: str(v) for k, v in env.items()}}
    cmd = [sys.executable, __file__, "--artifact", artifact, "--frames", str(frames), "--child"] + (["--kgsl-style"] if kgsl_style else [])
    r = subprocess.run(cmd, env=e, capture_output=True, text=True)
    if r.returncode:
      raise SystemExit(f"{name}: {r.stderr[-2000:]}")
    rows.append({"name": name, **json.loads(r.stdout.strip().splitlines()[-1])})
  return rows


def print_rows(rows: list[dict], title: str) -> None:
  peer = rows[0]["user_us"]
  print(title)
  print(f"{'configuration':<54} {'submits/frame':>13} {'BOs/submit':>10} {'userspace us':>13} {'x KGSL-style':>12} {'emu kernel us':>14} "
        f"{'faults':>6}")
  for r in rows:
    print(f"{r['name']:<54} {r['submits']:>13.1f} {r['bos']:>10.1f} {r['user_us']:>13.0f} {r['user_us'] / peer:>12.2f} {r['emu_us']:>14.0f} "
          f"{r['faults']:>6}")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=96, help="conv+relu layers in the program (default 96)")
  ap.add_argument("--frames", type=int, default=60)
  ap.add_argument("--artifact", help="also measure this QCOM artifact's real program (modeld-msm compile --device QCOM)")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--kgsl-style", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    import json
    print(json.dumps(artifact_child(args.artifact, args.frames, args.kgsl_style)))
    return 0
  if args.artifact:
    rows = run_artifact(args.artifact, args.frames)
    print_rows(rows, f"\nSubmit path per frame (median of {args.frames}), real program of {args.artifact} ({rows[0]['kernels']:.0f} kernels/frame), "
               "emulated node, full modeld step (host inputs in, outputs read back), 3 camera buffers rotating")

  rows = [run_config(1, "KGSL-style: one prebuilt submit, no BO table", args.layers, args.frames, kgsl_style=True, MSM_CHUNK_KERNELS=0,
                     MSM_INFLIGHT=1),
          run_config(2, "MSM one submit per graph (table rebuilt)", args.layers, args.frames, MSM_CHUNK_KERNELS=0, MSM_INFLIGHT=1),
          run_config(3, "MSM 64-kernel chunks, 2 in flight", args.layers, args.frames, MSM_CHUNK_KERNELS=64, MSM_INFLIGHT=2),
          run_config(4, "MSM defaults: 16-kernel chunks, 1 in flight", args.layers, args.frames, MSM_CHUNK_KERNELS=16, MSM_INFLIGHT=1)]
  print_rows(rows, f"\nSubmit path per frame (median of {args.frames}), {args.layers}-layer conv stack ({rows[0]['kernels']:.0f} kernels/frame), "
             "emulated node, inputs alternate between two buffers")

  prog = tl.full_size_program()
  policies = [tl.STOCK, tl.DEFAULTS, tl.Policy("lowest prio, one submit per graph", 2, 0, 1),
              tl.Policy("lowest prio, 32-kernel chunks, 1 in flight", 2, 32, 1), tl.Policy("lowest prio, 64-kernel chunks, 8 in flight", 2, 64, 8)]
  print(f"\nTimeline model: full-size program ({len(prog)} dispatches, {sum(prog) / 1e3:.1f} ms alone) at 20 Hz beside a "
        f"{tl.COMPOSITOR_US / 1e3:.0f} ms compositor job every {tl.VSYNC_US / 1e3:.1f} ms (prio 0); 10 vsync phases x 20 s each")
  print(f"{'model policy':<50} {'vsync misses/s':>14} {'x stock':>7} {'UI wait max ms':>14} {'model p50 ms':>12} {'model max ms':>12}")
  res = [tl.sweep(prog, p) for p in policies]
  stock = res[0].misses_per_s
  for r in res:
    ratio = "-" if stock == 0 else f"{r.misses_per_s / stock:.2f}"
    print(f"{r.policy.name:<50} {r.misses_per_s:>14.2f} {ratio:>7} {r.compositor_wait_max_ms:>14.2f} {r.model_p50_ms:>12.2f} {r.model_max_ms:>12.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
