"""Device tensors over VisionIPC camera buffers, one per (camera, buffer address), made once and reused."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from artifact.load import frame_tensor
from selfdrive_glue import visionipc
from selfdrive_glue.nv12 import NV12Info

log = logging.getLogger("modeld")


class FrameTensors:
  def __init__(self, device: str, nv12: NV12Info):
    self.device, self.nv12 = device, nv12
    self.zero_copy = device.split(":")[0] == "CPU"
    self._tensors: dict[tuple[str, int], Any] = {}   # tinygrad Tensors
    self.imported: set[tuple[str, int]] = set()       # keys whose tensor is the camera's own dma-buf (never copied into)
    self.import_refused: str | None = None              # why the kernel would not import a camera dma-buf: no more tries
    self._said: set[str] = set()

  def get(self, key: str, buf: np.ndarray, upload: bool = False):
    """The device tensor for a camera buffer. On CPU it aliases the buffer (zero-copy); on a GPU without host-pointer
    mapping (QCOM over msm has no userptr) it is a device copy, refreshed when `upload` is set (every step)."""
    if buf.dtype != np.uint8 or buf.size < self.nv12.size:
      raise ValueError(f"camera buffer of {buf.size} bytes ({buf.dtype}) is smaller than the {self.nv12.size}-byte NV12 frame")
    # VisionIPC reuses a ring of buffers, so a tensor per (camera, buffer address) is made once and reused
    k = (key, buf.ctypes.data)
    src = buf[:self.nv12.size]
    if (t := self._tensors.get(k)) is None and not self.zero_copy:
      if (fd := visionipc.dmabuf_fd(buf)) is None:
        # (warm-up zeros, replay's arrays, a PC camera server's memfds): copied; other buffers may still be dma-bufs
        self._say("the camera buffer is not a dma-buf (VisionIPC handed out a memfd or shm file, or it is not a camera buffer)")
      elif self.import_refused is None and (t := self._import(fd)) is not None:
        self._tensors[k] = t
        self.imported.add(k)
    if k in self.imported:
      return t
    if t is None:
      t = self._tensors[k] = frame_tensor(src, self.device).realize()
    elif upload and not self.zero_copy:
      from tinygrad.device import Buffer
      dst = t.uop.buffer
      assert isinstance(dst, Buffer)
      dst.copy_from(Buffer("PYTHON", dst.size, dst.dtype, opaque=memoryview(src.data).cast("B")))
    return t

  def _say(self, why: str) -> None:
    if why not in self._said:   # once per reason: a copy every frame must not log every frame
      self._said.add(why)
      log.info("camera frames are copied into GPU memory: %s", why)   # the processes log INFO; a tool's one-line errors stay one line

  def _import(self, fd: int):
    """A tensor whose device buffer is the camera's dma-buf itself (QCOM over msm: PRIME import, one GPU address per
    VisionIPC buffer), or None when the kernel refuses it; then every frame is copied, and why is logged once."""
    from tinygrad import Device, Tensor, dtypes
    from tinygrad.device import Buffer, BufferSpec
    from tinygrad.runtime.support.hcq import HCQBuffer

    from backend.msm import ImportRefused
    dev: Any = Device[self.device]
    if not hasattr(getattr(dev, "iface", None), "import_dmabuf"):
      self.import_refused = f"{self.device} cannot import dma-bufs"
      return None
    try:
      gem = dev.iface.import_dmabuf(fd)
    except (ImportRefused, OSError, MemoryError) as e:
      self.import_refused = str(e)
      self._say(self.import_refused)
      return None
    t = Tensor.empty(self.nv12.size, dtype=dtypes.uint8, device=self.device)
    b = t.uop.buffer
    assert isinstance(b, Buffer)
    b.options = BufferSpec(nolru=True)   # freed with the tensor: back to the MSM interface (unmapped after its last fence), never reused
    b.allocate(opaque=HCQBuffer(gem.iova, self.nv12.size, meta=gem, owner=dev))
    return t
