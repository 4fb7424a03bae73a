"""`modeld-msm train`: the trained stand-in model's recipe (tiny vision + policy on rendered drives), from a seed."""
from __future__ import annotations

from pathlib import Path

from offcar.train.recipe import Recipe, train
from selfdrive_glue.argtypes import integer, real
from selfdrive_glue.errors import UserError


def add_arguments(p) -> None:
  d = Recipe()
  p.add_argument("-o", "--output", required=True, metavar="DIR", help="where driving_vision.onnx, driving_policy.onnx and recipe.json go")
  p.add_argument("--seed", type=integer(0), default=d.seed, help=f"initial weights, training drives and batch order (default {d.seed})")
  p.add_argument("--drives", type=integer(1), default=d.train_drives, help=f"training drives, one scene seed each (default {d.train_drives})")
  p.add_argument("--eval-drives", type=integer(1), default=d.eval_drives,
                 help=f"held-out drives, seeds disjoint from training (default {d.eval_drives})")
  p.add_argument("--frames", type=integer(2), default=d.frames_per_drive, help=f"frames per drive, 0.2 s apart (default {d.frames_per_drive})")
  p.add_argument("--vision-steps", type=integer(0), default=d.vision_steps, help=f"(default {d.vision_steps})")
  p.add_argument("--policy-steps", type=integer(0), default=d.policy_steps, help=f"(default {d.policy_steps})")
  p.add_argument("--batch", type=integer(1), default=d.batch, help=f"(default {d.batch})")
  p.add_argument("--lr", type=real(0, lo_open=True), default=d.lr, help=f"Adam peak learning rate (default {d.lr})")
  p.add_argument("--vision-onnx", metavar="PATH", help="start from this recipe's trained vision (stage 1 skipped)")
  p.add_argument("--workers", type=integer(0), default=d.workers, help="render processes (default: render in this process)")
  p.epilog = "The device is tinygrad's default: DEV=CUDA modeld-msm train ... on an NVIDIA GPU, the CPU otherwise."


def run(args) -> int:

  for name in ("drives", "eval_drives", "frames", "vision_steps", "policy_steps", "batch"):
    if getattr(args, name) < 1:
      raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.frames < 2:
    raise UserError("--frames must be >= 2: a vision input needs the previous frame")
  if args.batch > args.drives * (args.frames - 1):
    raise UserError(f"--batch {args.batch} is larger than the {args.drives * (args.frames - 1)} training pairs; lower it or add drives")
  out = Path(args.output)
  if out.exists() and not out.is_dir():
    raise UserError(f"{out} exists and is not a directory")
  recipe = Recipe(seed=args.seed, train_drives=args.drives, eval_drives=args.eval_drives, frames_per_drive=args.frames,
                  vision_steps=args.vision_steps, policy_steps=args.policy_steps, batch=args.batch, lr=args.lr, workers=args.workers)
  vision = None
  if args.vision_onnx:
    import onnx
    if not Path(args.vision_onnx).is_file():
      raise UserError(f"--vision-onnx {args.vision_onnx} does not exist")
    vision = onnx.load(args.vision_onnx)
  info = train(recipe, out, vision_onnx=vision)
  m = info["metrics"]
  print(f"{out}: held-out lane error at 20 m p50 {m['lane_error_m_p50']:.3f} m (p90 {m['lane_error_m_p90']:.3f}), "
        f"curvature corr {m['curvature_corr']:.3f}, {m['frames']} frames; {info['train_seconds']:.0f} s")
  return 0
