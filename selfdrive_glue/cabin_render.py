"""A procedural cabin seen by the driver camera, rendered straight into VENUS NV12 buffers, with its truth.

A driver's head (a lit ellipse with eyes, brows, nose and mouth) in front of a dark cabin: its yaw, pitch and roll and
its position move over the drive, the eyes blink, and there is a stretch with no face and a stretch with sunglasses.
Everything is a pure function of (seed, t), like the road scene, so any frame renders in any order and `truth(t)` is
what the picture shows. The face is placed where the left-hand-drive driver sits, left of the image centre by a fixed
offset; wheel_on_right is therefore false throughout.

Angles follow the DM model's outputs: pitch (positive: looking down), yaw (positive: looking to the driver's left,
which the camera sees as a turn to the image's right), roll (positive: the head tilted clockwise in the image); the
renderer draws them as the facial features shifting across the head and the feature layout rotating, a frontal
projection that is monotonic in each angle over the range it uses (|angle| < 0.5 rad).

The truth's angles are the car's frame (where the driver looks relative to the road). The camera is mounted turned by the
device's calibration (`calib_rpy`, liveCalibration's rpyCalib: roll, pitch, yaw), so the picture shows the head at
pitch + calib pitch and yaw + calib yaw: the inverse of dmonitoringd's correction (pitch -= rpyCalib[1], yaw -=
rpyCalib[2], none for roll). A model that outputs the truth must therefore read `calib`, as openpilot's model is fed it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from selfdrive_glue.nv12 import NV12Info, nv12_info

BLINK_S = 0.2            # an eye closure lasts this long
SEGMENT = 60.0           # the no-face and sunglasses stretches repeat with this period (s)


@dataclass(frozen=True)
class CabinTruth:
  t: float
  face: bool               # a face is in the picture
  pitch: float             # rad
  yaw: float
  roll: float
  x: float                 # head centre in the image, relative to the image centre, over the image width
  y: float                 # ... over the image height
  eyes_closed: bool
  sunglasses: bool


class CabinScene:
  def __init__(self, seed: int = 0, camera: str = "1928x1208", calib_rpy: tuple[float, float, float] = (0.0, 0.0, 0.0)):
    self.seed, self.camera = seed, camera
    self.calib_rpy = tuple(float(x) for x in calib_rpy)
    w, h = map(int, camera.split("x"))
    self.info: NV12Info = nv12_info(w, h)
    rng = np.random.default_rng([seed, 7])
    # each angle is a sum of two slow sines (periods 4-13 s), seeded
    self._angles = [(rng.uniform(0.12, 0.22, 2), rng.uniform(2 * math.pi / 13, 2 * math.pi / 4, 2), rng.uniform(0, 2 * math.pi, 2))
                    for _ in range(3)]
    self._pos = [(rng.uniform(0.02, 0.05), rng.uniform(2 * math.pi / 17, 2 * math.pi / 9), rng.uniform(0, 2 * math.pi)) for _ in range(2)]
    self._blink_period = rng.uniform(2.5, 4.0)
    self._blink_phase = rng.uniform(0, self._blink_period)
    self.no_face = (rng.uniform(10, 20), 4.0)        # (start within each SEGMENT, length) s
    self.glasses = (rng.uniform(30, 40), 8.0)
    self.head_h = 0.42 * h                          # the head's height in pixels
    self.scale = w / 1928                           # the 1344x760 fisheye sees the same cabin smaller

  @staticmethod
  def _in(t: float, stretch: tuple[float, float]) -> bool:
    return stretch[0] <= t % SEGMENT < stretch[0] + stretch[1]

  def blink_start(self, k: int) -> float:
    """The scene time the k-th eye closure starts (k may be negative: the closures before t=0)."""
    return (k + 1) * self._blink_period - self._blink_phase

  def truth(self, t: float) -> CabinTruth:
    pitch, yaw, roll = (float(np.sum(a * np.sin(k * t + p))) for a, k, p in self._angles)
    x, y = (-0.08 + a * math.sin(k * t + p) if i == 0 else 0.02 + a * math.sin(k * t + p) for i, (a, k, p) in enumerate(self._pos))
    eyes_closed = (t + self._blink_phase) % self._blink_period < BLINK_S
    return CabinTruth(t, not self._in(t, self.no_face), pitch, yaw, roll, x, y, eyes_closed, self._in(t, self.glasses))

  def render(self, t: float) -> np.ndarray:
    buf = np.zeros(self.info.size, np.uint8)
    self.render_into(buf, t)
    return buf

  def render_into(self, buf: np.ndarray, t: float) -> None:
    info = self.info
    w, h = info.width, info.height
    y_plane = buf[:info.stride * info.y_height].reshape(info.y_height, info.stride)
    # the cabin: a dark gradient with the seat's headrest behind the driver
    ys = np.arange(h, dtype=np.float32)[:, None]
    y_plane[:h, :w] = (28 + 30 * ys / h).astype(np.uint8)
    tr = self.truth(t)
    cx, cy = w / 2 + tr.x * w, h / 2 + tr.y * h
    rest = (slice(int(cy - 0.5 * self.head_h), int(cy + 0.6 * self.head_h)), slice(int(cx - 0.42 * self.head_h), int(cx + 0.42 * self.head_h)))
    y_plane[:h, :w][rest] = 44
    if tr.face:
      seen = replace(tr, pitch=tr.pitch + self.calib_rpy[1], yaw=tr.yaw + self.calib_rpy[2])   # the camera's view
      self._face(y_plane[:h, :w], cx, cy, seen)
    uv = buf[info.uv_offset:info.uv_offset + info.stride * info.uv_height]
    uv[:] = 128

  def _face(self, img: np.ndarray, cx: float, cy: float, tr: CabinTruth) -> None:
    a, b = 0.36 * self.head_h, 0.5 * self.head_h      # the head's half width and half height
    x0, x1 = max(0, int(cx - a - 2)), min(img.shape[1], int(cx + a + 3))
    y0, y1 = max(0, int(cy - b - 2)), min(img.shape[0], int(cy + b + 3))
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    dx, dy = xx - cx, yy - cy
    # the head, lit from the front: brighter towards where it faces
    r2 = (dx / a) ** 2 + (dy / b) ** 2
    head = r2 <= 1
    shade = 170 - 40 * r2 + 60 * (dx / a) * math.sin(tr.yaw) - 40 * (dy / b) * math.sin(tr.pitch)
    patch = img[y0:y1, x0:x1]
    patch[head] = np.clip(shade[head], 60, 235).astype(np.uint8)
    # features in head coordinates (u right, v down, in units of a and b), turned and tilted
    cr, sr = math.cos(tr.roll), math.sin(tr.roll)
    u = (dx * cr + dy * sr) / a - 0.9 * math.sin(tr.yaw)
    v = (-dx * sr + dy * cr) / b - 0.9 * math.sin(tr.pitch)

    def ellipse(uc, vc, ru, rv):
      return ((u - uc) / ru) ** 2 + ((v - vc) / rv) ** 2 <= 1

    eye_rv = 0.012 if tr.eyes_closed else 0.07
    eyes = ellipse(-0.38, -0.18, 0.16, eye_rv) | ellipse(0.38, -0.18, 0.16, eye_rv)
    brows = ellipse(-0.38, -0.36, 0.2, 0.03) | ellipse(0.38, -0.36, 0.2, 0.03)
    nose = ellipse(0.0, 0.12, 0.07, 0.16)
    mouth = ellipse(0.0, 0.48, 0.28, 0.05)
    for mask, value in ((brows, 50), (nose, 120), (mouth, 70), (eyes, 25)):
      patch[mask & head] = value
    if tr.sunglasses:
      patch[(np.abs(v + 0.18) < 0.12) & (np.abs(u) < 0.62) & head] = 18
