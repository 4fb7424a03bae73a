"""Device tensors over VisionIPC camera buffers, one per (camera, buffer address), made once and reused."""
from __future__ import annotations

from typing import Any

import numpy as np

from artifact.load import frame_tensor
from selfdrive_glue.nv12 import NV12Info


class FrameTensors:
  def __init__(self, device: str, nv12: NV12Info):
    self.device, self.nv12 = device, nv12
    self.zero_copy = device.split(":")[0] == "CPU"
    self._tensors: dict[tuple[str, int], Any] = {}   # tinygrad Tensors

  def get(self, key: str, buf: np.ndarray, upload: bool = False):
    """The device tensor for a camera buffer. On CPU it aliases the buffer (zero-copy); on a GPU without host-pointer
    mapping (QCOM over msm has no userptr) it is a device copy, refreshed when `upload` is set (every step)."""
    if buf.dtype != np.uint8 or buf.size < self.nv12.size:
      raise ValueError(f"camera buffer of {buf.size} bytes ({buf.dtype}) is smaller than the {self.nv12.size}-byte NV12 frame")
    # VisionIPC reuses a ring of buffers, so a tensor per (camera, buffer address) is made once and reused
    k = (key, buf.ctypes.data)
    src = buf[:self.nv12.size]
    if (t := self._tensors.get(k)) is None:
      t = self._tensors[k] = frame_tensor(src, self.device).realize()
    elif upload and not self.zero_copy:
      from tinygrad.device import Buffer
      dst = t.uop.buffer
      assert isinstance(dst, Buffer)
      dst.copy_from(Buffer("PYTHON", dst.size, dst.dtype, opaque=memoryview(src.data).cast("B")))
    return t
