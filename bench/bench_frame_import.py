#!/usr/bin/env python3
"""Host time per camera frame: copying the NV12 frame into a GEM buffer (today's path: msm has no userptr) against using the
frame's dma-buf imported once (PRIME_FD_TO_HANDLE + a GPU address, then a lookup per frame). On the emulated render node, in
both GPU address modes; the copy is the same memcpy the QCOM allocator's copyin does, into a GEM buffer's CPU mapping.

  .venv/bin/python bench/bench_frame_import.py [--frames 200] [--camera 1928x1208]

Printed: the CPU, then per mode the first import (once per VisionIPC buffer), the steady per-frame import lookup, and the
per-frame copy (median and p90 over --frames frames, two cameras' worth per 50 ms on the car). Ratios are within this run.
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from artifact.cpu_info import cpu_info  # noqa: E402
from selfdrive_glue.nv12 import nv12_info  # noqa: E402


def device(mode: str, index: int):
  os.environ.update({"EMU_VM_BIND": "1" if mode == "bind" else "0", "MODELD_MSM_VM": mode})
  import backend
  backend.install()
  from tinygrad import Context, Device
  with Context(DEV="EMU+QCOM:IR3"):
    return Device[f"QCOM:{index}"]


def pct(xs: list[float], q: float) -> float:
  return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--frames", type=int, default=200)
  ap.add_argument("--camera", default="1928x1208")
  a = ap.parse_args()
  if a.frames < 10:
    ap.error("--frames must be at least 10")
  w, h = (int(x) for x in a.camera.split("x"))
  info = nv12_info(w, h)
  print(f"CPU: {cpu_info().summary()}")
  print(f"frame: {a.camera} VENUS NV12, {info.size / 1e6:.2f} MB; {a.frames} frames per row\n")
  from backend.emu import dmabuf
  print("| mode | first import (per buffer) | import, per frame (median) | copy, per frame (median / p90) | copy / import |")
  print("|---|---|---|---|---|")
  for i, mode in enumerate(("kernel", "bind")):
    dev = device(mode, 900 + i)
    it = dev.iface
    fds = [dmabuf.export(info.size, f"cam{j}") for j in range(4)]   # a VisionIPC ring of 4 buffers
    src = []
    for fd in fds:
      m = mmap.mmap(fd, info.size)
      m[:] = os.urandom(1 << 16) * (info.size >> 16) + os.urandom(info.size & 0xffff)
      src.append(m)
    t0 = time.perf_counter()
    gems = [it.import_dmabuf(fd) for fd in fds]
    first = (time.perf_counter() - t0) / len(fds)
    imp, cp = [], []
    dst = it.alloc(info.size)
    for f in range(a.frames):
      fd = fds[f % len(fds)]
      t = time.perf_counter()
      g = it.import_dmabuf(fd)
      imp.append(time.perf_counter() - t)
      assert g is gems[f % len(fds)]
      buf = (ctypes.c_char * info.size).from_buffer(src[f % len(fds)])
      t = time.perf_counter()
      ctypes.memmove(dst.cpu, ctypes.addressof(buf), info.size)
      cp.append(time.perf_counter() - t)
      del buf
    mi, mc = statistics.median(imp), statistics.median(cp)
    print(f"| {mode} | {first * 1e6:.0f} us | {mi * 1e6:.1f} us | {mc * 1e3:.2f} ms / {pct(cp, 0.9) * 1e3:.2f} ms | {mc / mi:.0f}x |")
    for g in gems:
      it.free(g)
    it.free(dst)
    for m in src:
      m.close()
    for fd in fds:
      os.close(fd)
  return 0


if __name__ == "__main__":
  sys.exit(main())
