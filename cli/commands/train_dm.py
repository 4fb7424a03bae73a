"""`modeld-msm train-dm`: the driver-monitoring stand-in's recipe (the tiny DM graph on rendered cabins), from a seed."""
from __future__ import annotations

from pathlib import Path

from offcar.train.dm_recipe import DMRecipe, train_dm
from selfdrive_glue.argtypes import integer, real
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import refuse_overwrite, write_atomic


def add_arguments(p) -> None:
  d = DMRecipe()
  p.add_argument("-o", "--output", required=True, metavar="DIR", help="where dmonitoring_model.onnx and dm_recipe.json go")
  p.add_argument("--seed", type=integer(0), default=d.seed, help=f"initial weights, training cabins and batch order (default {d.seed})")
  p.add_argument("--scenes", type=integer(1), default=d.train_scenes, help=f"training cabins, one seed each (default {d.train_scenes})")
  p.add_argument("--frames", type=integer(1), default=d.frames_per_scene, help=f"frames per training cabin (default {d.frames_per_scene})")
  p.add_argument("--eval-scenes", type=integer(1), default=d.eval_scenes, help=f"held-out cabins (default {d.eval_scenes})")
  p.add_argument("--eval-frames", type=integer(1), default=d.eval_frames, help=f"frames per held-out cabin (default {d.eval_frames})")
  p.add_argument("--steps", type=integer(1), default=d.steps, help=f"(default {d.steps})")
  p.add_argument("--batch", type=integer(1), default=d.batch, help=f"(default {d.batch})")
  p.add_argument("--lr", type=real(0, lo_open=True), default=d.lr, help=f"Adam peak learning rate (default {d.lr})")
  p.add_argument("--workers", type=integer(0), default=d.workers, help="render processes (default: render in this process)")
  p.add_argument("--force", action="store_true", help="overwrite dmonitoring_model.onnx and dm_recipe.json already in DIR")
  p.epilog = ("The device is tinygrad's default: DEV=CUDA modeld-msm train-dm ... on an NVIDIA GPU (the shipped stand-in: ~5 min on "
              "an H200 with --workers 7), the CPU otherwise (~1 s a step on 2 cores).")


def run(args) -> int:
  if args.batch > args.scenes * args.frames:
    raise UserError(f"--batch {args.batch} is larger than the {args.scenes * args.frames} training frames; lower it or add scenes")
  out = Path(args.output)
  if out.exists() and not out.is_dir():
    raise UserError(f"{out} exists and is not a directory")
  refuse_overwrite([out / "dmonitoring_model.onnx", out / "dm_recipe.json"], args.force)
  out.mkdir(parents=True, exist_ok=True)
  write_atomic(out / ".modeld-msm-write-test", b"")   # a read-only or missing -o fails now (one line), not after the training
  (out / ".modeld-msm-write-test").unlink()
  recipe = DMRecipe(seed=args.seed, train_scenes=args.scenes, frames_per_scene=args.frames, eval_scenes=args.eval_scenes,
                    eval_frames=args.eval_frames, steps=args.steps, batch=args.batch, lr=args.lr, workers=args.workers)
  m = train_dm(recipe, out)["metrics"]

  def f(x, fmt):
    return "n/a" if x is None else format(x, fmt)
  print(f"{out}: held-out face orientation error p50 {f(m['face_orientation_err_deg_p50'], '.2f')} deg "
        f"(p90 {f(m['face_orientation_err_deg_p90'], '.2f')}), faceProb AUC {f(m['face_prob_auc'], '.3f')}, "
        f"blink accuracy {f(m['blink_accuracy'], '.3f')}, {m['dm_frames']} frames")
  return 0
