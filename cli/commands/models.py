"""`modeld-msm models`: write the reference driving_vision.onnx / driving_policy.onnx pair."""
from __future__ import annotations

from compile.refmodels import write_models
from selfdrive_glue.argtypes import integer
from selfdrive_glue.errors import UserError


def add_arguments(parser) -> None:
  parser.add_argument("--size", choices=("tiny", "full"), default="tiny", help="tiny: a few small layers for tests; full: openpilot 0.11.1's budget")
  parser.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write the two .onnx files into (created if missing)")
  parser.add_argument("--seed", type=integer(0), default=0, help="weight seed; the same seed writes identical bytes (default 0)")


def run(args) -> int:
  if args.seed < 0:
    raise UserError(f"--seed must be >= 0, got {args.seed}")
  for kind, w in write_models(args.output, args.size, args.seed).items():
    print(f"{w.path}  {kind} {args.size} seed={args.seed}  {w.bytes / 1e6:.2f} MB  {w.macs / 1e6:.1f} M MACs  {w.params / 1e6:.2f} M params")
  return 0
