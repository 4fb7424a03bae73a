"""Procedural road scenes rendered straight into VENUS NV12 camera buffers.

A three-lane road (dashed inner lines, solid outer lines, shoulders), grass, sky and an optional lead car, seen through
openpilot's pinhole cameras (road f=2648 / wide f=567 at 1928x1208; 1141.5 / 425.25 at 1344x760) mounted `CAM_HEIGHT`
above a flat ground plane and rotated by the calibration `calib_rpy` (roll 0, small pitch and yaw).

Everything is a pure function of (seed, t): the road's curvature, the ego speed and lateral wander, the lead car and the
blinkers are sums of sinusoids drawn from the seed, so any frame can be rendered in any order and `ego(t)` agrees with
what the pictures show (carState is synthesised from it).

Speed: the picture is rendered at chroma resolution (w/2 x h/2). With roll 0 every image row of the ground is (to first
order in the small yaw) one distance ahead, so each row is piecewise constant: a dozen colour steps at the edges of
nested spans (shoulders, asphalt, lines). The steps are sorted per row and the whole picture is one run-length expansion
(np.repeat) of packed 16-bit values: luma duplicated into both bytes (the 2x horizontal upsample) and interleaved U,V,
written through uint16 views of the Y plane (every row twice) and of the UV plane.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from selfdrive_glue.camera import rot_from_euler
from selfdrive_glue.nv12 import NV12Info, nv12_info

CAM_HEIGHT = 1.22  # m, comma device on the windshield
WHEELBASE = 2.7
STEER_RATIO = 15.3
LINE_WIDTH = 0.15
DASH_PERIOD, DASH_ON = 12.0, 3.0  # m; US-style 3 m dash, 9 m gap
MAX_DIST = 400.0  # beyond this the ground is haze
LEAD_WIDTH, LEAD_HEIGHT = 1.8, 1.45

# focal lengths per camera size: (road, wide)
FOCALS = {"1928x1208": (2648.0, 567.0), "1344x760": (1141.5, 425.25)}


@dataclass(frozen=True)
class EgoState:
  t: float
  v_ego: float  # m/s
  a_ego: float  # m/s^2
  curvature: float  # 1/m, left positive (openpilot's convention)
  yaw_rate: float  # rad/s, left positive
  steering_angle_deg: float  # left positive
  steering_rate_deg: float
  left_blinker: bool
  right_blinker: bool
  lateral_offset: float  # m, ego right of its lane centre
  lead_distance: float | None  # m to the lead's back, None when there is no lead
  lead_v_rel: float  # m/s, lead speed minus ego speed


class _Sines:
  """f(x) = sum a_i sin(k_i x + p_i), with analytic first and second integrals from 0."""

  def __init__(self, amps, wavenumbers, phases):
    self.a, self.k, self.p = (np.asarray(v, dtype=np.float64) for v in (amps, wavenumbers, phases))

  def __call__(self, x):
    x = np.asarray(x, dtype=np.float64)
    return np.sum(self.a * np.sin(np.multiply.outer(x, self.k) + self.p), axis=-1)

  def d(self, x):
    x = np.asarray(x, dtype=np.float64)
    return np.sum(self.a * self.k * np.cos(np.multiply.outer(x, self.k) + self.p), axis=-1)

  def d2(self, x):
    x = np.asarray(x, dtype=np.float64)
    return -np.sum(self.a * self.k ** 2 * np.sin(np.multiply.outer(x, self.k) + self.p), axis=-1)

  def integral_from(self, x0: float, dx):
    """int_0^dx f(x0 + u) du"""
    dx = np.asarray(dx, dtype=np.float64)
    c0 = np.cos(self.k * x0 + self.p)
    c1 = np.cos(np.multiply.outer(dx, self.k) + self.k * x0 + self.p)
    return np.sum(self.a / self.k * (c0 - c1), axis=-1)

  def double_integral_from(self, x0: float, dx):
    """int_0^dx int_0^u f(x0 + w) dw du"""
    dx = np.asarray(dx, dtype=np.float64)
    ph0 = self.k * x0 + self.p
    s1 = np.sin(np.multiply.outer(dx, self.k) + ph0)
    return np.sum(self.a / self.k * (np.multiply.outer(dx, np.cos(ph0)) - (s1 - np.sin(ph0)) / self.k), axis=-1)


@dataclass
class _RowGeometry:
  """Per chroma-row ray facts for one camera; constant over time."""
  rows: np.ndarray  # indices of ground rows (chroma resolution)
  fwd: np.ndarray  # m ahead of the camera along the road plane at the row's optical column
  inv_t: np.ndarray  # 1/t where a ground point is t * ray
  c0: np.ndarray  # lateral = t * (c0 + c1 * a), a = (u - cx) / f
  c1: float
  horizon_row: int  # first ground row (rows above are sky)


def _pack(yuv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(..., 3) float YUV -> (luma twice in one uint16, U | V << 8), rounded and clipped to 0..255."""
  q = np.clip(np.rint(yuv), 0, 255).astype(np.uint16)
  return q[..., 0] * np.uint16(257), q[..., 1] | (q[..., 2] << np.uint16(8))


