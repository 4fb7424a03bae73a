"""The stand-in model's recipe: tiny vision + policy trained on rendered drives, from a seed, with tinygrad.

Two stages, because the policy reads 25 vision outputs spread over 5 s:
1. vision alone, on (previous, current) frame pairs, against lane lines, road edges, lead, pose (ego speed and yaw rate:
   this is what puts speed into the features the policy reads) and the line/lead probabilities;
2. policy alone, on the frozen vision's hidden states stacked as modeld stacks them (frames k-24..k, zeros before the
   drive starts), against the plan (which carries desiredCurvature through its yaw and yaw rate).
Both start from the tiny reference graph's weights for the recipe seed and export into that same graph, fp16.
"""
from __future__ import annotations

import json
import math
import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compile.refmodels.driving import POLICY_WIDTH, VISION_SLICES, build_model
from offcar.train.data import HISTORY, Drives, feature_buffers, render_drives
from offcar.train.evaluate import evaluate
from offcar.train.graph import TrainableGraph
from offcar.train.targets import Targets, loss, policy_targets, vision_targets
from selfdrive_glue.files import write_atomic


@dataclass(frozen=True)
class Recipe:
  seed: int = 0
  camera: str = "1928x1208"
  train_drives: int = 200
  eval_drives: int = 16
  frames_per_drive: int = 80   # 16 s: most samples see a full 5 s feature history, as modeld does after its first 5 s
  vision_steps: int = 3500
  policy_steps: int = 4000
  batch: int = 64
  lr: float = 2e-3
  workers: int = 0       # render processes (0: render here)

  def train_seeds(self) -> list[int]:
    return [1000 * self.seed + i for i in range(self.train_drives)]

  def eval_seeds(self) -> list[int]:
    # held out: a disjoint seed range, so scenes, calibrations and lane widths differ from every training drive
    return [10_000_000 + 1000 * self.seed + i for i in range(self.eval_drives)]


def _prefetch(it, depth: int = 4):
  """Yield from `it`, produced by a background thread: batch assembly (large numpy gathers, which release the GIL)
  overlaps the device step. Order is unchanged, so runs stay reproducible."""
  q: queue.Queue = queue.Queue(depth)
  done = object()

  def fill():
    try:
      for x in it:
        q.put(x)
    finally:
      q.put(done)

  threading.Thread(target=fill, daemon=True).start()
  while (x := q.get()) is not done:
    yield x


