"""The per-frame driver-monitoring program, all on the device: driver-camera NV12 frame -> DM warp (Y plane, 1440x960)
-> dmonitoring model -> outputs, as one TinyJit.

openpilot runs the warp and the model as two JITs called back to back on every frame; here they are one (no state is
kept between frames, and one graph is one submit plan on the a630). The warp matrix and calib are inputs, so the same
program serves any calibration; the matrix is the camera's (selfdrive_glue/camera.py dm_warp_matrix).
"""
from __future__ import annotations

from typing import Any

from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.helpers import Context

from compile import image_layout
from compile.onnx_model import OnnxModelInfo
from compile.programs import one_model
from compile.programs.dm_warp import warp_y
from selfdrive_glue.camera import DM_INPUT_SIZE
from selfdrive_glue.nv12 import NV12Info


class DMProgram:
  def __init__(self, info: OnnxModelInfo, nv12: NV12Info, device: str, cpu_ops: bool = False, border: int | None = None):
    self.device, self.nv12, self.border = device, nv12, border
    self.model, self.dtypes = one_model.runner(info, device, cpu_ops)
    self.layout_rewrites: dict[str, int] = {}
    # for images the warp is left lazy: the model's first kernel gathers, converts to fp16 and lays out its input image in
    # one pass, where the warp's own kernel would write 1.4 MB of uint8 for that kernel to read back
    self.fold_warp = image_layout.images()

  def warp(self, frame: Tensor, m_inv: Tensor) -> Tensor:
    img = warp_y(frame, m_inv.to(self.device).cast(dtypes.float32), self.nv12, *DM_INPUT_SIZE, border=self.border)
    if not self.fold_warp:
      img = img.contiguous()
      with Context(SPLIT_REDUCEOP=0):   # a gather over the frame: split reduces would make it many partial passes
        img.realize()
    return img.reshape(1, -1)

  def run(self, frame: Tensor, m_inv: Tensor, calib: Tensor) -> Tensor:
    img = self.warp(frame, m_inv)
    feeds = {"input_img": img.cast(self.dtypes["input_img"]), "calib": calib.to(self.device).cast(self.dtypes["calib"])}
    return next(iter(self.model(feeds).values())).cast(dtypes.float32).realize()

  def jit(self) -> Any:
    return TinyJit(self.run, prune=True)
