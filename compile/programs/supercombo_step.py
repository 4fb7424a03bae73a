"""The per-frame program of master's combined driving model, all on the device: warp -> image queues -> desire queue ->
the 24 past features -> driving_supercombo.onnx -> this frame's hidden state into the feature queue.

Master's modeld (docs/openpilot-master-and-dm.md §A.4-A.5) keeps a 96-row queue of past hidden states, samples every 4th
row (h(t-96) ... h(t-4)), runs the model (which appends h(t) itself) and then sends h(t) back to the host to push it at the
next frame: "a stated workaround, corrupt on QCOM for now". Here h(t) stays on the device and is pushed at the end of this
frame's run; the next run samples the same rows master's would (the queue then holds h(t-95) ... h(t)). A dropped frame
runs the warp-only program, as 0.11's: the image queues advance, the feature and desire queues do not.

The warp and the image queues are DrivingProgram's (compile/programs/driving_step.py, untouched: it is part of the shipped kernel
searches' fingerprint).
"""
from __future__ import annotations

from tinygrad import Tensor, TinyJit, dtypes

from compile.onnx_model import OnnxModelInfo
from compile.programs import one_model
from compile.programs.driving_step import DESIRE_Q, IMG_Q, DrivingProgram, _push
from modeld_msm.constants import DESIRE_LEN, FEATURE_LEN, FRAME_SKIP
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import NV12Info

PAST = 24                                 # past features the combined model is fed
FEAT_Q = FRAME_SKIP * PAST                # 96: rows 0, 4, ..., 92 are h(t-96) ... h(t-4)
HISTORY = PAST + 1                        # desire pulses: this frame's group included


class SupercomboProgram(DrivingProgram):
  # DrivingProgram's __init__ is not called: it builds two runners and 0.11's 97-row feature queue; this builds one and 96
  def __init__(self, info: OnnxModelInfo, nv12: NV12Info, device: str, cpu_ops: bool = False):
    self.device, self.nv12 = device, nv12
    self.model, self.dtypes = one_model.runner(info, device, cpu_ops)
    self.layout_rewrites: dict[str, int] = {}
    self.hidden = info.output_slices["hidden_state"]
    if self.hidden.stop - self.hidden.start != FEATURE_LEN:
      raise UserError(f"supercombo hidden_state slice {self.hidden} is not {FEATURE_LEN} wide")
    zeros = lambda *shape, dtype=dtypes.float32: Tensor.zeros(*shape, dtype=dtype, device=device).contiguous().realize()   # noqa: E731
    self.img_q, self.big_img_q = zeros(IMG_Q, 6, 128, 256, dtype=dtypes.uint8), zeros(IMG_Q, 6, 128, 256, dtype=dtypes.uint8)
    self.feat_q, self.desire_q = zeros(FEAT_Q, 1, FEATURE_LEN), zeros(DESIRE_Q, 1, DESIRE_LEN)

  def run_warp(self, frame: Tensor, big_frame: Tensor, desire: Tensor, traffic_convention: Tensor, action_t: Tensor,   # type: ignore[override]
               tfm: Tensor, big_tfm: Tensor) -> Tensor:
    img, _ = self._warp(frame, big_frame, tfm, big_tfm)
    return img.realize()

  def run_policy(self, frame: Tensor, big_frame: Tensor, desire: Tensor, traffic_convention: Tensor, action_t: Tensor,   # type: ignore[override]
                 tfm: Tensor, big_tfm: Tensor) -> Tensor:
    img, big_img = self._warp(frame, big_frame, tfm, big_tfm)
    # the past features are read before this frame's hidden state is pushed: realized first, so the push cannot race them.
    # The gather also reads the traffic convention's bits (a select true for any bits): tinygrad's prune keeps a kernel only
    # once it touches an input-dependent buffer, and this one otherwise reads nothing but the queue
    always = (traffic_convention.to(self.device).bitcast(dtypes.int32)[0, 0] | 1) != 0
    features = always.where(self.feat_q[0::FRAME_SKIP], 0.0).reshape(1, PAST, FEATURE_LEN).contiguous().realize()
    desire_q = _push(self.desire_q, desire.to(self.device).cast(dtypes.float32))
    pulses = desire_q.reshape(HISTORY, FRAME_SKIP, 1, DESIRE_LEN).max(1).reshape(1, HISTORY, DESIRE_LEN)
    feeds = {"img": img, "big_img": big_img, "features_buffer": features, "desire_pulse": pulses,
             "traffic_convention": traffic_convention.to(self.device), "action_t": action_t.to(self.device)}
    out = next(iter(self.model({k: v.cast(self.dtypes[k]) for k, v in feeds.items()}).values())).cast(dtypes.float32)
    out.realize()
    _push(self.feat_q, out[:, self.hidden])
    Tensor.realize(self.img_q, self.big_img_q, self.feat_q, self.desire_q)
    return out

  def jits(self):
    # pruned like the split program's, so the constant weights' layout conversions run once at capture, not every frame
    # (45 dispatches, ~96 MB written and read per frame at master's size); the gather of the past features is kept per
    # frame by its read of an input (run_policy): without it, it was frozen at capture (outputs drifted from the 5th step)
    return TinyJit(self.run_policy, prune=True), TinyJit(self.run_warp, prune=True)
