"""`modeld-msm replay`: run logged segments through the model pipeline into output logs."""
from __future__ import annotations

import os
import sys

HELP = "run logged segments through the model pipeline into an output log"


def add_arguments(p) -> None:
  p.add_argument("segments", nargs="+", metavar="SEGMENT", help="segment directories (rlog + fcamera.hevc [+ ecamera.hevc]) or route folders")
  p.add_argument("--artifact", metavar="DIR", default=os.environ.get("MODELD_ARTIFACT"),
                 help="compiled artifact for the segments' camera size (default: $MODELD_ARTIFACT, else the reference models below, "
                      "compiled for CPU once and cached like the demo's)")
  p.add_argument("--models", choices=("tiny", "full"), default="tiny", help="reference models used when no artifact is given (default tiny)")
  p.add_argument("-o", "--output", required=True, metavar="OUT",
                 help="output log file (one segment, .zst/.bz2) or directory (<segment>.zst per segment)")
  p.add_argument("-j", "--jobs", type=int, default=1,
                 help="worker processes (default 1); each loads the artifact once and replays segments (--mode route: routes) in turn")
  p.add_argument("--mode", choices=("segment", "warmup", "route"), default="segment",
                 help="model state at each segment's start: segment = fresh, like process_replay (default); warmup = first replay "
                      "the last --warmup-steps frames of the previous segment of the route, outputs thrown away (segments stay "
                      "independent tasks); route = the segments of a route in order through one model, state carried across "
                      "boundaries (exact, but a route is one task). Compare NEW and REF replayed in the same mode")
  p.add_argument("--warmup-steps", type=int, default=100, metavar="N",
                 help="--mode warmup: frames of the previous segment fed first (default 100 = 5 s, the policy's feature history)")
  p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
  from modeld_msm.errors import UserError
  from modeld_msm.replay import replay_many
  from selfdrive_glue.route import expand_segments
  if args.jobs < 1:
    raise UserError(f"--jobs must be >= 1, got {args.jobs}")
  segments = expand_segments(args.segments)
  if args.artifact is None:
    args.artifact = _default_artifact(segments, args.models)
  elif not args.artifact:
    raise UserError("--artifact is empty; pass an artifact directory (modeld-msm compile --device CPU -o DIR)")
  if args.warmup_steps < 0:
    raise UserError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
  results = replay_many(segments, args.artifact, args.output, jobs=args.jobs, progress=not args.quiet, mode=args.mode,
                        warmup_steps=args.warmup_steps)
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
  if failed:
    if len(results) > 1:
      print(f"modeld-msm replay: {failed} of {len(results)} segments failed", file=sys.stderr)
    return 2
  return 0


def _default_artifact(segments, size: str):
  """The reference models compiled for the first segment's camera size on CPU (cached, as `modeld-msm demo` does)."""
  from modeld_msm.demo import cached_artifact
  from modeld_msm.errors import UserError
  from selfdrive_glue.route import ROAD_CAMERA
  from selfdrive_glue.video import VideoReader
  road = segments[0].camera(ROAD_CAMERA)
  if road is None:
    raise UserError(f"segment {segments[0].path}: missing camera file {ROAD_CAMERA}")
  vr = VideoReader(road)
  return cached_artifact(size, f"{vr.width}x{vr.height}", "CPU", log=lambda m: print(m, file=sys.stderr))
