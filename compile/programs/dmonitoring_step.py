"""The per-frame driver-monitoring program, all on the device: driver-camera NV12 frame -> DM warp (Y plane, 1440x960)
-> dmonitoring model -> outputs, as one TinyJit.

openpilot runs the warp and the model as two JITs called back to back on every frame; here they are one (no state is
kept between frames, and one graph is one submit plan on the a630). calib is an input, so the same program serves any
calibration. The warp matrix is not: openpilot computes it once from the camera's width (selfdrive_glue/camera.py
dm_warp_matrix) and an artifact is built for one camera, so it is a constant of the program; for images, on the 1928x1208
cameras the warp is a crop.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.helpers import Context

from compile import image_layout
from compile.onnx_model import OnnxModelInfo
from compile.programs import one_model
from compile.programs.dm_warp import integer_crop, warp_y
from selfdrive_glue.camera import DM_INPUT_SIZE, dm_warp_matrix
from selfdrive_glue.nv12 import NV12Info


class DMProgram:
  def __init__(self, info: OnnxModelInfo, nv12: NV12Info, device: str, cpu_ops: bool = False, border: int | None = None,
               matrix: np.ndarray | None = None):
    self.device, self.nv12, self.border = device, nv12, border
    self.matrix = np.asarray(dm_warp_matrix(nv12.width) if matrix is None else matrix, np.float32)
    self.model, self.dtypes = one_model.runner(info, device, cpu_ops)
    self.layout_rewrites: dict[str, int] = {}
    # for images the warp is left lazy: the model's first kernel gathers, converts to fp16 and lays out its input image in
    # one pass, where the warp's own kernel would write 1.4 MB of uint8 for that kernel to read back; and the matrix is
    # built in (a crop on the 1928x1208 cameras). Elsewhere the warp is openpilot's: its own kernel, the matrix read from
    # memory (CPU and CUDA artifacts keep the kernels their shipped search sets hold).
    self.fold_warp = image_layout.images()
    self.warp_m = self.matrix if self.fold_warp else Tensor(self.matrix, device=device).realize()

  def warp_form(self) -> str:
    """How the program applies its matrix: 'crop' (an integer translation inside the frame), 'constants', or 'memory'."""
    if isinstance(self.warp_m, Tensor):
      return "memory"
    return "crop" if integer_crop(self.matrix, self.nv12, *DM_INPUT_SIZE) is not None else "constants"

  def warp(self, frame: Tensor) -> Tensor:
    img = warp_y(frame, self.warp_m, self.nv12, *DM_INPUT_SIZE, border=self.border)
    if not self.fold_warp:
      img = img.contiguous()
      with Context(SPLIT_REDUCEOP=0):   # a gather over the frame: split reduces would make it many partial passes
        img.realize()
    return img.reshape(1, -1)

  def run(self, frame: Tensor, calib: Tensor) -> Tensor:
    img = self.warp(frame)
    feeds = {"input_img": img.cast(self.dtypes["input_img"]), "calib": calib.to(self.device).cast(self.dtypes["calib"])}
    return next(iter(self.model(feeds).values())).cast(dtypes.float32).realize()

  def jit(self) -> Any:
    return TinyJit(self.run, prune=True)
