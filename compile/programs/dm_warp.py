"""The driver-monitoring warp, on the device: the driver camera's Y plane -> the 1440x960 image the DM model reads.

Kept apart from compile/programs/warp.py: that file's code is part of the driving kernels' fingerprint (compile/cpu/search.py
KERNEL_SOURCES), which keys the shipped CPU search sets; the DM warp does not change those kernels.
"""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from compile.programs.warp import _sample_index, _source_coords_np
from selfdrive_glue.nv12 import NV12Info


def warp_y(frame: Tensor, M: Tensor, info: NV12Info, out_w: int, out_h: int) -> Tensor:
  """The driver-monitoring warp: the Y plane only, nearest neighbour, clamped to the edge row/column (openpilot 0.11's DM
  warp), -> (out_h * out_w,) uint8 row-major. The row index steps by the stride, so the padding columns are never read."""
  sx, sy = _sample_index(M, out_w, out_h, info.width, info.height)
  return frame[(sy * info.stride + sx).flatten()]


def warp_y_numpy(frame: np.ndarray, M: np.ndarray, info: NV12Info, out_w: int, out_h: int) -> np.ndarray:
  """`warp_y` in numpy (float32 like the device's; the same caveat as warp_nv12_numpy)."""
  y_plane = frame[:info.stride * info.y_height].reshape(info.y_height, info.stride)[:info.height, :info.width]
  sx, sy = _source_coords_np(M, out_w, out_h, info.width, info.height)
  return y_plane[sy, sx].reshape(-1)
