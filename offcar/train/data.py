"""Training data: rendered drives, warped by modeld's own warp, with the renderer's truth as targets.

A drive is one RoadScene seed sampled every 0.2 s (FRAME_SKIP model frames at 20 Hz): exactly the spacing of the two
frames stacked in the vision input (queue rows t-4 and t) and of the policy's feature history, so frame k's vision input
is (warp k-1, warp k) and its features buffer is the hidden states of frames k-24..k (zeros before the drive starts,
as modeld's queues start). Frames are warped with compile/programs/warp.py's numpy twin of modeld's `warp_nv12` (held to it by
tests/test_warp.py) under the transforms modeld computes from the scene's calibration (`model_transforms`), in the
render worker processes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compile.programs.warp import warp_nv12_numpy
from modeld_msm.constants import INPUT_HISTORY_BUFFER_LEN as HISTORY  # the policy's feature queue, frames
from selfdrive_glue.camera import model_transforms, sensor_and_device
from selfdrive_glue.road_render import RoadScene
from selfdrive_glue.road_truth import Truth, truth

STEP_S = 0.2   # FRAME_SKIP / MODEL_RUN_FREQ


@dataclass
class Drives:
  frames: np.ndarray     # (N, 2, 6, 128, 256) uint8: (road warped to the medmodel frame, wide warped to sbigmodel)
  drive: np.ndarray      # (N,) drive number
  k: np.ndarray          # (N,) frame number within its drive
  truths: list[Truth]
  seeds: list[int]
  camera: str

  def __len__(self) -> int:
    return len(self.truths)

  def vision_input(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(img, big_img) uint8 (B, 12, 128, 256): the previous frame (zeros at a drive's start) then the frame itself."""
    first = self.k[idx] == 0
    out = []
    for cam in (0, 1):
      x = np.empty((len(idx), 12, 128, 256), np.uint8)
      x[:, :6] = self.frames[np.maximum(idx - 1, 0), cam]
      x[first, :6] = 0
      x[:, 6:] = self.frames[idx, cam]
      out.append(x)
    return out[0], out[1]


def _render_drive(job: tuple[int, str, int, float]) -> list[tuple[np.ndarray, np.ndarray, Truth]]:
  """One drive's warped (road, wide) frames and truths; runs in a worker process, numpy only."""
  seed, camera, n, t0 = job
  scene = RoadScene(seed, camera)
  sensor, device = sensor_and_device(camera)
  tfm, big_tfm = model_transforms(scene.calib_rpy, device, sensor, False)
  buf = np.zeros(scene.info.size, np.uint8)
  out = []
  for j in range(n):
    t = t0 + j * STEP_S
    scene.render_into(buf, t, "road")
    road = warp_nv12_numpy(buf, tfm, scene.info)
    scene.render_into(buf, t, "wide")
    out.append((road, warp_nv12_numpy(buf, big_tfm, scene.info), truth(scene, t)))
  return out


def rendered(render, jobs: list, workers: int, total: int, desc: str, progress: bool):
  """Yield render(job) for every job, in order: in `workers` forked processes when > 1, here otherwise; a progress bar
  over the `total` frames the results hold. The pool is ended however the caller stops."""
  import multiprocessing as mp

  from tqdm import tqdm
  pool = mp.get_context("fork").Pool(workers) if workers > 1 else None
  bar = tqdm(total=total, desc=desc, unit="frame", disable=not progress, mininterval=2)
  try:
    for out in (pool.imap(render, jobs) if pool is not None else map(render, jobs)):
      bar.update(len(out))
      yield out
  finally:
    if pool is not None:
      pool.terminate()
    bar.close()


def render_drives(seeds: list[int], frames_per_drive: int, camera: str = "1928x1208", start_s: float = 0.0,
                  workers: int = 0, progress: bool = True) -> Drives:
  """Render `frames_per_drive` frames 0.2 s apart for every seed. A drive starts at a seed-chosen time in
  [start_s, start_s + 300) so drives differ in blinkers, curvature phase and lead gap, not only in scene.
  `workers` > 1 renders drives in that many processes."""
  jobs = [(seed, camera, frames_per_drive, start_s + float(np.random.default_rng([seed, 7]).uniform(0, 300))) for seed in seeds]
  n = len(seeds) * frames_per_drive
  frames = np.zeros((n, 2, 6, 128, 256), np.uint8)
  drive, k, truths = np.zeros(n, np.int32), np.zeros(n, np.int32), []
  i = 0
  for d, drive_frames in enumerate(rendered(_render_drive, jobs, workers, n, "render+warp", progress)):
    for j, (road, wide, tr) in enumerate(drive_frames):
      frames[i, 0], frames[i, 1] = road, wide
      drive[i], k[i] = d, j
      truths.append(tr)
      i += 1
  return Drives(frames, drive, k, truths, list(seeds), camera)


def feature_buffers(hidden: np.ndarray, drives: Drives, idx: np.ndarray) -> np.ndarray:
  """(B, 25, 512): for each frame, the hidden states of frames k-24..k of its drive, zeros before the drive's start."""
  back = np.arange(-HISTORY + 1, 1)
  src = idx[:, None] + back[None, :]
  valid = back[None, :] >= -drives.k[idx][:, None]
  return np.where(valid[:, :, None], hidden[np.where(valid, src, 0)], 0).astype(np.float32)
