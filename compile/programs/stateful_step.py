"""The per-frame program of master's stateful driving model (since 2026-09), all on the device: both cameras warped ->
new_img (2,6,128,256) -> driving_supercombo.onnx with its state inputs -> each next_X written back into X in place.

The states are whatever the graph declares (an input X with an output next_X: compile/stateful_contract.py): names, shapes
and dtypes come from the model, zeroed device buffers that the captured program reads and overwrites in one step, never
through the host. Every received frame runs the whole step: master has no warp-only step, a dropped frame is simply not
in the history.
"""
from __future__ import annotations

from typing import Any

from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.helpers import Context

from compile.onnx_model import OnnxModelInfo
from compile.programs import one_model
from compile.programs.warp import warp_nv12
from compile.stateful_contract import NEXT, OUTPUT
from selfdrive_glue.nv12 import NV12Info

_DTYPES = {"uint8": dtypes.uint8, "float16": dtypes.float16, "float32": dtypes.float32}


def graph_states(info: OnnxModelInfo) -> dict[str, tuple[tuple[int, ...], str]]:
  """{state input: (shape, dtype)} as the model declares them."""
  return {name: (tuple(shape), info.input_dtypes[name]) for name, shape in info.input_shapes.items() if NEXT + name in info.output_shapes}


class StatefulProgram:
  def __init__(self, info: OnnxModelInfo, nv12: NV12Info, device: str, cpu_ops: bool = False):
    self.device, self.nv12 = device, nv12
    self.model, self.dtypes = one_model.runner(info, device, cpu_ops)
    self.layout_rewrites: dict[str, int] = {}
    self.state_specs = graph_states(info)
    self.states = {name: Tensor.zeros(*shape, dtype=_DTYPES[dt], device=device).contiguous().realize()
                   for name, (shape, dt) in self.state_specs.items()}

  @staticmethod
  def state_line(info: OnnxModelInfo) -> str:
    return ", ".join(f"{n} {dt} {'x'.join(map(str, shape))}" for n, (shape, dt) in graph_states(info).items())

  def queues(self) -> dict[str, Tensor]:
    return self.states

  def reset_queues(self) -> None:
    from tinygrad.device import Buffer
    for t in self.states.values():
      buf = t.uop.buffer
      assert isinstance(buf, Buffer)
      buf.copy_from(Buffer("PYTHON", buf.size, buf.dtype, opaque=memoryview(bytearray(buf.nbytes))))

  def run_step(self, frame: Tensor, big_frame: Tensor, desire: Tensor, traffic_convention: Tensor, action_t: Tensor, tfm: Tensor,
               big_tfm: Tensor) -> Tensor:
    tfm, big_tfm = tfm.to(self.device).cast(dtypes.float32), big_tfm.to(self.device).cast(dtypes.float32)
    new_img = Tensor.stack(warp_nv12(frame, tfm, self.nv12), warp_nv12(big_frame, big_tfm, self.nv12)).contiguous()
    with Context(SPLIT_REDUCEOP=0):   # a gather over the frame: split reduces would make it many partial passes
      new_img.realize()
    # every state read also reads the traffic convention's bits (a select true for any bits): tinygrad's prune keeps a kernel
    # only once it touches an input-dependent buffer, and a kernel reading nothing but a state would be frozen at capture
    always = (traffic_convention.to(self.device).bitcast(dtypes.int32)[0, 0] | 1) != 0
    states = {name: always.where(t, 0).cast(t.dtype) for name, t in self.states.items()}
    feeds: dict[str, Any] = {"new_img": new_img, "desire": desire.to(self.device), "traffic_convention": traffic_convention.to(self.device),
                             "action_t": action_t.to(self.device), **states}
    outs = self.model({k: v.cast(self.dtypes[k]) for k, v in feeds.items()})
    out = outs[OUTPUT].cast(dtypes.float32).reshape(1, -1).contiguous()
    nexts = {name: outs[NEXT + name].cast(t.dtype).contiguous() for name, t in self.states.items()}
    Tensor.realize(out, *nexts.values())   # every next value computed from this frame's states before any state is overwritten
    for name, t in self.states.items():
      t.assign(nexts[name])
    Tensor.realize(*self.states.values())
    return out

  def jits(self) -> Any:
    # pruned, so the constant weights' layout conversions run once at capture, not every frame; the states' reads are kept per
    # frame by their read of an input (run_step)
    return TinyJit(self.run_step, prune=True)
