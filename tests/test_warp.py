"""The on-device camera warp (`compile.programs.warp.warp_nv12`) against an independent numpy reference, exact equality.

The reference follows the contract (§6) literally: per output pixel a projective map, round half to even, clip,
then read the Y plane (at the stride) or the interleaved UV plane (half size, M scaled by [[1,1,.5],[1,1,.5],[2,2,1]]),
and pack 6 channels. To make "exact" meaningful whatever the kernel compiler does (FMA contraction, operation order),
test matrices are snapped to a dyadic grid so every product and sum is exact in float32; only the final division
rounds, and IEEE division is correctly rounded everywhere. `_exact_grid` proves that for each matrix used.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from tinygrad import Tensor

from compile.programs.warp import warp_nv12, warp_nv12_numpy
from selfdrive_glue.camera import model_transforms
from selfdrive_glue.nv12 import NV12Info, nv12_info

OUT_W, OUT_H = 512, 256
CAMERAS = {(1928, 1208): ("tici", "ar0231"), (1344, 760): ("mici", "os04c10")}


def _planes(frame: np.ndarray, nv: NV12Info) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(Y, U, V) as 2-D views of a VENUS buffer: Y is H x W at `stride`, UV interleaved (U even bytes) below y_height rows."""
  y = frame[:nv.stride * nv.y_height].reshape(nv.y_height, nv.stride)[:nv.height, :nv.width]
  uv = frame[nv.uv_offset:nv.uv_offset + nv.stride * nv.uv_height].reshape(nv.uv_height, nv.stride)[:nv.height // 2, :nv.width]
  return y, uv[:, 0::2], uv[:, 1::2]


def reference_warp(frame: np.ndarray, M: np.ndarray, nv: NV12Info) -> np.ndarray:
  # the numpy twin (compile/programs/warp.py) is what training data is warped with: these tests hold it to the device warp
  return warp_nv12_numpy(frame, M, nv)


def _exact_grid(M: np.ndarray) -> np.ndarray:
  """Snap rows 0-1 to multiples of 2^-12 and row 2 to 2^-22, then check that every numerator and w (Y and UV maps)
  is exact in float32 over the whole output grid, i.e. equal to the float64 value."""
  M = np.asarray(M, np.float64)
  q = np.vstack([np.round(M[:2] * 2**12) / 2**12, np.round(M[2:] * 2**22) / 2**22])
  for m, (w, h) in ((q, (OUT_W, OUT_H)), (q * [[1, 1, .5], [1, 1, .5], [2, 2, 1]], (OUT_W // 2, OUT_H // 2))):
    y, x = np.mgrid[0:h, 0:w]
    for row in m:
      exact = row[0] * x + row[1] * y + row[2]
      f32 = row.astype(np.float32)
      assert np.array_equal((f32[0] * x.astype(np.float32) + f32[1] * y.astype(np.float32) + f32[2]).astype(np.float64), exact), row
  return q.astype(np.float32)


def _frame(nv: NV12Info, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, nv.size, dtype=np.uint8)


def _warp(frame: np.ndarray, M: np.ndarray, nv: NV12Info) -> np.ndarray:
  """The warp as built for CPU/CUDA and as built for images (each Y channel gathered at its own coordinates): equal."""
  from tinygrad.helpers import Context
  out = warp_nv12(Tensor(frame), Tensor(np.asarray(M, np.float32)), nv).numpy()
  with Context(IMAGE=2):
    direct = warp_nv12(Tensor(frame), Tensor(np.asarray(M, np.float32)), nv).numpy()
  assert out.shape == (6, OUT_H // 2, OUT_W // 2) and out.dtype == np.uint8
  np.testing.assert_array_equal(direct, out)
  return out


def _matrices(camera: tuple[int, int]) -> dict[str, np.ndarray]:
  device, sensor = CAMERAS[camera]
  main0, big0 = model_transforms(np.zeros(3), device, sensor, False)
  main, big = model_transforms(np.array([0.03, -0.04, 0.05]), device, sensor, False)  # roll, pitch, yaw: rotated + perspective
  W, H = camera
  return {
    "identity": np.eye(3),
    "zero_calib_main": main0, "zero_calib_big": big0,          # scale + translation, what a new car sees
    "calibrated_main": main, "calibrated_big": big,
    # mirrored, rotated by ~30 degrees and with strong perspective, all centered in the image
    "rot_persp": np.array([[-1.7, 1.0, W * .6], [0.9, 1.5, H * .2], [3e-4, -2e-4, 1.0]]),
    # maps most of the model frame far outside the image on every side: clamping to the borders
    "out_of_bounds": np.array([[12.0, 0.5, -3000.0], [-0.4, 9.0, -900.0], [0.0, 0.0, 1.0]]),
  }


@pytest.mark.parametrize("camera", list(CAMERAS), ids=lambda c: f"{c[0]}x{c[1]}")
def test_warp_matches_reference(camera):
  nv = nv12_info(*camera)
  frame = _frame(nv, camera[0])
  for name, M in _matrices(camera).items():
    M = _exact_grid(M)
    got, want = _warp(frame, M, nv), reference_warp(frame, M, nv)
    bad = np.argwhere(got != want)
    assert len(bad) == 0, f"{name}: {len(bad)} of {got.size} pixels differ, first at (ch, row, col) {tuple(int(i) for i in bad[0])}"


@pytest.mark.parametrize("camera", list(CAMERAS), ids=lambda c: f"{c[0]}x{c[1]}")
def test_identity_reads_top_left_corner_in_channel_order(camera):
  """No reference maths: with M = I, model pixel (x, y) is camera pixel (x, y) and chroma (x, y) is UV (x, y)."""
  nv = nv12_info(*camera)
  frame = _frame(nv, 7)
  got = _warp(frame, np.eye(3), nv)
  y = frame[:256 * nv.stride].reshape(256, nv.stride)[:, :512]
  uv = frame[nv.uv_offset:nv.uv_offset + 128 * nv.stride].reshape(128, nv.stride)[:, :512]
  for ch, (r, c) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):   # (row parity, column parity) of ch0..3
    assert np.array_equal(got[ch], y[r::2, c::2]), f"channel {ch}"
  assert np.array_equal(got[4], uv[:, 0::2]) and np.array_equal(got[5], uv[:, 1::2])


def test_out_of_bounds_clamps_to_image_borders():
  nv = nv12_info(1928, 1208)
  frame = _frame(nv, 3)
  y_plane, u_plane, _ = _planes(frame, nv)
  M = _exact_grid(np.array([[1.0, 0, -600.0], [0, 1.0, 1100.0], [0, 0, 1.0]]))  # x < 600 off the left, y >= 108 off the bottom
  got = _warp(frame, M, nv)
  assert np.array_equal(got, reference_warp(frame, M, nv))
  y = np.empty((256, 512), np.uint8)
  y[0::2, 0::2], y[1::2, 0::2], y[0::2, 1::2], y[1::2, 1::2] = got[:4]
  # every model column maps left of the image (column 0); rows from 108 on map below it (the last row)
  assert (y == y_plane[np.minimum(np.arange(256) + 1100, nv.height - 1), 0][:, None]).all()
  assert (y[108:] == y_plane[nv.height - 1, 0]).all() and (y[:108] != y_plane[nv.height - 1, 0]).any()
  assert (got[4] == u_plane[np.minimum(np.arange(128) + 550, nv.height // 2 - 1), 0][:, None]).all()


@pytest.mark.parametrize("M,denominator", [
  ([[1.5, 0, 0.5], [0, 1.5, 0], [0, 0, 1]], 1),    # x: 1.5x + .5 is a tie at even x; y: 1.5y is a tie at odd y
  ([[3, 0, 1], [0, 3, 0], [0, 0, 2]], 2),          # the same map through w = 2
  ([[1, 0, 1], [0, 1, 1], [0, 0, 1]], 1),          # no luma ties; chroma map is x/1 + .5: a tie at every pixel
], ids=["affine", "w=2", "chroma_ties"])
def test_exact_half_ties_round_to_even(M, denominator):
  """Pixel values encode their source column/row, so the chosen pixel is read off the output and checked against
  Python's round() (half to even) on exact fractions, independently of numpy."""
  nv = nv12_info(1928, 1208)
  frame = np.zeros(nv.size, np.uint8)
  y_plane, u_plane, v_plane = _planes(frame, nv)  # views: writing them writes the frame
  cols, rows = np.arange(nv.width), np.arange(nv.height)
  y_plane[:] = (cols[None, :] % 256).astype(np.uint8)  # column, mod 256
  v_plane[:] = (rows[:nv.height // 2, None] % 256).astype(np.uint8)  # row, mod 256
  u_plane[:] = (cols[None, :nv.width // 2] % 256).astype(np.uint8)
  M = np.array(M, np.float32)
  F = [[Fraction(float(v)) for v in row] for row in M]
  got = _warp(frame, M, nv)
  luma = np.empty((256, 512), np.uint8)
  luma[0::2, 0::2], luma[1::2, 0::2], luma[0::2, 1::2], luma[1::2, 1::2] = got[:4]

  def expect(coef: Fraction, off: Fraction, n: int, limit: int) -> np.ndarray:
    return np.array([min(max(round((coef * i + off) / denominator), 0), limit) % 256 for i in range(n)])  # round(): half to even

  half = Fraction(1, 2)
  assert np.array_equal(luma[0], expect(F[0][0], F[0][2], 512, nv.width - 1))
  assert np.array_equal(got[4][0], expect(F[0][0], F[0][2] * half, 256, nv.width // 2 - 1))
  assert np.array_equal(got[5][:, 0], expect(F[1][1], F[1][2] * half, 128, nv.height // 2 - 1))
  ties = [i for i in range(512) if (F[0][0] * i + F[0][2]) / denominator % 1 == half]
  chroma_ties = [i for i in range(256) if (F[0][0] * i + F[0][2] * half) / denominator % 1 == half]
  assert len(ties) + len(chroma_ties) >= 128, "the case must actually contain ties"
  assert np.array_equal(got, reference_warp(frame, M, nv))
