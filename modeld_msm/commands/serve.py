"""`modeld-msm serve`: run as openpilot's modeld process.

The one set of options and the one code path of the modeld process: `python -m modeld_msm.modeld` (what the launcher
`modeld-msm install` writes execs, with no arguments) parses with this add_arguments and runs this run, so an option
tried with `serve` on a desk means the same on the car.
"""
from __future__ import annotations

import os

HELP = "run as openpilot's modeld process"
ARTIFACT_ENV = "MODELD_ARTIFACT"


def add_arguments(p) -> None:
  p.add_argument("--artifact", default=os.environ.get(ARTIFACT_ENV),
                 help=f"artifact directory (modeld-msm compile), or a bundle with one per camera size; its device picks the backend "
                      f"(default ${ARTIFACT_ENV}, which the installed launcher sets, else the artifacts/ folder of this checkout)")
  params = p.add_mutually_exclusive_group()
  params.add_argument("--car-params", help="serialized car.CarParams file (default: openpilot's Params, else demo defaults)")
  params.add_argument("--demo", action="store_true", help="ignore openpilot's Params and use demo car params")
  p.add_argument("--server", default="camerad", help="VisionIPC server name")
  p.add_argument("--max-frames", type=int, default=0, help="stop after publishing N frames (0 = run until SIGINT)")
  p.add_argument("--no-realtime", action="store_true", help="skip SCHED_FIFO/core pinning")


def run(args) -> int:
  try:
    return _serve(args)
  except KeyboardInterrupt:
    # SIGINT before serve() took it over, or while waiting for camerad: openpilot's manager stopping us, a clean stop
    return 0


def _serve(args) -> int:
  import logging
  from pathlib import Path

  from compile.artifact import MANIFEST, verify_artifact
  from modeld_msm.modeld import DEFAULT_BUNDLE, ServeOptions, serve
  from selfdrive_glue.errors import UserError
  if args.max_frames < 0:
    raise UserError(f"--max-frames must be 0 (run until stopped) or more, not {args.max_frames}")
  logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
  artifact = args.artifact or str(DEFAULT_BUNDLE)
  if (Path(artifact) / MANIFEST).exists():
    verify_artifact(artifact)  # refuse early, before waiting for cameras
  return serve(ServeOptions(artifact, None if args.demo else args.car_params, args.server, args.max_frames, not args.no_realtime,
                            use_params=not args.demo))
