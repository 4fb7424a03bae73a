"""`modeld-msm demo`: the README's main job."""
from __future__ import annotations

from pathlib import Path

from artifact import kinds
from offcar.demo import DemoOptions, print_summary, run_demo
from selfdrive_glue.argtypes import integer, real
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import parse_camera


def add_arguments(p) -> None:
  p.add_argument("--full", action="store_true", help="use the full-size reference models (first compile takes minutes)")
  p.add_argument("--seconds", type=real(0, lo_open=True), default=20.0, help="length of the drive (default 20)")
  p.add_argument("--out", type=Path, default=Path("demo-out"), help="where summary.json and plan.png go (default ./demo-out)")
  p.add_argument("--camera", default="1928x1208", help="1928x1208 or 1344x760")
  p.add_argument("--seed", type=integer(0), default=0, help="road scene seed")
  p.add_argument("--random-weights", action="store_true",
                 help="the random-weight reference models instead of the trained tiny stand-in: the pipeline runs the same, but "
                      "the outputs are noise and the error against the rendered road says so (--full always has random weights)")
  p.add_argument("--no-dm", action="store_true", help="without the driver camera and dmonitoringmodeld (modeld alone)")
  p.add_argument("--kind", "--contract", dest="kind", choices=[n for n in kinds.choices() if kinds.get(n).process == "modeld"],
                 default=kinds.DEFAULT.name,
                 help="driving: openpilot 0.11's vision + policy pair (default); supercombo: the same weights fused into master's "
                      "combined model (24 past features, action_t, an action head), compiled with --model and served the same way")


def run(args) -> int:
  parse_camera(args.camera)
  if args.seconds <= 0:
    raise UserError("--seconds must be positive")
  s = run_demo(DemoOptions(full=args.full, seconds=args.seconds, out=args.out, camera=args.camera, seed=args.seed,
                           random_weights=args.random_weights, dm=not args.no_dm, kind=kinds.get(args.kind).name))
  print_summary(s)
  print(f"\n  wrote {args.out / 'summary.json'} and {args.out / 'plan.png'}" + (f" and {args.out / 'dm.png'}" if not args.no_dm else ""))
  return 0 if s["frames_received"] else 1
