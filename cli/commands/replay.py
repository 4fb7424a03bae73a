"""`modeld-msm replay`: run logged segments through the model pipeline into output logs."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from modeld_msm.runner import check_artifact_path
from offcar.demo import cached_artifact
from offcar.frame_map import require_rlog
from offcar.replay import replay_many
from offcar.replay_accuracy import replay_accuracy_lines
from offcar.replay_ray import replay_ray
from selfdrive_glue.errors import UserError
from selfdrive_glue.route import ROAD_CAMERA, expand_segments
from selfdrive_glue.video import VideoReader


def add_arguments(p) -> None:
  p.add_argument("segments", nargs="+", metavar="SEGMENT", help="segment directories (rlog + fcamera.hevc [+ ecamera.hevc]) or route folders")
  p.add_argument("--artifact", metavar="DIR", default=os.environ.get("MODELD_ARTIFACT"),
                 help="compiled artifact for the segments' camera size (default: $MODELD_ARTIFACT, else the reference models below, "
                      "compiled for CPU once and cached like the demo's)")
  p.add_argument("--dm-artifact", metavar="DIR",
                 help="also replay the driver camera (dcamera.hevc + driverEncodeIdx) through this driver-monitoring artifact "
                      "(`compile --dmonitoring`, or a release bundle with dmonitoring/<w>x<h>/): driverStateV2 joins the output log")
  p.add_argument("--models", choices=("tiny", "full"), default="tiny", help="reference models used when no artifact is given (default tiny)")
  p.add_argument("--random-weights", action="store_true",
                 help="with no artifact: the random-weight tiny models instead of the trained stand-in (full is always random)")
  p.add_argument("-o", "--output", required=True, metavar="OUT",
                 help="output log file (one segment, .zst/.bz2) or directory (<segment>.zst per segment)")
  p.add_argument("-j", "--jobs", type=int, default=None,
                 help="workers (default: 1 for --engine local, one per CPU of the cluster for --engine ray); each loads the artifact once "
                      "and replays segments (--mode route: routes) in turn")
  p.add_argument("--engine", choices=("local", "ray"), default="local",
                 help="local = worker processes on this machine (default); ray = Ray actors (a private local cluster, or the one at "
                      "--address), at most 2 tasks in flight per worker, a worker that dies restarted and its tasks run again, and "
                      "segments whose output is already finished for the same inputs, artifact and options skipped "
                      "(see docs/replay-at-scale.md)")
  p.add_argument("--address", metavar="ADDR", help="--engine ray: the cluster to join, e.g. 10.0.0.5:6379 (default: $RAY_ADDRESS, else "
                                                   "start a private one on this machine)")
  p.add_argument("--gpus-per-actor", type=float, default=None, metavar="F",
                 help="--engine ray with a GPU artifact (CUDA/NV/AMD): each worker's share of a GPU, passed to Ray as num_gpus, so "
                      "1/F workers share each GPU (default 0.25 = 4 per GPU: one replayer is bound by decode on its CPU, not by the "
                      "GPU). CPU artifacts take no GPU (0)")
  p.add_argument("--mode", choices=("segment", "warmup", "route"), default="segment",
                 help="model state at each segment's start: segment = fresh, like process_replay (default); warmup = first replay "
                      "the last --warmup-steps frames of the previous segment of the route, outputs thrown away (segments stay "
                      "independent tasks); route = the segments of a route in order through one model, state carried across "
                      "boundaries (exact, but a route is one task). Compare NEW and REF replayed in the same mode")
  p.add_argument("--warmup-steps", type=int, default=100, metavar="N",
                 help="--mode warmup: frames of the previous segment fed first (default 100 = 5 s, the policy's feature history)")
  p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
  """_run, and a failed replay leaves no empty output folder of its own making behind."""
  out = Path(args.output)
  existed = out.exists()
  try:
    rc = _run(args)
  except BaseException:
    _remove_if_empty(out, existed)
    raise
  if rc != 0:
    _remove_if_empty(out, existed)
  return rc


def _remove_if_empty(out, existed: bool) -> None:
  if not existed and out.is_dir() and not any(out.iterdir()):
    out.rmdir()


def _run(args) -> int:
  if args.jobs is not None and args.jobs < 1:
    raise UserError(f"--jobs must be >= 1, got {args.jobs}")
  if args.address and args.engine != "ray":
    raise UserError("--address is the Ray cluster to use; add --engine ray (or drop --address)")
  if args.gpus_per_actor is not None and args.engine != "ray":
    raise UserError("--gpus-per-actor places Ray workers on GPUs; add --engine ray (the local engine runs --jobs processes on "
                    "whatever device the artifact names)")
  segments = expand_segments(args.segments)
  if args.artifact is None:
    args.artifact = _default_artifact(segments, args.models, stand_in=args.models == "tiny" and not args.random_weights)
  elif not args.artifact:
    raise UserError("--artifact is empty; pass an artifact directory (modeld-msm compile --device CPU -o DIR)")
  if args.warmup_steps < 0:
    raise UserError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
  if args.dm_artifact is not None and args.engine == "ray":
    raise UserError("--dm-artifact replays with --engine local only (the Ray workers do not take it yet); drop --engine ray")
  if args.dm_artifact is not None:
    check_artifact_path(args.dm_artifact)   # a wrong path is refused now, not once per segment
  done_before = restarts = 0
  if args.engine == "ray":
    run_ = replay_ray(segments, args.artifact, args.output, jobs=args.jobs, address=args.address, progress=not args.quiet, mode=args.mode,
                      warmup_steps=args.warmup_steps, gpus_per_actor=args.gpus_per_actor)
    results, done_before, restarts = run_.results, run_.done_before, run_.restarts
    if run_.gpus_per_actor:
      on = sorted({i for ids in run_.gpu_ids or [] for i in ids})
      print(f"modeld-msm replay: {run_.workers} Ray worker(s), {run_.gpus_per_actor:g} GPU each, on GPU(s) {', '.join(on) or '?'}",
            file=sys.stderr)
  else:
    results = replay_many(segments, args.artifact, args.output, jobs=args.jobs or 1, progress=not args.quiet, mode=args.mode,
                          warmup_steps=args.warmup_steps, dm_artifact=args.dm_artifact)
  failed = 0
  for r in results:
    if r.error:
      failed += 1
      print(f"modeld-msm replay: error: {r.error}", file=sys.stderr)
      continue
    print(r.summary())
    if "order" in r.mapping:
      print(f"modeld-msm replay: warning: {r.segment}: the log has no encode index, so camera states were paired with video frames "
            "by order; an offset between log and video would go unnoticed", file=sys.stderr)
    if r.damage:
      print(f"modeld-msm replay: warning: {r.segment}: log damaged, replayed the readable prefix: {r.damage}", file=sys.stderr)
    if r.video_damage:
      print(f"modeld-msm replay: warning: {r.segment}: {r.video_damage}", file=sys.stderr)
  # synthetic segments carry their ground truth: <output>.accuracy.json beside each output (offcar/replay_accuracy.py);
  # reported on stderr like the other notes, so stdout stays one result line per segment
  for warn, line in replay_accuracy_lines(results, segments):
    print(f"modeld-msm replay: {'warning: ' if warn else ''}{line}", file=sys.stderr)
  if done_before:
    print(f"modeld-msm replay: {done_before} of {len(results)} segments were already done (same inputs, artifact, code and options), "
          "not replayed again", file=sys.stderr)
  if restarts:
    print(f"modeld-msm replay: {restarts} Ray worker(s) died and were restarted; their tasks ran again", file=sys.stderr)
  if failed:
    if len(results) > 1:
      print(f"modeld-msm replay: {failed} of {len(results)} segments failed", file=sys.stderr)
    return 2
  return 0


def _default_artifact(segments, size: str, stand_in: bool):
  """The reference models (tiny: the trained stand-in unless asked otherwise) compiled for the first segment's camera size
  on CPU, cached as `modeld-msm demo` does: synthetic segments then get accuracy numbers that mean something."""
  require_rlog(segments[0])  # a qlog-only segment: say so (as with --artifact), not that fcamera.hevc is missing
  road = segments[0].camera(ROAD_CAMERA)
  if road is None:
    raise UserError(f"segment {segments[0].path}: missing camera file {ROAD_CAMERA}")
  vr = VideoReader(road)
  return cached_artifact(size, f"{vr.width}x{vr.height}", "CPU", log=lambda m: print(m, file=sys.stderr), stand_in=stand_in, tag="replay")
