"""`modeld-msm models`: write reference models with openpilot's I/O contracts: the driving pair (driving_vision.onnx +
driving_policy.onnx), master's combined driving model (driving_supercombo.onnx, the pair of the same seed fused), master's
stateful driving model (driving_supercombo.onnx since 2026-09: the same fused pair with its history queues in the graph) or the
driver-monitoring model (dmonitoring_model.onnx)."""
from __future__ import annotations

from pathlib import Path

from artifact import kinds
from compile.programs import recipe_of
from selfdrive_glue.argtypes import integer
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import refuse_overwrite

FILES = {"driving": ("driving_vision.onnx", "driving_policy.onnx"), "supercombo": ("driving_supercombo.onnx",),
         "dmonitoring": ("dmonitoring_model.onnx",)}


def add_arguments(parser) -> None:
  parser.add_argument("--kind", "--contract", dest="kind", choices=kinds.choices(), default=kinds.DEFAULT.name,
                      help="driving: 0.11's vision + policy pair (default); supercombo: master's combined driving model (the pair of "
                           "this seed fused into one graph, with an action head); stateful: master's model since 2026-09 (the same fused pair, "
                           "its history queues as state_*/next_state_* pairs in the graph); dmonitoring: the driver-monitoring model")
  parser.add_argument("--size", choices=("tiny", "full"), default="tiny", help="tiny: a few small layers for tests; full: the shipped size class "
                      "(0.11.1's pair, master's 96.6 MB combined file, the 60.7 MB stateful file, the DM's ~7.5 MB)")
  parser.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write the .onnx file(s) into (created if missing)")
  parser.add_argument("--seed", type=integer(0), default=0, help="weight seed; the same seed writes identical bytes (default 0)")
  parser.add_argument("--stand-in", action="store_true", help="the trained tiny stand-in's weights (those the demo runs) instead of random ones")
  parser.add_argument("--force", action="store_true", help="overwrite model files of the same names already in DIR (openpilot's own names)")


def run(args) -> int:
  if args.seed < 0:
    raise UserError(f"--seed must be >= 0, got {args.seed}")
  if args.stand_in and args.size != "tiny":
    raise UserError("--stand-in is the trained tiny model; it has no full size (drop --stand-in or use --size tiny)")
  kind = kinds.get(args.kind)
  refuse_overwrite([Path(args.output) / n for n in kind.model_files], args.force)
  written = recipe_of(kind).write_models(args.output, args.size, args.seed, stand_in=args.stand_in)
  weights = "stand-in" if args.stand_in else f"seed={args.seed}"
  for kind, w in written.items():
    print(f"{w.path}  {kind} {args.size} {weights}  {w.bytes / 1e6:.2f} MB  {w.macs / 1e6:.1f} M MACs  {w.params / 1e6:.2f} M params")
  return 0
