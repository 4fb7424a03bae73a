"""`modeld-msm serve`: run as openpilot's modeld process."""
from __future__ import annotations

HELP = "run as openpilot's modeld process"


def add_arguments(p) -> None:
  p.add_argument("--artifact", required=True,
                 help="artifact directory (modeld-msm compile), or a bundle with one per camera size; its device picks the backend")
  p.add_argument("--car-params", help="serialized car.CarParams (default: openpilot's Params, else demo defaults)")
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
  import os
  from pathlib import Path

  from compile.artifact import MANIFEST, verify_artifact
  from modeld_msm.modeld import ServeOptions, serve
  logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
  if (Path(args.artifact) / MANIFEST).exists():
    verify_artifact(args.artifact)  # refuse early, before waiting for cameras
  return serve(ServeOptions(args.artifact, args.car_params, args.server, args.max_frames, not args.no_realtime))
