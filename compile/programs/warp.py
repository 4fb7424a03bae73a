"""The camera warp, on the device: NV12 (VENUS layout) -> the 6x128x256 uint8 model input.

Nearest neighbour with round-half-to-even (tinygrad's round), clamped to the image, like openpilot's fused modeld.
The matrix maps model pixels to camera pixels (camera_from_model, used without inversion).
"""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes

from compile.image_layout import images
from selfdrive_glue.nv12 import NV12Info

MODEL_W, MODEL_H = 512, 256
# U/V are sampled at half resolution: S*M*S^-1 with S = diag(.5, .5, 1)
_UV_SCALE = ((1.0, 1.0, 0.5), (1.0, 1.0, 0.5), (2.0, 2.0, 1.0))


def _sample_index(M: Tensor, out_w: int, out_h: int, src_w: int, src_h: int) -> tuple[Tensor, Tensor]:
  """Source (x, y) integer coordinates of every output pixel, shape (out_h, out_w)."""
  xs = Tensor.arange(out_w, dtype=dtypes.float32).reshape(1, out_w).expand(out_h, out_w)
  ys = Tensor.arange(out_h, dtype=dtypes.float32).reshape(out_h, 1).expand(out_h, out_w)
  return _sample_at(M, xs, ys, src_w, src_h)


def _sample_at(M: Tensor, xs: Tensor, ys: Tensor, src_w: int, src_h: int) -> tuple[Tensor, Tensor]:
  """Source (x, y) integer coordinates of the model pixels at float32 (xs, ys), of one shape."""
  w = M[2, 0] * xs + M[2, 1] * ys + M[2, 2]
  sx = ((M[0, 0] * xs + M[0, 1] * ys + M[0, 2]) / w).round().clip(0, src_w - 1).cast(dtypes.int32)
  sy = ((M[1, 0] * xs + M[1, 1] * ys + M[1, 2]) / w).round().clip(0, src_h - 1).cast(dtypes.int32)
  return sx, sy


def warp_nv12(frame: Tensor, M: Tensor, info: NV12Info) -> Tensor:
  """frame: flat uint8 (info.size,), M: (3,3) float32 -> (6, 128, 256) uint8 in openpilot's channel order.

  For images (compile/image_layout.py) each Y channel is gathered straight from the frame (`_warp_nv12_direct`): one
  kernel, where the full-size Y plane below is written and read back by a second (DRAM the a630's warp is bound by). CPU
  and CUDA keep this form: their shipped search sets (compile/cpu/search.py) hold its two kernels."""
  if images():
    return _warp_nv12_direct(frame, M, info)
  sx, sy = _sample_index(M, MODEL_W, MODEL_H, info.width, info.height)
  y = frame[(sy * info.stride + sx).flatten()].reshape(MODEL_H, MODEL_W)
  u, v = _uv(frame, M, info)
  # ch0..3: Y at (even,even), (odd,even), (even,odd), (odd,odd) as (row, col) parity
  return Tensor.stack(y[0::2, 0::2], y[1::2, 0::2], y[0::2, 1::2], y[1::2, 1::2], u, v)


def _warp_nv12_direct(frame: Tensor, M: Tensor, info: NV12Info) -> Tensor:
  """`warp_nv12` with each Y channel gathered at its own model coordinates: channel k holds model pixel
  (2 * col + k // 2, 2 * row + k % 2), the same float32 values as the full grid's, so the same source pixels."""
  ch = Tensor.arange(4).reshape(4, 1, 1)
  shape = (4, MODEL_H // 2, MODEL_W // 2)
  xs = (Tensor.arange(MODEL_W // 2, dtype=dtypes.float32).reshape(1, 1, -1) * 2 + (ch // 2).cast(dtypes.float32)).expand(shape)
  ys = (Tensor.arange(MODEL_H // 2, dtype=dtypes.float32).reshape(1, -1, 1) * 2 + (ch % 2).cast(dtypes.float32)).expand(shape)
  sx, sy = _sample_at(M, xs, ys, info.width, info.height)
  y = frame[(sy * info.stride + sx).flatten()].reshape(shape)
  u, v = _uv(frame, M, info)
  return y.cat(u.reshape(1, *shape[1:]), v.reshape(1, *shape[1:]), dim=0)


def _uv(frame: Tensor, M: Tensor, info: NV12Info) -> tuple[Tensor, Tensor]:
  """The U and V planes sampled at the model's half resolution, (128, 256) each."""
  Muv = M * Tensor(_UV_SCALE, dtype=dtypes.float32, device=M.device)
  ux, uy = _sample_index(Muv, MODEL_W // 2, MODEL_H // 2, info.width // 2, info.height // 2)
  uv_idx = (info.uv_offset + uy * info.stride + ux * 2).flatten()
  return frame[uv_idx].reshape(MODEL_H // 2, MODEL_W // 2), frame[uv_idx + 1].reshape(MODEL_H // 2, MODEL_W // 2)


def _source_coords_np(M: np.ndarray, out_w: int, out_h: int, src_w: int, src_h: int) -> tuple[np.ndarray, np.ndarray]:
  M = M.astype(np.float32)
  y, x = np.mgrid[0:out_h, 0:out_w].astype(np.float32)
  w = M[2, 0] * x + M[2, 1] * y + M[2, 2]
  sx = np.rint((M[0, 0] * x + M[0, 1] * y + M[0, 2]) / w)   # np.rint rounds half to even, like tinygrad's round
  sy = np.rint((M[1, 0] * x + M[1, 1] * y + M[1, 2]) / w)
  return np.clip(sx, 0, src_w - 1).astype(np.int64), np.clip(sy, 0, src_h - 1).astype(np.int64)


def warp_nv12_numpy(frame: np.ndarray, M: np.ndarray, info: NV12Info) -> np.ndarray:
  """The same warp in numpy, float32 like the device's (for data preparation in worker processes without a device).
  Equal to `warp_nv12` wherever float32 evaluation order does not move a source coordinate across a rounding tie."""
  y_plane = frame[:info.stride * info.y_height].reshape(info.y_height, info.stride)[:info.height, :info.width]
  uv = frame[info.uv_offset:info.uv_offset + info.stride * info.uv_height].reshape(info.uv_height, info.stride)[:info.height // 2, :info.width]
  sx, sy = _source_coords_np(M, MODEL_W, MODEL_H, info.width, info.height)
  y = y_plane[sy, sx]
  ux, uy = _source_coords_np(M.astype(np.float32) * np.array(_UV_SCALE, np.float32), MODEL_W // 2, MODEL_H // 2, info.width // 2, info.height // 2)
  return np.stack([y[0::2, 0::2], y[1::2, 0::2], y[0::2, 1::2], y[1::2, 1::2], uv[:, 0::2][uy, ux], uv[:, 1::2][uy, ux]])
