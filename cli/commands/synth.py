"""`modeld-msm synth`: write a synthetic drive segment (rlog + HEVC) from procedurally rendered roads."""
from __future__ import annotations

from selfdrive_glue.argtypes import integer, real
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import parse_camera
from selfdrive_glue.synth import synth_route, synth_segment


def add_arguments(p) -> None:
  p.add_argument("-o", "--output", required=True, metavar="SEGDIR",
                 help="segment directory to write (with --segments N: the parent folder of <route>--0 .. <route>--N-1)")
  p.add_argument("--seconds", type=real(0, lo_open=True), default=60.0,
                 help="length of each segment in seconds (default 60, openpilot's segment length)")
  p.add_argument("--seed", type=integer(0), default=0, help="scene seed; the same seed writes the same drive (default 0)")
  p.add_argument("--camera", default="1928x1208", help="camera size: 1928x1208 (ar0231/ox03c10, tici) or 1344x760 (os04c10, mici)")
  p.add_argument("--segments", type=integer(1), default=1, help="consecutive segments of one drive (default 1)")
  p.add_argument("--no-wide", action="store_true", help="road camera only (no ecamera.hevc / wideRoadCameraState)")
  p.add_argument("--no-qcamera", action="store_true", help="skip qcamera.ts")
  p.add_argument("--no-encode-index", action="store_true",
                 help="old-shaped segment: no initData or roadEncodeIdx/wideRoadEncodeIdx, and video frame k is camera state k "
                      "(default: real-shaped, the videos start 2 frames late in segment 0 and one road frame is dropped)")
  p.add_argument("--driver", action="store_true",
                 help="also the driver camera: dcamera.hevc (a rendered cabin: a head turning, blinking, a stretch without a face and "
                      "one with sunglasses) with driverCameraState and driverEncodeIdx, for replaying dmonitoringmodeld")
  p.add_argument("--force", action="store_true", help="replace an existing non-empty output directory")
  p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
  parse_camera(args.camera)
  if args.segments < 1:
    raise UserError(f"--segments must be >= 1, got {args.segments}")
  if args.seed < 0:
    raise UserError(f"--seed must be >= 0, got {args.seed}")
  kw = dict(wide=not args.no_wide, qcamera=not args.no_qcamera, progress=not args.quiet, overwrite=args.force, encode_index=not args.no_encode_index,
            driver=args.driver)
  if args.segments == 1:
    results = [synth_segment(args.output, args.seconds, args.seed, args.camera, **kw)]
  else:
    results = synth_route(args.output, args.segments, args.seconds, args.seed, args.camera, **kw)
  for r in results:
    print(f"{r.path}  {r.frames} frames ({r.encoded} encoded)  {r.events} events  {args.camera}  seed={args.seed}")
  return 0
