"""The per-frame program of master's stateful driving model (since 2026-09), all on the device: one packed host buffer
uploaded -> both cameras warped -> new_img (2,6,128,256) -> driving_supercombo.onnx with its state inputs -> each next_X
written back into X in place.

Its one input is master's packed uint8 buffer, copied to the device in one go: the two transforms (2,3,3), then the graph's
host inputs in the graph's order, then both NV12 frames, each member at a multiple of 128 bytes (artifact/kinds.py
packed_layout, from the graph's inputs and the camera size); the warp and the model read views of the uploaded copy.

The states are whatever the graph declares (an input X with an output next_X: compile/stateful_contract.py): names, shapes
and dtypes come from the model, zeroed device buffers that the captured program reads and overwrites in one step, never
through the host. Every received frame runs the whole step: master has no warp-only step, a dropped frame is simply not
in the history.
"""
from __future__ import annotations

from math import prod
from typing import Any

from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.helpers import Context

from artifact.kinds import FRAME, HOST, IO, packed_layout
from compile.onnx_model import OnnxModelInfo
from compile.programs import one_model
from compile.programs.warp import warp_nv12
from compile.stateful_contract import NEXT, OUTPUT
from selfdrive_glue.nv12 import NV12Info

_DTYPES = {"uint8": dtypes.uint8, "float16": dtypes.float16, "float32": dtypes.float32}


def graph_states(info: OnnxModelInfo) -> dict[str, tuple[tuple[int, ...], str]]:
  """{state input: (shape, dtype)} as the model declares them."""
  return {name: (tuple(shape), info.input_dtypes[name]) for name, shape in info.input_shapes.items() if NEXT + name in info.output_shapes}


def packed_members(info: OnnxModelInfo) -> tuple[IO, ...]:
  """Master's packed host buffer for this graph: the transforms of both cameras (2,3,3) first, then every input of the graph
  that is neither a state nor new_img, in the graph's order, as float32 (the host's; the graph casts to its own precision),
  then the main and the extra camera's frames."""
  states = graph_states(info)
  host = tuple(IO(n, HOST, tuple(s)) for n, s in info.input_shapes.items() if n != "new_img" and n not in states)
  return (IO("tfm", HOST, (2, 3, 3)), *host, IO("frame", FRAME, dtype="uint8"), IO("big_frame", FRAME, dtype="uint8"))


class StatefulProgram:
  def __init__(self, info: OnnxModelInfo, nv12: NV12Info, device: str, cpu_ops: bool = False):
    self.device, self.nv12 = device, nv12
    self.model, self.dtypes = one_model.runner(info, device, cpu_ops)
    self.layout_rewrites: dict[str, int] = {}
    _, self.layout = packed_layout(packed_members(info), (nv12.width, nv12.height))
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

  def unpack(self, packed: Tensor) -> dict[str, Tensor]:
    """Views of the uploaded buffer by member name: a byte range each, bitcast to its dtype and shaped (no kernel of its
    own: the readers index the one device buffer)."""
    out = {}
    for m in self.layout:
      view = packed[m["offset"]:m["offset"] + _DTYPES[m["dtype"]].itemsize * prod(m["shape"])]
      out[m["name"]] = view.bitcast(_DTYPES[m["dtype"]]).reshape(*m["shape"])
    return out

  def run_step(self, packed: Tensor) -> Tensor:
    p = packed.to(self.device)   # the frame's one host->device copy
    v = self.unpack(p)
    tfm = v["tfm"]
    new_img = Tensor.stack(warp_nv12(v["frame"], tfm[0], self.nv12), warp_nv12(v["big_frame"], tfm[1], self.nv12)).contiguous()
    with Context(SPLIT_REDUCEOP=0):   # a gather over the frame: split reduces would make it many partial passes
      new_img.realize()
    # every state read also reads a byte of the uploaded buffer (a select true for any byte): tinygrad's prune keeps a kernel
    # only once it touches an input-dependent buffer, and a kernel reading nothing but a state would be frozen at capture
    always = (p[0] | 1) != 0
    states = {name: always.where(t, 0).cast(t.dtype) for name, t in self.states.items()}
    host = {m["name"]: v[m["name"]] for m in self.layout if m["role"] == HOST and m["name"] != "tfm"}
    feeds: dict[str, Any] = {"new_img": new_img, **host, **states}
    outs = self.model({k: t.cast(self.dtypes[k]) for k, t in feeds.items()})
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
