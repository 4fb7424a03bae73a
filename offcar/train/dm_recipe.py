"""The driver-monitoring stand-in's recipe: the tiny reference DM graph trained on rendered cabins, from a seed, with
tinygrad (offcar/train/graph.py: the graph trained is the graph shipped), evaluated on held-out cabins with onnxruntime
on the exported fp16 model, through the parser dmonitoringmodeld uses.

Training scenes, held-out scenes and the demo's cabin (seed 0 up) come from disjoint seed ranges.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compile.refmodels.dmonitoring import DM_SLICES, DM_WIDTH, build_dm_model
from modeld_msm.dm_outputs import parse_dm_outputs
from offcar import dm_accuracy
from offcar.train.dm_data import Cabins, render_cabins
from offcar.train.dm_targets import dm_targets
from offcar.train.graph import TrainableGraph
from offcar.train.recipe import fit
from selfdrive_glue.files import write_atomic


@dataclass(frozen=True)
class DMRecipe:
  seed: int = 0
  train_scenes: int = 480
  frames_per_scene: int = 16
  eval_scenes: int = 8
  eval_frames: int = 150       # per held-out scene, uniform over its 60 s: the rates a drive has
  calib_max: float = 0.1       # rad, pitch and yaw of the training calibrations (openpilot accepts up to ~0.17 for pitch)
  steps: int = 3000
  batch: int = 64
  lr: float = 2e-3
  workers: int = 0

  def train_seeds(self) -> list[int]:
    return [20_000_000 + 1000 * self.seed + i for i in range(self.train_scenes)]

  def eval_seeds(self) -> list[int]:
    return [30_000_000 + 1000 * self.seed + i for i in range(self.eval_scenes)]


def checkpoint_name(seed: int) -> str:
  return f"modeld-msm-dm-stand-in-tiny-seed{seed}"


def predict(model: Any, cabins: Cabins) -> list[dm_accuracy.DMPrediction]:
  """The exported model on every frame (onnxruntime, batch 1 as dmonitoringmodeld runs it), parsed as it parses."""
  import onnxruntime as ort
  sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
  out = []
  for i in range(len(cabins)):
    raw = sess.run(None, {"input_img": cabins.images[i:i + 1], "calib": cabins.calib[i:i + 1]})[0][0]
    out.append(dm_accuracy.from_parsed(parse_dm_outputs(raw, DM_SLICES), i, cabins.truths[i].t))
  return out


def evaluate(model: Any, cabins: Cabins) -> dict:
  preds = predict(model, cabins)
  acc = dm_accuracy.evaluate_truths(cabins.truths, preds)
  per_camera = {}
  for cam in sorted(set(cabins.camera)):
    idx = [i for i, c in enumerate(cabins.camera) if c == cam]
    per_camera[cam] = dm_accuracy.evaluate_truths([cabins.truths[i] for i in idx], [preds[i] for i in idx]).summary()
  return acc.summary() | {"per_camera": per_camera}


def _trained(recipe: DMRecipe, log) -> tuple[Any, list[float]]:
  """Render the training cabins, fit, export: (the fp16 ModelProto, the losses). The frames (GBs) go when it returns."""
  from onnx import helper

  log(f"[train-dm] rendering {recipe.train_scenes} training cabins x {recipe.frames_per_scene} frames")
  cabins = render_cabins(recipe.train_seeds(), recipe.frames_per_scene, recipe.calib_max, workers=recipe.workers)
  graph = TrainableGraph(build_dm_model("tiny", recipe.seed), DM_WIDTH)

  def feeds(idx):
    return {"input_img": cabins.images[idx], "calib": cabins.calib[idx]}

  losses = fit(graph, feeds, dm_targets(cabins), len(cabins), recipe.steps, recipe.batch, recipe.lr,
               np.random.default_rng([recipe.seed, 3]), "dmonitoring", log)
  model = graph.export()
  props = {p.key: p.value for p in model.metadata_props} | {"model_checkpoint": checkpoint_name(recipe.seed)}
  del model.metadata_props[:]
  helper.set_model_props(model, props)
  return model, losses


def train_dm(recipe: DMRecipe, out_dir: Path, log=print) -> dict:
  """Train, evaluate on held-out cabins and write dmonitoring_model.onnx + dm_recipe.json (recipe and metrics) to out_dir."""
  t_start = time.monotonic()
  model, losses = _trained(recipe, log)
  log(f"[train-dm] evaluating on {recipe.eval_scenes} held-out cabins x {recipe.eval_frames} frames")
  held_out = render_cabins(recipe.eval_seeds(), recipe.eval_frames, recipe.calib_max, oversample=False, workers=recipe.workers)
  metrics = evaluate(model, held_out)
  out_dir.mkdir(parents=True, exist_ok=True)
  write_atomic(out_dir / "dmonitoring_model.onnx", model.SerializeToString())
  window = max(1, min(50, len(losses) // 4))
  info = {"recipe": asdict(recipe), "metrics": metrics,
          "loss_first_last": [float(np.mean(losses[:window])), float(np.mean(losses[-window:]))],
          "train_seconds": round(time.monotonic() - t_start, 1)}
  write_atomic(out_dir / "dm_recipe.json", (json.dumps(info, indent=2) + "\n").encode())
  return info
