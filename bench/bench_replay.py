"""Replay throughput on CPU: frames/s for the tiny and full reference models, the speed-up of --jobs N, and the cost of
running the same N workers on Ray.

  .venv/bin/python bench/bench_replay.py [--segments 4] [--seconds 2] [--jobs 2] [--camera 1344x760]
                                          [--artifact-tiny DIR] [--artifact-full DIR | --no-full] [--no-ray]

Synthesises a short route (deterministic), then replays it: HEVC decode alone (the floor every run pays), tiny serial,
tiny with N jobs, tiny on N Ray actors (`--engine ray`: once starting a private local cluster as the CLI does, once on a
cluster already up, as on a shared one), full serial, full with N jobs. Artifacts not given are built (models + compile
--device CPU) into the cache the demo uses. Every ratio is against a peer measured in this run. Wall time includes worker
start-up and artifact loading, as a real batch would pay them. Outputs of every configuration are checked byte for byte.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_artifact(size: str, camera: str) -> Path:
  """The reference models compiled for CPU, from the cache `modeld-msm demo` and `replay` share (built once)."""
  from modeld_msm.demo import cached_artifact
  return cached_artifact(size, camera, "CPU", log=lambda m: print(m, flush=True))


def decode_only(segments) -> tuple[int, float]:
  """Decode both camera files of every segment; counts frame pairs (what a model step consumes)."""
  from selfdrive_glue.route import ROAD_CAMERA, WIDE_CAMERA
  from selfdrive_glue.video import VideoReader
  t = time.perf_counter()
  pairs = 0
  for s in segments:
    counts = [sum(1 for _ in VideoReader(p).frames()) for p in (s.camera(ROAD_CAMERA), s.camera(WIDE_CAMERA)) if p is not None]
    pairs += counts[0]
  return pairs, time.perf_counter() - t


def timed_replay(segments, artifact: Path, jobs: int, out: Path) -> tuple[int, float]:
  from modeld_msm.replay import replay_many
  t = time.perf_counter()
  res = replay_many(segments, artifact, out, jobs=jobs, progress=False)
  wall = time.perf_counter() - t
  bad = [r.error for r in res if r.error]
  if bad:
    raise SystemExit(f"replay failed: {bad[0]}")
  return sum(r.frames for r in res), wall


def timed_ray(segments, artifact: Path, workers: int, out: Path, cluster_up: bool) -> tuple[int, float]:
  """--engine ray with `workers` actors; cluster_up: the local cluster is started before the clock (not counted)."""
  import ray

  from modeld_msm.replay_ray import replay_ray
  if cluster_up:
    ray.init(address="local", num_cpus=workers, include_dashboard=False, logging_level="WARNING")
  try:
    t = time.perf_counter()
    run = replay_ray(segments, artifact, out, jobs=workers, progress=False)
    wall = time.perf_counter() - t
  finally:
    if cluster_up:
      ray.shutdown()
  bad = [r.error for r in run.results if r.error]
  if bad:
    raise SystemExit(f"replay --engine ray failed: {bad[0]}")
  return sum(r.frames for r in run.results), wall


def cpu_model() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  import platform
  return platform.processor() or platform.machine()


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--segments", type=int, default=4)
  ap.add_argument("--seconds", type=float, default=2.0)
  ap.add_argument("--jobs", type=int, default=2)
  ap.add_argument("--camera", default="1344x760")
  ap.add_argument("--artifact-tiny", type=Path)
  ap.add_argument("--artifact-full", type=Path)
  ap.add_argument("--no-full", action="store_true", help="skip the full model (its first compile takes minutes)")
  ap.add_argument("--no-ray", action="store_true", help="skip the Ray rows")
  args = ap.parse_args()

  from selfdrive_glue.route import expand_segments
  from selfdrive_glue.synth import synth_route
  tiny = args.artifact_tiny or build_artifact("tiny", args.camera)
  full = None if args.no_full else (args.artifact_full or build_artifact("full", args.camera))
  with tempfile.TemporaryDirectory(prefix="bench-replay-") as td:
    tdp = Path(td)
    synth_route(tdp / "route", args.segments, args.seconds, 7, args.camera, qcamera=False, progress=False)
    segs = expand_segments([str(tdp / "route")])
    rows: list[tuple[str, int, float, str]] = []
    n, wall = decode_only(segs)
    rows.append(("HEVC decode only (road+wide)", n, wall, "peer"))
    dec_fps = n / wall
    n1, w1 = timed_replay(segs, tiny, 1, tdp / "t1")
    rows.append(("tiny, --jobs 1", n1, w1, f"{(n1 / w1) / dec_fps:.2f}x decode"))
    nj, wj = timed_replay(segs, tiny, args.jobs, tdp / "tj")
    rows.append((f"tiny, --jobs {args.jobs}", nj, wj, f"{(nj / wj) / (n1 / w1):.2f}x tiny --jobs 1"))
    if not args.no_ray:
      os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
      for label, up, d in (("incl. cluster start", False, "tr"), ("cluster up", True, "tu")):
        nr, wr = timed_ray(segs, tiny, args.jobs, tdp / d, up)
        overhead = (wr / nr) / (wj / nj) - 1  # time per frame against --jobs N
        rows.append((f"tiny, ray {args.jobs} workers ({label})", nr, wr, f"{overhead:+.1%} time vs tiny --jobs {args.jobs}"))
    if full is not None:
      nf, wf = timed_replay(segs, full, 1, tdp / "f1")
      rows.append(("full, --jobs 1", nf, wf, f"{(nf / wf) / (n1 / w1):.2f}x tiny --jobs 1"))
      nfj, wfj = timed_replay(segs, full, args.jobs, tdp / "fj")
      rows.append((f"full, --jobs {args.jobs}", nfj, wfj, f"{(nfj / wfj) / (nf / wf):.2f}x full --jobs 1"))
    # same outputs whatever the job count
    for a, b in (("t1", "tj"), ("t1", "tr"), ("t1", "tu"), ("f1", "fj")):
      if (tdp / a).exists() and (tdp / b).exists():
        for f in sorted((tdp / a).glob("*.zst")):
          assert f.read_bytes() == (tdp / b / f.name).read_bytes(), f"{b} changed the output of {f.name}"

  print(f"\nreplay on CPU: {args.segments} segments x {args.seconds:g} s at {args.camera}, {os.cpu_count()} CPUs visible: {cpu_model()}")
  print(f"{'configuration':<44} {'frames':>7} {'wall s':>8} {'frames/s':>9}  ratio")
  print("-" * 95)
  for name, n, wall, ratio in rows:
    print(f"{name:<44} {n:>7} {wall:>8.2f} {n / wall:>9.1f}  {ratio}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
