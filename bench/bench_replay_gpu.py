"""Replay on a workstation GPU: frames/s of the full reference models with a CUDA artifact against the CPU artifact, and the
HEVC decode rate that then becomes the limit, with one and several segments (worker processes) per GPU.

  python bench/bench_replay_gpu.py --segments 4 --seconds 5 --jobs 1,4

Everything runs in one go on the same machine: reference models, artifacts (CPU and CUDA), synthetic real-shaped segments
(1928x1208 road + wide HEVC, encode index), then decode-only and replay passes. Needs a CUDA GPU; CI never runs it.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CAMERA = (1928, 1208)


def _decode(seg: str) -> int:
  from selfdrive_glue.route import ROAD_CAMERA, WIDE_CAMERA, open_segment
  from selfdrive_glue.video import VideoReader
  s, n = open_segment(seg), 0
  for cam in (ROAD_CAMERA, WIDE_CAMERA):
    if (path := s.camera(cam)) is not None:
      vr = VideoReader(path)
      ring = [np.zeros(vr.info.size, np.uint8) for _ in range(2)]
      for _ in vr.frames(ring):
        n += 1
  return n


def decode_rate(segs: list[Path], jobs: int) -> float:
  """Camera frames decoded per second (road + wide each count), segments spread over `jobs` processes."""
  t = time.perf_counter()
  with mp.get_context("spawn").Pool(jobs) as pool:
    n = sum(pool.map(_decode, [str(s) for s in segs]))
  return n / (time.perf_counter() - t)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--segments", type=int, default=4)
  ap.add_argument("--seconds", type=float, default=5.0)
  ap.add_argument("--jobs", default="1,4", help="worker processes per GPU to try")
  ap.add_argument("--device", default="CUDA")
  ap.add_argument("--size", default="full", help="reference model size")
  ap.add_argument("--cpu-segments", type=int, default=1, help="segments replayed with the CPU artifact for the ratio (0: skip)")
  a = ap.parse_args()
  from compile.build import compile_artifact
  from compile.precision import cpu_info
  from compile.refmodels import write_models
  from modeld_msm.replay import replay_many
  from selfdrive_glue.route import open_segment
  from selfdrive_glue.synth import synth_route
  work = Path(tempfile.mkdtemp(prefix="bench_replay_gpu_"))
  models = work / "models"
  write_models(models, a.size, 0)
  t = time.perf_counter()
  synth_route(work / "route", a.segments, a.seconds, 7, f"{CAMERA[0]}x{CAMERA[1]}", qcamera=False, progress=False)
  print(f"[bench] synthesized {a.segments} x {a.seconds:.0f} s segments in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
  segs = sorted((work / "route").iterdir())
  arts = {}
  for dev in ([a.device] + (["CPU"] if a.cpu_segments else [])):
    t = time.perf_counter()
    compile_artifact(models / "driving_vision.onnx", models / "driving_policy.onnx", CAMERA, dev, work / f"art-{dev}", log=lambda *_: None)
    arts[dev] = work / f"art-{dev}"
    print(f"[bench] compiled {dev} artifact in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
  rows = []
  for jobs in map(int, a.jobs.split(",")):
    rows.append((f"decode only (road+wide), {jobs} proc", decode_rate(segs, jobs) / 2, ""))   # per model step: two camera frames
  for dev, art in arts.items():
    for jobs in (map(int, a.jobs.split(",")) if dev == a.device else [1]):
      use = segs if dev == a.device else segs[:a.cpu_segments]
      t = time.perf_counter()
      res = replay_many([open_segment(s) for s in use], art, work / f"out-{dev}-{jobs}", jobs=jobs, progress=False)
      wall = time.perf_counter() - t
      if errs := [r.error for r in res if r.error]:
        rows.append((f"replay {dev}, {jobs} proc", 0.0, f"error: {errs[0][:100]}"))
        continue
      frames = sum(r.frames for r in res)
      rows.append((f"replay {dev}, {jobs} proc", frames / wall, f"{frames} steps in {wall:.1f} s (incl. process start, artifact load)"))
  gpu = "?"
  try:
    import torch
    gpu = torch.cuda.get_device_name(0)
  except Exception:
    pass
  print(f"GPU: {gpu}   CPU: {cpu_info().summary()}   reference models, {CAMERA[0]}x{CAMERA[1]}, "
        f"{a.segments} segments x {a.seconds:.0f} s, {a.size} models")
  print(f"{'what':40s} {'model steps/s':>14s}  detail\n" + "-" * 100)
  for what, fps, detail in rows:
    print(f"{what:40s} {fps:14.1f}  {detail}")
  print("a model step needs one road and one wide frame; decode rows count steps' worth of frames (decoded frames / 2)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
