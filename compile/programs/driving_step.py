"""The per-frame driving program, all on the device: warp -> image queues -> vision -> feature queue -> desire queue -> policy.

Shaped like openpilot's fused modeld (variant D): the queues live on the device and the whole step is one TinyJit, with a
second warp-only JIT for dropped frames (image queues advance, the feature and desire queues do not).
"""
from __future__ import annotations

from typing import Any

from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.helpers import Context
from tinygrad.nn.onnx import OnnxRunner

from compile.onnx_model import OnnxModelInfo
from compile.programs.warp import warp_nv12
from modeld_msm.constants import DESIRE_LEN, FEATURE_LEN, FRAME_SKIP, INPUT_HISTORY_BUFFER_LEN, N_FRAMES
from selfdrive_glue.nv12 import NV12Info

HISTORY = INPUT_HISTORY_BUFFER_LEN          # policy timesteps
IMG_Q = FRAME_SKIP * (N_FRAMES - 1) + 1      # 5: rows 0 and 4 are frames t-4 and t
FEAT_Q = FRAME_SKIP * (HISTORY - 1) + 1      # 97: rows 0, 4, ..., 96
DESIRE_Q = FRAME_SKIP * HISTORY              # 100: max-pooled over groups of 4


def _push(q: Tensor, x: Tensor) -> Tensor:
  """Drop the oldest row, append x, in place on the device; returns the updated queue."""
  new = q[1:].cat(x.reshape(1, *q.shape[1:]).cast(q.dtype), dim=0).contiguous()
  return q.assign(new)


class DrivingProgram:
  def __init__(self, vision: OnnxModelInfo, policy: OnnxModelInfo, nv12: NV12Info, device: str, cpu_ops: bool = False):
    self.device, self.nv12 = device, nv12
    self.vision = OnnxRunner(vision.path).to(device)
    self.policy = OnnxRunner(policy.path).to(device)
    self.layout_rewrites: dict[str, int] = {}   # what the CPU layout rewrote in the models' files (set by build_program)
    if cpu_ops:  # the CPU layout's op table (compile/cpu/layout.py); the models' files were rewritten by the caller
      from compile.cpu import layout as cpu_layout
      cpu_layout.apply(self.vision)
      cpu_layout.apply(self.policy)
    self.vision_dtypes = {k: v.dtype for k, v in self.vision.graph_inputs.items()}
    self.policy_dtypes = {k: v.dtype for k, v in self.policy.graph_inputs.items()}
    self.hidden = vision.output_slices["hidden_state"]
    if self.hidden.stop - self.hidden.start != FEATURE_LEN:
      from selfdrive_glue.errors import UserError
      raise UserError(f"vision hidden_state slice {self.hidden} is not {FEATURE_LEN} wide")
    self.img_q = Tensor.zeros(IMG_Q, 6, 128, 256, dtype=dtypes.uint8, device=device).contiguous().realize()
    self.big_img_q = Tensor.zeros(IMG_Q, 6, 128, 256, dtype=dtypes.uint8, device=device).contiguous().realize()
    self.feat_q = Tensor.zeros(FEAT_Q, 1, FEATURE_LEN, dtype=dtypes.float32, device=device).contiguous().realize()
    self.desire_q = Tensor.zeros(DESIRE_Q, 1, DESIRE_LEN, dtype=dtypes.float32, device=device).contiguous().realize()

  def queues(self) -> dict[str, Tensor]:
    return {"img_q": self.img_q, "big_img_q": self.big_img_q, "feat_q": self.feat_q, "desire_q": self.desire_q}

  def _warp(self, frame: Tensor, big_frame: Tensor, tfm: Tensor, big_tfm: Tensor) -> tuple[Tensor, Tensor]:
    tfm, big_tfm = tfm.to(self.device).cast(dtypes.float32), big_tfm.to(self.device).cast(dtypes.float32)
    # contiguous: left lazy, the gather fuses into the queue shift and runs for every row of the queue (20x slower on CPU)
    img_q = _push(self.img_q, warp_nv12(frame, tfm, self.nv12).contiguous())
    big_img_q = _push(self.big_img_q, warp_nv12(big_frame, big_tfm, self.nv12).contiguous())
    # the warp is a gather over the whole frame; split reduces would turn it into 32 partial passes (6x slower on CPU)
    with Context(SPLIT_REDUCEOP=0):
      Tensor.realize(img_q, big_img_q)
    pick = [0, IMG_Q - 1]
    return img_q[pick].reshape(1, N_FRAMES * 6, 128, 256), big_img_q[pick].reshape(1, N_FRAMES * 6, 128, 256)

  def run_warp(self, frame: Tensor, big_frame: Tensor, desire: Tensor, traffic_convention: Tensor, tfm: Tensor, big_tfm: Tensor) -> Tensor:
    img, _ = self._warp(frame, big_frame, tfm, big_tfm)
    return img.realize()  # the queues, realized inside _warp, are the state that matters

  def run_policy(self, frame: Tensor, big_frame: Tensor, desire: Tensor, traffic_convention: Tensor, tfm: Tensor,
                 big_tfm: Tensor) -> tuple[Tensor, Tensor]:
    img, big_img = self._warp(frame, big_frame, tfm, big_tfm)
    vin = {"img": img, "big_img": big_img}
    vision_out = next(iter(self.vision({k: v.cast(self.vision_dtypes[k]) for k, v in vin.items()}).values())).cast(dtypes.float32)
    feat_q = _push(self.feat_q, vision_out[:, self.hidden])
    features = feat_q[0::FRAME_SKIP].reshape(1, HISTORY, FEATURE_LEN)
    desire_q = _push(self.desire_q, desire.to(self.device).cast(dtypes.float32))
    pulses = desire_q.reshape(HISTORY, FRAME_SKIP, 1, DESIRE_LEN).max(1).reshape(1, HISTORY, DESIRE_LEN)
    pin = {"features_buffer": features, "desire_pulse": pulses, "traffic_convention": traffic_convention.to(self.device)}
    policy_out = next(iter(self.policy({k: v.cast(self.policy_dtypes[k]) for k, v in pin.items()}).values())).cast(dtypes.float32)
    Tensor.realize(vision_out, policy_out, self.img_q, self.big_img_q, self.feat_q, self.desire_q)
    return vision_out, policy_out

  def jits(self) -> tuple[Any, Any]:
    return TinyJit(self.run_policy, prune=True), TinyJit(self.run_warp, prune=True)

  def reset_queues(self) -> None:
    from tinygrad.device import Buffer
    for q in self.queues().values():
      buf = q.uop.buffer
      assert isinstance(buf, Buffer)
      zeros = Buffer("PYTHON", buf.size, buf.dtype, opaque=memoryview(bytearray(buf.nbytes)))
      buf.copy_from(zeros)
