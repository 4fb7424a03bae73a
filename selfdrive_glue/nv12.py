"""Camera buffer geometry: the VENUS NV12 layout camerad allocates (stride/heights aligned, padded tail)."""
from __future__ import annotations

from dataclasses import dataclass

from selfdrive_glue.errors import UserError


def _align(x: int, a: int) -> int:
  return (x + a - 1) // a * a


@dataclass(frozen=True)
class NV12Info:
  width: int
  height: int
  stride: int
  y_height: int
  uv_height: int
  size: int

  @property
  def uv_offset(self) -> int:
    return self.stride * self.y_height


def nv12_info(width: int, height: int) -> NV12Info:
  stride = _align(width, 128)
  y_height = _align(height, 32)
  uv_height = _align(height // 2, 16)
  size = _align(stride * y_height + stride * uv_height + 4096 + max(16384, 8 * stride), 4096)
  size = _align(size + _align(width, 512) * 512, 4096)
  return NV12Info(width, height, stride, y_height, uv_height, size)


CAMERA_SIZES = {"1928x1208": (1928, 1208), "1344x760": (1344, 760)}


def parse_camera(text: str) -> tuple[int, int]:
  """'1928x1208' -> (1928, 1208); only the sizes openpilot's cameras produce."""
  if text not in CAMERA_SIZES:
    raise UserError(f"unsupported camera size '{text}': use one of {', '.join(CAMERA_SIZES)}")
  return CAMERA_SIZES[text]
