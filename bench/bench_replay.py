"""Replay throughput on CPU: frames/s for the tiny and full reference models, and the speed-up of --jobs N.

  .venv/bin/python bench/bench_replay.py [--segments 4] [--seconds 2] [--jobs 2] [--camera 1344x760]
                                          [--artifact-tiny DIR] [--artifact-full DIR | --no-full]

Synthesises a short route (deterministic), then replays it: HEVC decode alone (the floor every run pays), tiny serial,
tiny with N jobs, full serial, full with N jobs. Artifacts not given are built (models + compile --device CPU) into
the cache the demo uses. Every ratio is against a peer measured in this run. Wall time includes worker start-up and
artifact loading, as a real batch would pay them.
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


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--segments", type=int, default=4)
  ap.add_argument("--seconds", type=float, default=2.0)
  ap.add_argument("--jobs", type=int, default=2)
  ap.add_argument("--camera", default="1344x760")
  ap.add_argument("--artifact-tiny", type=Path)
  ap.add_argument("--artifact-full", type=Path)
  ap.add_argument("--no-full", action="store_true", help="skip the full model (its first compile takes minutes)")
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
    if full is not None:
      nf, wf = timed_replay(segs, full, 1, tdp / "f1")
      rows.append(("full, --jobs 1", nf, wf, f"{(nf / wf) / (n1 / w1):.2f}x tiny --jobs 1"))
      nfj, wfj = timed_replay(segs, full, args.jobs, tdp / "fj")
      rows.append((f"full, --jobs {args.jobs}", nfj, wfj, f"{(nfj / wfj) / (nf / wf):.2f}x full --jobs 1"))
    # same outputs whatever the job count
    for a, b in (("t1", "tj"), ("f1", "fj")):
      if (tdp / a).exists():
        for f in sorted((tdp / a).iterdir()):
          assert f.read_bytes() == (tdp / b / f.name).read_bytes(), f"--jobs changed the output of {f.name}"

  print(f"\nreplay on CPU: {args.segments} segments x {args.seconds:g} s at {args.camera}, {os.cpu_count()} CPUs visible")
  print(f"{'configuration':<30} {'frames':>7} {'wall s':>8} {'frames/s':>9}  ratio")
  print("-" * 75)
  for name, n, wall, ratio in rows:
    print(f"{name:<30} {n:>7} {wall:>8.2f} {n / wall:>9.1f}  {ratio}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