def fit(graph: TrainableGraph, feeds_of, targets: Targets, n: int, steps: int, batch: int, lr: float, rng, label: str, log) -> list[float]:
  from tinygrad import Tensor, TinyJit
  from tinygrad.helpers import Context
  from tinygrad.nn.optim import Adam
  from tqdm import tqdm

  scale, offset = targets.affine()
  graph.set_output_affine(scale, offset)
  opt = Adam(list(graph.params.values()), lr=lr)
  scale_t = Tensor(scale)

  @TinyJit
  def step(feeds: dict[str, Any], y: Any, w: Any) -> Any:
    opt.zero_grad()
    out = graph(feeds)
    lv = loss(out, y, w, scale_t, targets).backward()
    return lv.realize(*opt.schedule_step())

  def batches():
    for _ in range(steps):
      idx = np.sort(rng.choice(n, batch, replace=False))
      yield feeds_of(idx), targets.y[idx], targets.w[idx]

  warmup = max(1, min(100, steps // 10))
  window = max(1, min(50, steps // 4))   # first and last losses are averaged over this many steps
  losses: list[float] = []
  bar = tqdm(_prefetch(batches()), total=steps, desc=label, unit="step", mininterval=2)
  with Context(TRAINING=1):
    for i, (feeds_np, y, w) in enumerate(bar):
      # cosine decay with a short warm-up: the fold makes the first steps large otherwise
      f = min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * i / steps))
      opt.lr.assign(Tensor([lr * f], dtype=opt.lr.dtype)).realize()
      lv = float(step({k: Tensor(v) for k, v in feeds_np.items()}, Tensor(y), Tensor(w)).item())
      losses.append(lv)
      if i % 50 == 0:
        bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
  log(f"[train] {label}: loss {np.mean(losses[:window]):.3f} -> {np.mean(losses[-window:]):.3f} over {steps} steps")
  return losses


def _named(model: Any, recipe: Recipe) -> Any:
  from onnx import helper
  props = {p.key: p.value for p in model.metadata_props}
  props["model_checkpoint"] = f"modeld-msm-stand-in-tiny-seed{recipe.seed}"
  del model.metadata_props[:]
  helper.set_model_props(model, props)
  return model


def hidden_states(vision_onnx: Any, drives: Drives) -> np.ndarray:
  """(N, 512) hidden states of every frame as the shipped fp16 vision computes them (onnxruntime, batch 1 like modeld)."""
  import onnxruntime as ort
  sess = ort.InferenceSession(vision_onnx.SerializeToString(), providers=["CPUExecutionProvider"])
  hs = VISION_SLICES["hidden_state"]
  out = np.zeros((len(drives), hs.stop - hs.start), np.float32)
  for i in range(len(drives)):
    img, big = drives.vision_input(np.array([i]))
    out[i] = sess.run(None, {"img": img, "big_img": big})[0][0, hs].astype(np.float32)
  return out


def train(recipe: Recipe, out_dir: Path, log=print, vision_onnx: Any = None) -> dict:
  """Train both models and write driving_vision.onnx, driving_policy.onnx and recipe.json (recipe + metrics) to out_dir.
  vision_onnx: a vision trained earlier by this recipe (stage 1 is skipped; the policy stage is the same)."""
  t_start = time.monotonic()
  log(f"[train] rendering {recipe.train_drives} training drives x {recipe.frames_per_drive} frames")
  drives = render_drives(recipe.train_seeds(), recipe.frames_per_drive, recipe.camera, workers=recipe.workers)

  out_dir.mkdir(parents=True, exist_ok=True)
  if vision_onnx is None:
    vision = TrainableGraph(build_model("vision", "tiny", recipe.seed), VISION_SLICES["hidden_state"].stop)
    pairs = np.nonzero(drives.k > 0)[0]

    def vision_feeds(idx):
      img, big = drives.vision_input(pairs[idx])
      return {"img": img, "big_img": big}

    vt = vision_targets([drives.truths[i] for i in pairs])
    fit(vision, vision_feeds, vt, len(pairs), recipe.vision_steps, recipe.batch, recipe.lr,
         np.random.default_rng([recipe.seed, 1]), "vision", log)
    vision_onnx = _named(vision.export(), recipe)
    write_atomic(out_dir / "driving_vision.onnx", vision_onnx.SerializeToString())   # a later failure keeps stage 1

  log("[train] hidden states of every frame through the exported (fp16) vision")
  hidden = hidden_states(vision_onnx, drives)
  policy = TrainableGraph(build_model("policy", "tiny", recipe.seed), POLICY_WIDTH)
  rng = np.random.default_rng([recipe.seed, 2])   # its own stream: the policy stage is the same whether stage 1 ran here or not
  tc = np.zeros((len(drives), 1, 2), np.float32)
  tc[np.arange(len(drives)), 0, rng.integers(0, 2, len(drives))] = 1   # the scenes do not depend on the side of the road

  def policy_feeds(idx):
    return {"features_buffer": feature_buffers(hidden, drives, idx), "desire_pulse": np.zeros((len(idx), HISTORY, 8), np.float32),
            "traffic_convention": tc[idx, 0]}

  pt = policy_targets(drives.truths)
  fit(policy, policy_feeds, pt, len(drives), recipe.policy_steps, recipe.batch, recipe.lr, rng, "policy", log)
  policy_onnx = _named(policy.export(), recipe)

  log(f"[train] evaluating on {recipe.eval_drives} held-out drives")
  held_out = render_drives(recipe.eval_seeds(), recipe.frames_per_drive, recipe.camera, workers=recipe.workers)
  metrics = evaluate(vision_onnx, policy_onnx, held_out)
  for kind, m in (("vision", vision_onnx), ("policy", policy_onnx)):
    write_atomic(out_dir / f"driving_{kind}.onnx", m.SerializeToString())
  info = {"recipe": asdict(recipe), "metrics": metrics, "train_seconds": round(time.monotonic() - t_start, 1)}
  write_atomic(out_dir / "recipe.json", (json.dumps(info, indent=2) + "\n").encode())
  return info
