"""The driver-monitoring warp, on the device: the driver camera's Y plane -> the 1440x960 image the DM model reads.

Kept apart from compile/programs/warp.py: that file's code is part of the driving kernels' fingerprint (compile/cpu/search.py
KERNEL_SOURCES), which keys the shipped CPU search sets; the DM warp does not change those kernels.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes

from compile.programs.warp import _source_coords_np
from selfdrive_glue.nv12 import NV12Info

# what master's DM warp writes where the source pixel is outside the frame (0.11's clamps to the edge instead)
MASTER_BORDER = 16


# x + _MAGIC, for |x| <= 2^22, lands where one unit of the fp32 mantissa is 1.0: the add itself rounds x half to even (as
# np.rint), and the sum's low bits are that integer. Two instructions, where Tensor.round() is a dozen; the bitcast also keeps
# tinygrad's symbolic from folding (x + C) - C back to x, which a float subtraction would let it do.
_MAGIC = 1.5 * 2 ** 23
_MAGIC_BITS = int(np.float32(_MAGIC).view(np.int32))
# tinygrad upcasts a masked axis of at most 7 (two of them up to 49 together) into each fiber: splitting the output row into
# (n, b, c) gives every fiber b * c pixels, so the warp matrix (9 floats, the same for every fiber) is loaded once per b * c
# pixels, not once per 3, and the row's terms are shared
_FIBER_AXIS_MAX, _FIBER_PIXELS_MAX = 7, 49


def _rint_i32(x: Tensor) -> Tensor:
  """np.rint(x) as int32, for |x| <= 2^22."""
  return (x + _MAGIC).bitcast(dtypes.int32) - _MAGIC_BITS


def _row_split(out_w: int) -> tuple[int, int, int]:
  """out_w as (n, b, c), b and c at most 7, b * c as large as divides out_w (1440 -> (40, 6, 6))."""
  best = max(((b, c) for b in range(1, _FIBER_AXIS_MAX + 1) for c in range(1, _FIBER_AXIS_MAX + 1)
              if b * c <= _FIBER_PIXELS_MAX and out_w % (b * c) == 0), key=lambda bc: (bc[0] * bc[1], bc[0]))
  return out_w // (best[0] * best[1]), best[0], best[1]


def integer_crop(M: np.ndarray, info: NV12Info, out_w: int, out_h: int) -> tuple[int, int] | None:
  """(x0, y0) when M takes every output pixel (x, y) to the frame's (x + x0, y + y0), all inside the frame (the
  1928x1208 cameras' DM matrix), else None."""
  M = np.asarray(M, np.float32)
  if not (M[0, 0] == M[1, 1] == M[2, 2] == 1 and M[0, 1] == M[1, 0] == M[2, 0] == M[2, 1] == 0):
    return None
  x0, y0 = float(M[0, 2]), float(M[1, 2])
  if not (x0.is_integer() and y0.is_integer() and 0 <= x0 <= info.width - out_w and 0 <= y0 <= info.height - out_h):
    return None
  return int(x0), int(y0)


def warp_y(frame: Tensor, M: np.ndarray | Tensor, info: NV12Info, out_w: int, out_h: int, border: int | None = None) -> Tensor:
  """The driver-monitoring warp: the Y plane only, nearest neighbour, -> (out_h * out_w,) uint8 row-major; a source
  outside the frame reads the edge row/column (openpilot 0.11's DM warp, border None) or `border` (master's: 16). The
  same float32 arithmetic as `warp_y_numpy` (projective divide, round half to even, clamp); the row index steps by the
  stride, so the padding columns are never read.

  M as a Tensor is read from memory by every fiber, as openpilot's warp reads its M_inv. M as an array is fixed when the
  program is built (openpilot computes it once from the camera's width, and an artifact is for one camera): an integer
  translation inside the frame is then a crop of the Y plane, read with no index arithmetic, and any other matrix's
  entries are constants of the kernel."""
  if isinstance(M, np.ndarray):
    if (crop := integer_crop(M, info, out_w, out_h)) is not None:
      x0, y0 = crop
      y_plane = frame[:info.stride * info.y_height].reshape(info.y_height, info.stride)
      return y_plane[y0:y0 + out_h, x0:x0 + out_w].flatten()
    m: Any = [[float(v) for v in row] for row in M.astype(np.float32)]
  else:
    m = [[M[i, j] for j in range(3)] for i in range(3)]
  n, b, c = _row_split(out_w)
  shape = (out_h, n, b, c)
  x = (Tensor.arange(n) * (b * c)).reshape(1, n, 1, 1) + (Tensor.arange(b) * c).reshape(1, 1, b, 1) + Tensor.arange(c).reshape(1, 1, 1, c)
  xs = x.expand(shape).cast(dtypes.float32)
  ys = Tensor.arange(out_h).reshape(out_h, 1, 1, 1).expand(shape).cast(dtypes.float32)
  w = m[2][0] * xs + m[2][1] * ys + m[2][2]
  fx = (m[0][0] * xs + m[0][1] * ys + m[0][2]) / w
  fy = (m[1][0] * xs + m[1][1] * ys + m[1][2]) / w
  # clamped before rounding (the same integers as rounding first: clipping commutes with a monotonic rounding), so the
  # magic add stays in its range; with a border one unit wider, so a coordinate outside the frame stays outside
  lo = 0 if border is None else -1
  rx, ry = _rint_i32(fx.clip(lo, info.width - 1 - lo)), _rint_i32(fy.clip(lo, info.height - 1 - lo))
  if border is None:
    # already inside the frame, but the integer clamp stays: without it tinygrad did not fold the CPU's gather into one
    # load per pixel, and its result at the DM's size was wrong outside the DM program's SPLIT_REDUCEOP=0
    return frame[(ry.clip(0, info.height - 1) * info.stride + rx.clip(0, info.width - 1)).flatten()]
  # inside the frame: 0 <= r <= size - 1, one unsigned compare per coordinate; outside reads pixel 0, then replaced
  inside = (rx.bitcast(dtypes.uint32) <= info.width - 1) & (ry.bitcast(dtypes.uint32) <= info.height - 1)
  px = frame[inside.where(ry * info.stride + rx, 0).flatten()]
  return inside.flatten().where(px, border).cast(dtypes.uint8)


def warp_y_numpy(frame: np.ndarray, M: np.ndarray, info: NV12Info, out_w: int, out_h: int, border: int | None = None) -> np.ndarray:
  """`warp_y` in numpy (float32 like the device's; the same caveat as warp_nv12_numpy)."""
  y_plane = frame[:info.stride * info.y_height].reshape(info.y_height, info.stride)[:info.height, :info.width]
  sx, sy = _source_coords_np(M, out_w, out_h, info.width, info.height)
  px = y_plane[sy, sx].reshape(-1)
  if border is None:
    return px
  M = M.astype(np.float32)
  y, x = np.mgrid[0:out_h, 0:out_w].astype(np.float32)
  w = M[2, 0] * x + M[2, 1] * y + M[2, 2]
  fx, fy = np.rint((M[0, 0] * x + M[0, 1] * y + M[0, 2]) / w), np.rint((M[1, 0] * x + M[1, 1] * y + M[1, 2]) / w)
  inside = ((fx >= 0) & (fx <= info.width - 1) & (fy >= 0) & (fy <= info.height - 1)).reshape(-1)
  return np.where(inside, px, np.uint8(border)).astype(np.uint8)


