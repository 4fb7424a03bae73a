#!/usr/bin/env python3
"""Host time per frame pair of the stateful kind's one packed upload (master's: both frames copied into the packed host
buffer with the transforms and host inputs, then the whole buffer copied into a GEM buffer) against the two other ways a
frame can reach the GPU: each input copied on its own (the other driving kinds when the kernel imports no dma-buf), and
the frames imported as dma-bufs with only the small host arrays copied (issue 44's path, were it applied to this kind).

On the emulated render node (kernel-managed GPU addresses): a copy into GPU memory is the memcpy the QCOM allocator's
copyin does, into a GEM buffer's CPU mapping; the packing is ModelState's own (numpy writes into the views
named_program.host_arrays makes from the artifact's recorded layout).

  .venv/bin/python bench/bench_packed_upload.py [--frames 200] [--camera 1928x1208]

Printed: the CPU, the sizes, then per path the median and p90 host time per frame pair over --frames frames and its ratio
to the packed upload, measured in this run.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from artifact import kinds  # noqa: E402
from artifact.cpu_info import cpu_info  # noqa: E402
from modeld_msm.named_program import host_arrays  # noqa: E402
from selfdrive_glue.nv12 import nv12_info  # noqa: E402


def emu_iface():
  os.environ.update({"EMU_VM_BIND": "0", "MODELD_MSM_VM": "kernel"})
  import backend
  backend.install()
  from tinygrad import Context, Device
  with Context(DEV="EMU+QCOM:IR3"):
    return Device["QCOM:910"].iface


def pct(xs: list[float], q: float) -> float:
  return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def copy_in(dst, src: np.ndarray) -> None:
  """The host side of one copy into GPU memory: a memcpy into the GEM buffer's CPU mapping."""
  ctypes.memmove(dst.cpu, src.ctypes.data, src.nbytes)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--frames", type=int, default=200)
  ap.add_argument("--camera", default="1928x1208")
  a = ap.parse_args()
  if a.frames < 10:
    ap.error("--frames must be at least 10")
  cam = tuple(int(x) for x in a.camera.split("x"))
  info = nv12_info(*cam)
  (spec,) = (p.as_meta(cam) for p in kinds.KINDS["stateful"].programs)
  packed = host_arrays(spec)
  size = packed["packed"].nbytes
  print(f"CPU: {cpu_info().summary()}")
  print(f"camera {a.camera}: VisionIPC buffer {info.size / 1e6:.2f} MB, NV12 planes {kinds.frame_bytes(cam) / 1e6:.2f} MB; "
        f"packed buffer {size / 1e6:.2f} MB; {a.frames} frame pairs per row\n")
  from backend.emu import dmabuf
  it = emu_iface()
  fds = [dmabuf.export(info.size, f"cam{j}") for j in range(6)]   # a VisionIPC ring of 3 buffers per camera
  maps = [mmap.mmap(fd, info.size) for fd in fds]
  rng = np.random.default_rng(0)
  for m in maps:
    m[:] = rng.integers(0, 256, info.size, dtype=np.uint8).tobytes()
  cams = [np.frombuffer(m, np.uint8) for m in maps]
  for fd in fds:
    it.import_dmabuf(fd)   # the first import of each buffer happens once, before the steady state measured here
  host = {"tfm": np.eye(3, dtype=np.float32), "desire": np.zeros(8, np.float32), "traffic_convention": np.array([[1, 0]], np.float32),
          "action_t": np.array([[0.2, 0.3]], np.float32)}
  small = [np.zeros(s, np.float32) for s in ((3, 3), (3, 3), (8,), (1, 2), (1, 2))]
  packed_gem, frame_gems, small_gems = it.alloc(size), [it.alloc(info.size) for _ in range(2)], [it.alloc(4096) for _ in small]
  host_only = np.zeros(4 * 128, np.uint8)   # the four host members, each padded to 128 bytes

  def packed_upload(i: int) -> None:
    packed["tfm"][:] = (host["tfm"], host["tfm"])
    for k in ("desire", "traffic_convention", "action_t"):
      packed[k][:] = host[k]
    for k, b in (("frame", cams[i % 3]), ("big_frame", cams[3 + i % 3])):
      packed[k][:] = b[:packed[k].size]
    copy_in(packed_gem, packed["packed"])

  def separate(i: int) -> None:
    for g, b in zip(frame_gems, (cams[i % 3], cams[3 + i % 3])):
      copy_in(g, b)
    for g, s in zip(small_gems, small):
      copy_in(g, s)

  def imported(i: int) -> None:
    it.import_dmabuf(fds[i % 3])
    it.import_dmabuf(fds[3 + i % 3])
    host_only[:36].view(np.float32)[:] = host["tfm"].reshape(-1)
    copy_in(small_gems[0], host_only)

  rows = []
  for name, fn in (("packed upload (this kind, as master)", packed_upload), ("each input copied (other kinds, no import)", separate),
                   ("frames imported, host arrays copied", imported)):
    fn(0)
    ts = []
    for i in range(a.frames):
      t = time.perf_counter()
      fn(i)
      ts.append(time.perf_counter() - t)
    rows.append((name, statistics.median(ts), pct(ts, 0.9)))
  print("| path | per frame pair (median / p90) | vs packed |")
  print("|---|---|---|")
  for name, med, p90 in rows:
    print(f"| {name} | {med * 1e3:.3f} ms / {p90 * 1e3:.3f} ms | {med / rows[0][1]:.3f}x |")
  for g in (packed_gem, *frame_gems, *small_gems):
    it.free(g)
  cams.clear()   # views of the mappings: gone before the mappings close
  for m in maps:
    m.close()
  for fd in fds:
    os.close(fd)
  return 0


if __name__ == "__main__":
  sys.exit(main())
