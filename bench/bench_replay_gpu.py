"""Replay on a workstation GPU: frames/s of the full reference models with a CUDA artifact against the CPU artifact, and the
HEVC decode rate that then becomes the limit, with one and several segments (worker processes) per GPU, and the same on
Ray actors packed k per GPU (`replay --engine ray --gpus-per-actor 1/k`).

  python bench/bench_replay_gpu.py --segments 8 --seconds 4 --jobs 1,4,8 --ray 1,4,8

Everything runs in one go on the same machine: reference models, artifacts (CUDA; CPU only where clang is installed),
synthetic real-shaped segments (1928x1208 road + wide HEVC, encode index), then decode-only and replay passes. `--jobs`
rows are worker processes of the local engine, all on the first GPU; `--ray` rows start a private Ray cluster on this
machine (before the clock; its start-up is printed apart), ask `num_gpus=1/k` per actor so Ray packs k actors onto each
GPU it finds (as many as the CPUs allow, one CPU each) and sets CUDA_VISIBLE_DEVICES per actor, and report frames/s per
GPU used. A row that fails prints its error and the run goes on. Needs a CUDA GPU; CI never runs it.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
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


def ray_rows(segs: list[Path], art: Path, dev: str, per_gpu: list[int], out: Path, ref: Path | None) -> list[tuple[str, float, str]]:
  """--engine ray with 1/k of a GPU per actor, for each k; frames/s per GPU used. ref: --jobs 1 outputs to compare with."""
  import ray

  from offcar.replay_ray import replay_ray
  from selfdrive_glue.route import open_segment
  os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report (the GPU hosts reach nothing outside)
  rows = []
  t = time.perf_counter()
  try:
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
  except Exception as e:
    return [("ray: cluster start", 0.0, f"error: {type(e).__name__}: {str(e)[:100]}")]
  try:
    res = ray.cluster_resources()
    print(f"[bench] Ray cluster up in {time.perf_counter() - t:.1f} s: {res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs",
          file=sys.stderr, flush=True)
    for k in per_gpu:
      name = f"replay {dev}, ray, {k} actor{'s' if k > 1 else ''}/GPU"
      try:
        t = time.perf_counter()
        run = replay_ray([open_segment(s) for s in segs], art, out / f"ray-{k}", progress=False, gpus_per_actor=1 / k)
        wall = time.perf_counter() - t
      except Exception as e:  # a refusal (no GPU in the cluster, too few CPUs) or a Ray failure: a row, not the end of the run
        rows.append((name, 0.0, f"error: {type(e).__name__}: {str(e)[:160]}"))
        continue
      if errs := [r.error for r in run.results if r.error]:
        rows.append((name, 0.0, f"error: {errs[0][:160]}"))
        continue
      frames = sum(r.frames for r in run.results)
      gpus = sorted({g for ids in run.gpu_ids or [] for g in ids})
      same = ""
      if ref is not None:
        differ = [f.name for f in sorted(ref.glob("*.zst")) if f.read_bytes() != (out / f"ray-{k}" / f.name).read_bytes()]
        same = f"; OUTPUTS DIFFER from --jobs 1: {', '.join(differ)}" if differ else "; outputs = --jobs 1"
      rows.append((name, frames / wall / max(len(gpus), 1),
                   f"{run.workers} actors x {run.gpus_per_actor:g} GPU on GPU(s) {','.join(gpus) or '?'}: {frames} steps in {wall:.1f} s "
                   f"(incl. actor start, artifact load), {run.restarts} restarts{same}"))
  finally:
    ray.shutdown()
  return rows


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--segments", type=int, default=4)
  ap.add_argument("--seconds", type=float, default=5.0)
  ap.add_argument("--jobs", default="1,4", help="worker processes per GPU to try (local engine)")
  ap.add_argument("--ray", default="1,4", metavar="K[,K...]", help="Ray actors per GPU to try (--gpus-per-actor 1/K); '' skips Ray")
  ap.add_argument("--device", default="CUDA")
  ap.add_argument("--size", default="full", help="reference model size")
  ap.add_argument("--cpu-segments", type=int, default=1, help="segments replayed with the CPU artifact for the ratio (0: skip; "
                  "skipped anyway where clang, which CPU artifacts need, is missing)")
  a = ap.parse_args()
  try:
    jobs_list = [int(x) for x in a.jobs.split(",") if x.strip()]
    ray_list = [int(x) for x in a.ray.split(",") if x.strip()]
  except ValueError:
    ap.error("--jobs and --ray take comma-separated whole numbers, e.g. 1,4")
  if any(x < 1 for x in jobs_list + ray_list):
    ap.error("--jobs and --ray values must be >= 1")
  from artifact.cpu_info import cpu_info
  from compile.build import compile_artifact
  from compile.refmodels.driving import write_models
  from offcar.replay import replay_many
  from selfdrive_glue.route import open_segment
  from selfdrive_glue.synth import synth_route
  work = Path(tempfile.mkdtemp(prefix="bench_replay_gpu_"))
  models = work / "models"
  write_models(models, a.size, 0)
  t = time.perf_counter()
  synth_route(work / "route", a.segments, a.seconds, 7, f"{CAMERA[0]}x{CAMERA[1]}", qcamera=False, progress=False)
  print(f"[bench] synthesized {a.segments} x {a.seconds:.0f} s segments in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
  segs = sorted((work / "route").iterdir())
  rows: list[tuple[str, float, str]] = []
  devices = [a.device]
  if a.cpu_segments and a.device != "CPU":
    if shutil.which("clang"):
      devices.append("CPU")
    else:
      rows.append(("replay CPU", 0.0, "skipped: no clang on this host (CPU artifacts compile with it)"))
  arts = {}
  for dev in devices:
    t = time.perf_counter()
    try:
      models = {"vision": models / "driving_vision.onnx", "policy": models / "driving_policy.onnx"}
      compile_artifact("driving", models, CAMERA, dev, work / f"art-{dev}", log=lambda *_: None)
    except Exception as e:
      rows.append((f"compile {dev}", 0.0, f"error: {type(e).__name__}: {str(e)[:160]}"))
      continue
    arts[dev] = work / f"art-{dev}"
    print(f"[bench] compiled {dev} artifact in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
  for jobs in jobs_list:
    rows.append((f"decode only (road+wide), {jobs} proc", decode_rate(segs, jobs) / 2, ""))   # per model step: two camera frames
  ref = None
  for dev, art in arts.items():
    for jobs in (jobs_list if dev == a.device else [1]):
      use = segs if dev == a.device else segs[:a.cpu_segments]
      out = work / f"out-{dev}-{jobs}"
      t = time.perf_counter()
      res = replay_many([open_segment(s) for s in use], art, out, jobs=jobs, progress=False)
      wall = time.perf_counter() - t
      if errs := [r.error for r in res if r.error]:
        rows.append((f"replay {dev}, {jobs} proc", 0.0, f"error: {errs[0][:100]}"))
        continue
      if dev == a.device and jobs == 1:
        ref = out
      frames = sum(r.frames for r in res)
      rows.append((f"replay {dev}, {jobs} proc", frames / wall, f"{frames} steps in {wall:.1f} s (incl. process start, artifact load)"))
      print(f"[bench] {rows[-1][0]}: {rows[-1][1]:.1f} steps/s", file=sys.stderr, flush=True)
  if ray_list and a.device in arts:
    rows += ray_rows(segs, arts[a.device], a.device, ray_list, work, ref)
  gpu = "?"
  try:
    import torch
    gpu = torch.cuda.get_device_name(0)
  except Exception:
    pass
  print(f"GPU: {gpu}   CPU: {cpu_info().summary()} ({os.cpu_count()} CPUs)   reference models, {CAMERA[0]}x{CAMERA[1]}, "
        f"{a.segments} segments x {a.seconds:.0f} s, {a.size} models")
  print(f"{'what':40s} {'steps/s per GPU':>15s}  detail\n" + "-" * 100)
  for what, fps, detail in rows:
    print(f"{what:40s} {fps:15.1f}  {detail}")
  print("a model step needs one road and one wide frame; decode rows count steps' worth of frames (decoded frames / 2); "
        "--jobs rows all run on the first GPU, so their rate is that GPU's")
  return 1 if any(d.startswith("error") for _, _, d in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
