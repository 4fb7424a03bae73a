"""Driver-monitoring training data: rendered cabins (selfdrive_glue/cabin_render.py), warped by dmonitoringmodeld's own
warp, with the renderer's truth.

A scene is one CabinScene seed on one of the two driver cameras (1928x1208 and 1344x760, alternating, so one model
serves both artifacts) under a calibration drawn for it, sampled at `frames` times: for training half uniform over the
scene's 60 s segment (faces, the no-face and the sunglasses stretches at their natural rates), a quarter inside eye
closures (0.2 s of every 2.5-4 s: too rare to learn from uniform samples), a quarter inside the no-face stretch; for
evaluation all uniform (the rates a drive has). Frames are
warped with compile/programs/dm_warp.py's numpy twin of the device warp (held to it by tests/test_dmonitoring.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compile.programs.dm_warp import warp_y_numpy
from offcar.train.data import rendered
from selfdrive_glue.cabin_render import BLINK_S, SEGMENT, CabinScene, CabinTruth
from selfdrive_glue.camera import DM_INPUT_SIZE, dm_warp_matrix

CAMERAS = ("1928x1208", "1344x760")


@dataclass
class Cabins:
  images: np.ndarray            # (N, 1440*960) uint8: the model's input_img
  calib: np.ndarray             # (N, 3) float32: the model's calib (rpyCalib)
  truths: list[CabinTruth]
  position: np.ndarray          # (N, 2) float32: the head centre in the warped image, over its width/height, from its centre
  camera: list[str]

  def __len__(self) -> int:
    return len(self.truths)


def scene_calib(seed: int, max_rad: float) -> tuple[float, float, float]:
  """A calibration for a training scene: pitch and yaw up to max_rad, a small roll (which the picture does not show)."""
  rng = np.random.default_rng([seed, 11])
  return float(rng.uniform(-0.02, 0.02)), float(rng.uniform(-max_rad, max_rad)), float(rng.uniform(-max_rad, max_rad))


def sample_times(scene: CabinScene, n: int, rng, oversample: bool = True) -> np.ndarray:
  """n scene times; oversample: a quarter in eye closures and a quarter without a face (training), else uniform."""
  t = rng.uniform(0, SEGMENT, n)
  if not oversample:
    return t
  closed = rng.permutation(n)[:n // 4]
  blinks = rng.integers(0, int(SEGMENT / 2.5), len(closed))
  t[closed] = [scene.blink_start(int(k)) + rng.uniform(0.01, BLINK_S - 0.01) for k in blinks]
  rest = np.setdiff1d(np.arange(n), closed)
  no_face = rng.permutation(rest)[:n // 4]
  start, length = scene.no_face
  t[no_face] = start + rng.uniform(0, length, len(no_face))
  return t % SEGMENT


def head_position(truth: CabinTruth, camera: str) -> tuple[float, float]:
  """Where the head centre lands in the warped image, relative to its centre, over its width and height."""
  w, h = map(int, camera.split("x"))
  cam = np.array([w / 2 + truth.x * w, h / 2 + truth.y * h, 1.0])
  dm = np.linalg.solve(dm_warp_matrix(w).astype(np.float64), cam)
  return float(dm[0] / dm[2] / DM_INPUT_SIZE[0] - 0.5), float(dm[1] / dm[2] / DM_INPUT_SIZE[1] - 0.5)


def _render_scene(job: tuple[int, str, int, float, bool]) -> list[tuple[np.ndarray, tuple, CabinTruth, tuple[float, float]]]:
  """One scene's warped frames; runs in a worker process, numpy only."""
  seed, camera, n, calib_max, oversample = job
  calib = scene_calib(seed, calib_max)
  scene = CabinScene(seed, camera, calib)
  M = dm_warp_matrix(scene.info.width)
  buf = np.zeros(scene.info.size, np.uint8)
  out = []
  for t in sample_times(scene, n, np.random.default_rng([seed, 12]), oversample):
    scene.render_into(buf, float(t))
    tr = scene.truth(float(t))
    out.append((warp_y_numpy(buf, M, scene.info, *DM_INPUT_SIZE), calib, tr, head_position(tr, camera)))
  return out


def render_cabins(seeds: list[int], frames: int, calib_max: float, oversample: bool = True, workers: int = 0,
                  progress: bool = True) -> Cabins:
  """`frames` warped frames of each seed's cabin (times by sample_times); seed i is seen by CAMERAS[i % 2]. `workers` > 1
  renders in that many processes."""
  jobs = [(seed, CAMERAS[i % 2], frames, calib_max, oversample) for i, seed in enumerate(seeds)]
  n = len(seeds) * frames
  images = np.zeros((n, DM_INPUT_SIZE[0] * DM_INPUT_SIZE[1]), np.uint8)
  calib, position = np.zeros((n, 3), np.float32), np.zeros((n, 2), np.float32)
  truths: list[CabinTruth] = []
  cameras: list[str] = []
  i = 0
  for scene, scene_frames in enumerate(rendered(_render_scene, jobs, workers, n, "render+warp cabins", progress)):
    camera = jobs[scene][1]
    for img, c, tr, pos in scene_frames:
      images[i], calib[i], position[i] = img, c, pos
      truths.append(tr)
      cameras.append(camera)
      i += 1
  return Cabins(images, calib, truths, position, cameras)
