"""The driver-monitoring warp, on the device: the driver camera's Y plane -> the 1440x960 image the DM model reads.

Kept apart from compile/programs/warp.py: that file's code is part of the driving kernels' fingerprint (compile/cpu/search.py
KERNEL_SOURCES), which keys the shipped CPU search sets; the DM warp does not change those kernels.
"""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes

from compile.programs.warp import _sample_index, _source_coords_np
from selfdrive_glue.nv12 import NV12Info

# what master's DM warp writes where the source pixel is outside the frame (0.11's clamps to the edge instead)
MASTER_BORDER = 16


def warp_y(frame: Tensor, M: Tensor, info: NV12Info, out_w: int, out_h: int, border: int | None = None) -> Tensor:
  """The driver-monitoring warp: the Y plane only, nearest neighbour, -> (out_h * out_w,) uint8 row-major; a source
  outside the frame reads the edge row/column (openpilot 0.11's DM warp, border None) or `border` (master's: 16). The row
  index steps by the stride, so the padding columns are never read."""
  sx, sy = _sample_index(M, out_w, out_h, info.width, info.height)
  px = frame[(sy * info.stride + sx).flatten()]
  if border is None:
    return px
  xs = Tensor.arange(out_w, dtype=dtypes.float32).reshape(1, out_w).expand(out_h, out_w)
  ys = Tensor.arange(out_h, dtype=dtypes.float32).reshape(out_h, 1).expand(out_h, out_w)
  w = M[2, 0] * xs + M[2, 1] * ys + M[2, 2]
  fx, fy = ((M[0, 0] * xs + M[0, 1] * ys + M[0, 2]) / w).round(), ((M[1, 0] * xs + M[1, 1] * ys + M[1, 2]) / w).round()
  inside = (fx >= 0) & (fx <= info.width - 1) & (fy >= 0) & (fy <= info.height - 1)
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