class RoadScene:
  """A deterministic procedural drive. `render_into(buf, t, which)` paints one camera frame, `ego(t)` the car state."""

  def __init__(self, seed: int = 0, camera: str = "1928x1208"):
    if camera not in FOCALS:
      raise ValueError(f"unknown camera '{camera}', expected one of {', '.join(FOCALS)}")
    self.seed, self.camera = int(seed), camera
    self.width, self.height = (int(v) for v in camera.split("x"))
    self.info: NV12Info = nv12_info(self.width, self.height)
    rng = np.random.default_rng(self.seed)
    self.calib_rpy = (0.0, float(rng.uniform(-0.03, 0.03)), float(rng.uniform(-0.02, 0.02)))
    self._rot_t = rot_from_euler(self.calib_rpy).T  # calib_from_device
    self.lane_width = float(rng.uniform(3.3, 3.8))
    # road curvature over arc length: up to ~1/300 m^-1, wavelengths of a few hundred metres
    n = 3
    self._kappa = _Sines(rng.uniform(0, 1 / 900, n) * rng.choice([-1, 1], n), 2 * np.pi / rng.uniform(250, 1200, n), rng.uniform(0, 2 * np.pi, n))
    # ego speed over time
    v0 = float(rng.uniform(12, 28))
    self._v0 = v0
    self._dv = _Sines(rng.uniform(0, 2.5, 2), 2 * np.pi / rng.uniform(15, 60, 2), rng.uniform(0, 2 * np.pi, 2))
    # ego lateral wander within the lane (m, right positive)
    self._wander = _Sines(rng.uniform(0, 0.25, 2), 2 * np.pi / rng.uniform(6, 25, 2), rng.uniform(0, 2 * np.pi, 2))
    # lead car gap over time
    self.has_lead = bool(rng.random() < 0.8)
    d0 = float(rng.uniform(18, 60))
    self._lead_d0 = d0
    self._lead_dd = _Sines([rng.uniform(0, 0.4 * d0)], [2 * np.pi / rng.uniform(20, 50)], [rng.uniform(0, 2 * np.pi)])
    # blinker windows: one every ~20-40 s, 3-5 s long
    self._blinkers: list[tuple[float, float, bool]] = []
    start = float(rng.uniform(3, 20))
    for _ in range(64):
      dur = float(rng.uniform(3, 5))
      self._blinkers.append((start, start + dur, bool(rng.random() < 0.5)))
      start += dur + float(rng.uniform(15, 35))
    self.left_line_yellow = bool(rng.random() < 0.3)
    exposure = float(rng.uniform(0.85, 1.1))
    self._colors = {k: (min(255, int(round(y * exposure))), u, v) for k, (y, u, v) in {
      "sky_top": (150, 150, 116), "sky_horizon": (205, 136, 122), "grass": (88, 112, 118), "asphalt": (92, 128, 128),
      "shoulder": (110, 126, 130), "white": (215, 128, 128), "yellow": (175, 84, 150), "haze": (150, 132, 124),
      "car": (46, 130, 124), "window": (28, 132, 124), "tail": (70, 110, 196)}.items()}
    self._geo: dict[str, _RowGeometry] = {}

  # ---- motion -------------------------------------------------------------
  def _arc(self, t: float) -> float:
    return self._v0 * t + float(self._dv.integral_from(0.0, t))

  def _speed(self, t: float) -> float:
    return self._v0 + float(self._dv(t))

  def _blinker(self, t: float) -> tuple[bool, bool]:
    for a, b, left in self._blinkers:
      if a <= t < b:
        return left, not left
      if a > t:
        break
    return False, False

  def _lead_distance(self, t: float) -> float | None:
    return self._lead_d0 + float(self._lead_dd(t)) if self.has_lead else None

  def ego(self, t: float) -> EgoState:
    v, a = self._speed(t), float(self._dv.d(t))
    s = self._arc(t)
    ey, eydd = float(self._wander(t)), float(self._wander.d2(t))
    # heading error (left positive) is -d(ey)/ds; the ego path curves with the road plus the wander
    curv = float(self._kappa(s)) - eydd / max(v, 1.0) ** 2
    dt = 0.01
    curv_next = float(self._kappa(self._arc(t + dt))) - float(self._wander.d2(t + dt)) / max(self._speed(t + dt), 1.0) ** 2
    steer = math.degrees(math.atan(curv * WHEELBASE)) * STEER_RATIO
    steer_next = math.degrees(math.atan(curv_next * WHEELBASE)) * STEER_RATIO
    left, right = self._blinker(t)
    lead = self._lead_distance(t)
    return EgoState(t=t, v_ego=v, a_ego=a, curvature=curv, yaw_rate=curv * v, steering_angle_deg=steer,
                    steering_rate_deg=(steer_next - steer) / dt, left_blinker=left, right_blinker=right,
                    lateral_offset=ey, lead_distance=lead,
                    lead_v_rel=float(self._lead_dd.d(t)) if lead is not None else 0.0)

  def _center_right(self, t: float, x):
    """Lane centre's lateral position (m, right positive) at distance x ahead, in the calibrated (road) frame."""
    s, v = self._arc(t), max(self._speed(t), 1.0)
    ey, heading = float(self._wander(t)), -float(self._wander.d(t)) / v
    return -ey + heading * x - self._kappa.double_integral_from(s, x)

  # ---- geometry -----------------------------------------------------------
  def focal(self, which: str) -> float:
    return FOCALS[self.camera][0 if which == "road" else 1]

  def intrinsics(self, which: str) -> np.ndarray:
    f = self.focal(which)
    return np.array([[f, 0, self.width / 2], [0, f, self.height / 2], [0, 0, 1]])

  def _geometry(self, which: str) -> _RowGeometry:
    if which not in self._geo:
      f, cy = self.focal(which), self.height / 2
      hh = self.height // 2
      v = 2 * np.arange(hh) + 0.5  # centre of each 2x2 block in full-resolution pixels
      b = (v - cy) / f
      m = self._rot_t
      # ray in device coords (1, a, b); calib coords are m @ ray; z is down, so the ground is z = CAM_HEIGHT
      z = m[2, 0] + m[2, 2] * b
      fwd_dir = m[0, 0] + m[0, 2] * b
      ok = z > 1e-6
      t = np.where(ok, CAM_HEIGHT / np.where(ok, z, 1.0), np.inf)
      fwd = t * fwd_dir
      ground = ok & (fwd > 0.5)
      rows = np.nonzero(ground)[0]
      horizon = int(rows[0]) if len(rows) else hh
      self._geo[which] = _RowGeometry(rows=rows, fwd=fwd[rows], inv_t=1.0 / t[rows], c0=(m[1, 0] + m[1, 2] * b)[rows], c1=float(m[1, 1]),
                                      horizon_row=horizon)
    return self._geo[which]

  def _cols(self, which: str, geo: _RowGeometry, lateral):
    """Lateral ground positions (m, per row) -> chroma-resolution column coordinates."""
    a = (lateral * geo.inv_t - geo.c0) / geo.c1
    u = self.width / 2 + self.focal(which) * a
    return (u - 0.5) / 2

  def _project(self, which: str, pts_calib: np.ndarray) -> np.ndarray:
    """(N,3) calib-frame points -> (N,2) chroma-resolution (col, row)."""
    dev = pts_calib @ self._rot_t  # == (R @ p) for each row p, since _rot_t is R^T
    f = self.focal(which)
    u = self.width / 2 + f * dev[:, 1] / dev[:, 0]
    v = self.height / 2 + f * dev[:, 2] / dev[:, 0]
    return np.stack([(u - 0.5) / 2, (v - 0.5) / 2], axis=1)

  # ---- rendering ----------------------------------------------------------
  def render(self, t: float, which: str = "road") -> np.ndarray:
    buf = np.zeros(self.info.size, dtype=np.uint8)
    self.render_into(buf, t, which)
    return buf

  def render_into(self, buf, t: float, which: str = "road") -> None:
    """Paint the frame at time t (s) of camera `which` ('road' or 'wide') into a VENUS NV12 buffer of this camera size."""
    if which not in ("road", "wide"):
      raise ValueError(f"which must be 'road' or 'wide', not {which!r}")
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.dtype != np.uint8 or arr.size < self.info.size:
      raise ValueError(f"buffer must be uint8 with at least {self.info.size} bytes for {self.camera}, got {arr.dtype} x {arr.size}")
    y2, uv = self._paint(t, which)
    info, w, h = self.info, self.width, self.height
    # 16-bit views: one uint16 holds two equal luma pixels (2x upsample) or one interleaved U,V pair
    arr = arr.reshape(-1)
    y16 = arr[:info.stride * info.y_height].view(np.uint16).reshape(info.y_height, info.stride // 2)[:h, :w // 2]
    y16.reshape(h // 2, 2, w // 2)[...] = y2[:, None, :]
    uv16 = arr[info.uv_offset:info.uv_offset + info.stride * info.uv_height].view(np.uint16).reshape(info.uv_height, info.stride // 2)
    uv16[:h // 2, :w // 2] = uv

  def _paint(self, t: float, which: str) -> tuple[np.ndarray, np.ndarray]:
    """-> (luma doubled into uint16, interleaved UV as uint16), both (h/2, w/2); little-endian packing like the buffer."""
    hh, ww = self.height // 2, self.width // 2
    geo = self._geometry(which)
    col = self._colors
    haze_c = np.array(col["haze"], dtype=np.float64)
    # sky: vertical gradient down to the horizon
    frac = np.clip(np.arange(hh) / max(geo.horizon_row, 1), 0, 1)[:, None]
    base = np.array(col["sky_top"]) * (1 - frac) + np.array(col["sky_horizon"]) * frac

    rows, fwd = geo.rows, geo.fwd
    s = self._arc(t)
    haze = np.exp(-fwd / 250.0)[:, None]  # 1 near, 0 far
    grass = np.array(col["grass"], dtype=np.float64) + np.array([6.0, 0, 0]) * np.sin(2 * np.pi * (s + fwd) / 5.3)[:, None]
    base[rows] = grass * haze + haze_c * (1 - haze)

    # each row is piecewise constant: nested spans give +/- colour steps at columns; sort the steps per row
    n_steps = 12
    cols = np.full((hh, n_steps), ww, dtype=np.int64)
    steps = np.zeros((hh, n_steps, 3))
    near = fwd < MAX_DIST
    r_near, f_near, hz = rows[near], fwd[near], haze[near]
    if len(r_near):
      g = _RowGeometry(rows=r_near, fwd=f_near, inv_t=geo.inv_t[near], c0=geo.c0[near], c1=geo.c1, horizon_row=geo.horizon_row)
      center = self._center_right(t, f_near)
      lw = self.lane_width

      def color(name, extra=None):
        c = np.array(col[name], dtype=np.float64)
        if extra is not None:
          c = c + extra
        return c * hz + haze_c * (1 - hz)

      asphalt = color("asphalt", np.array([5.0, 0, 0]) * np.sin(2 * np.pi * (s + f_near) / 7.7)[:, None])
      shoulder = color("shoulder")
      spans: list[tuple[Any, ...]] = [  # (lateral left, lateral right, colour, colour underneath, visible rows mask)
        (center - 1.5 * lw - 1.2, center + 1.5 * lw + 1.2, shoulder, base[r_near], None),
        (center - 1.5 * lw - 0.3, center + 1.5 * lw + 0.3, asphalt, shoulder, None),
      ]
      dash = ((s + f_near) % DASH_PERIOD) < DASH_ON
      white = color("white")
      left_color = color("yellow") if self.left_line_yellow else white
      for k, lc, mask in ((-1.5, left_color, None), (-0.5, white, dash), (0.5, white, dash), (1.5, white, None)):
        spans.append((center + k * lw - LINE_WIDTH / 2, center + k * lw + LINE_WIDTH / 2, lc, asphalt, mask))
      for j, (lat0, lat1, c_top, c_under, mask) in enumerate(spans):
        c0 = np.floor(self._cols(which, g, lat0) + 0.5)
        c1 = np.maximum(np.floor(self._cols(which, g, lat1) + 0.5), c0 + 1)  # at least one column: far lines stay visible
        d = c_top - c_under
        if mask is not None:
          d = d * mask[:, None]
        cols[r_near, 2 * j] = np.clip(c0, 0, ww)
        cols[r_near, 2 * j + 1] = np.clip(c1, 0, ww)
        steps[r_near, 2 * j] = d
        steps[r_near, 2 * j + 1] = -d
    order = np.argsort(cols, axis=1, kind="stable")
    cols = np.take_along_axis(cols, order, axis=1)
    steps = np.take_along_axis(steps, order[:, :, None], axis=1)
    values = np.concatenate([base[:, None, :], base[:, None, :] + np.cumsum(steps, axis=1)], axis=1)  # (hh, n+1, 3)
    lengths = np.diff(np.concatenate([np.zeros((hh, 1), np.int64), cols, np.full((hh, 1), ww, np.int64)], axis=1), axis=1)
    y16, uv16 = _pack(values)
    y2 = np.repeat(y16.ravel(), lengths.ravel()).reshape(hh, ww)
    uv = np.repeat(uv16.ravel(), lengths.ravel()).reshape(hh, ww)
    if self.has_lead:
      self._paint_lead(y2, uv, t, which)
    return y2, uv

  def _paint_lead(self, y2: np.ndarray, uv: np.ndarray, t: float, which: str) -> None:
    d = self._lead_distance(t)
    if d is None or d <= 2.0 or d > MAX_DIST:
      return
    hh, ww = y2.shape
    lat = float(self._center_right(t, np.array([d]))[0])
    col = self._colors
    haze = math.exp(-d / 250.0)

    def box(x0, x1, z0, z1, name):
      # x: lateral offsets from the lead's centre, z: height above the ground
      pts = np.array([[d, lat + x0, CAM_HEIGHT - z0], [d, lat + x1, CAM_HEIGHT - z1]])
      (ca, ra), (cb, rb) = self._project(which, pts)
      c0, c1 = int(np.clip(math.floor(min(ca, cb) + 0.5), 0, ww)), int(np.clip(math.floor(max(ca, cb) + 0.5), 0, ww))
      r0, r1 = int(np.clip(math.floor(min(ra, rb) + 0.5), 0, hh)), int(np.clip(math.floor(max(ra, rb) + 0.5), 0, hh))
      if c1 > c0 and r1 > r0:
        yv, uvv = _pack(np.array(col[name]) * haze + np.array(col["haze"]) * (1 - haze))
        y2[r0:r1, c0:c1] = yv
        uv[r0:r1, c0:c1] = uvv

    w2 = LEAD_WIDTH / 2
    box(-w2 - 0.1, w2 + 0.1, -0.05, 0.12, "window")  # shadow under the bumper
    box(-w2, w2, 0.12, LEAD_HEIGHT, "car")
    box(-w2 + 0.2, w2 - 0.2, LEAD_HEIGHT * 0.62, LEAD_HEIGHT * 0.93, "window")
    box(-w2 + 0.05, -w2 + 0.4, LEAD_HEIGHT * 0.45, LEAD_HEIGHT * 0.58, "tail")
    box(w2 - 0.4, w2 - 0.05, LEAD_HEIGHT * 0.45, LEAD_HEIGHT * 0.58, "tail")

  # ---- helpers for tests and carState -------------------------------------
  def lane_center_column(self, t: float, distance: float, which: str = "road") -> float:
    """Full-resolution image column of the lane centre `distance` m ahead (for checks and overlays)."""
    lat = float(self._center_right(t, np.array([distance]))[0])
    col, _ = self._project(which, np.array([[distance, lat, CAM_HEIGHT]]))[0]
    return 2 * col + 0.5
