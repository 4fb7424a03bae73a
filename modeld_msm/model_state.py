"""Runs a verified artifact: host inputs, the desire pulse, frame tensors over camera buffers, output slicing + parsing."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from tinygrad import Tensor

from artifact.format import VerifiedArtifact, verify_artifact
from artifact.load import load_programs, read_output
from modeld_msm.constants import DESIRE_LEN, SEND_RAW_PRED
from modeld_msm.frame_tensors import FrameTensors
from modeld_msm.named_program import NamedProgram, host_arrays, host_tensors
from modeld_msm.parse_outputs import parse_policy_outputs, parse_vision_outputs, slice_outputs
from selfdrive_glue.nv12 import nv12_info

# what modeld writes into a driving program's host inputs every frame; a program reading anything else is refused at load
PROVIDED = {"frame", "big_frame", "desire", "traffic_convention", "tfm", "big_tfm", "action_t"}


class ModelState:
  def __init__(self, artifact: str | Path | VerifiedArtifact, device: str | None = None, camera: tuple[int, int] | None = None):
    self.artifact = artifact if isinstance(artifact, VerifiedArtifact) else verify_artifact(artifact, device=device, camera=camera,
                                                                                             process="modeld")
    self._load()
    from tinygrad import Device
    self.device = Device.DEFAULT
    self.nv12 = nv12_info(*self.artifact.camera)
    # each output of the step is cut by the output_slices of the model it comes from (vision, policy; or the one model)
    self.slices = {io["name"]: self.artifact.output_slices(io["slices"]) for io in self.artifact.program("step")[1]["outputs"]}
    self.host = host_arrays(self.artifact.program("step")[1])
    self.host_t = host_tensors(self.host)
    self.prev_desire = np.zeros(DESIRE_LEN, np.float32)
    self.frames = FrameTensors(self.device, self.nv12)
    self.last_times = (0.0, 0.0)  # (device program incl. readback, host parse) of the last run, seconds
    self.state_buffers: list[Any] | None = None  # the JITs' device buffers that carry state between calls (found on first reset)
    self._zero = np.zeros(self.nv12.size, np.uint8)  # the warm-up frame tensors point into it
    self._warm_up()

  def _load(self) -> None:
    self.programs = {}
    for role, jit in load_programs(self.artifact).items():
      file, spec = self.artifact.program(role)
      self.programs[role] = NamedProgram(jit, spec, file)
    for p in self.programs.values():
      p.require(PROVIDED)
    # a kind without a warp program (master's stateful model) runs the whole step on every frame, dropped ones before it or not
    self.step, self.warp = self.programs["step"], self.programs.get("warp")

  def _warm_up(self) -> None:
    if self.warp is not None:   # like openpilot: warm the warp once
      self._call(self.warp, {"frame": self._frame("main", self._zero), "big_frame": self._frame("extra", self._zero)})

  def reset(self) -> None:
    """Back to the state of a freshly loaded artifact (device queues zero, desire pulse and host inputs cleared, warp warmed),
    keeping the loaded programs, so one load serves many segments. When the programs' state buffers cannot be identified
    (a JIT shape this code does not know), the programs are loaded again instead: slower, never wrong."""
    if self.state_buffers is None:
      self.state_buffers = _state_buffers(*(p.jit for p in self.programs.values()))
    if self.state_buffers:
      from tinygrad.device import Buffer
      for buf in self.state_buffers:
        buf.copy_from(Buffer("PYTHON", buf.size, buf.dtype, opaque=memoryview(bytearray(buf.nbytes))))
    else:
      self._load()
    for a in (*self.host.values(), self.prev_desire):
      a[...] = 0
    self.last_times = (0.0, 0.0)
    self._warm_up()

  def _frame(self, key: str, buf: np.ndarray, upload: bool = False):
    return self.frames.get(key, buf, upload)

  def _frames_in(self, buf: np.ndarray, big_buf: np.ndarray) -> dict[str, Tensor]:
    """The frames as the programs take them: a frame that is a member of a packed host buffer has its bytes copied into it
    (uploaded with the rest in the program's one copy, as master does); any other is a device tensor (FrameTensors)."""
    out = {}
    for name, key, b in (("frame", "main", buf), ("big_frame", "extra", big_buf)):
      if (dst := self.host.get(name)) is not None:
        if b.dtype != np.uint8 or b.size < dst.size:
          raise ValueError(f"camera buffer of {b.size} bytes ({b.dtype}) is smaller than the {dst.size}-byte NV12 frame")
        dst[:] = b.reshape(-1)[:dst.size]
      else:
        out[name] = self._frame(key, b, upload=True)
    return out

  def _call(self, program: NamedProgram, frames: dict[str, Tensor]) -> dict[str, Tensor]:
    return program({**frames, **self.host_t})

  def run(self, buf: np.ndarray, big_buf: np.ndarray, tfm: np.ndarray, big_tfm: np.ndarray, desire: np.ndarray,
          traffic_convention: np.ndarray, prepare_only: bool,
          action_t: np.ndarray | None = None) -> tuple[dict[str, np.ndarray] | None, np.ndarray | None]:
    """-> (parsed outputs, raw concat) or (None, None) on a prepare-only (dropped) frame. action_t: [[lateral,
    longitudinal]] action delays in s, for a program that reads them (master's combined model; 0.11's does not)."""
    desire = np.asarray(desire, np.float32).copy()
    desire[0] = 0
    # a pulse only on rising edges; prev is updated on dropped frames too, so an edge there is lost (as in openpilot)
    self.host["desire"][:] = np.where(desire - self.prev_desire > .99, desire, 0)
    self.prev_desire[:] = desire
    self.host["traffic_convention"][:] = traffic_convention
    if "big_tfm" in self.host:
      self.host["tfm"][:] = tfm
      self.host["big_tfm"][:] = big_tfm
    else:   # one input holds both cameras' transforms, main first (master's packed (2,3,3))
      self.host["tfm"][:] = (tfm, big_tfm)
    if action_t is not None and "action_t" in self.host:
      self.host["action_t"][:] = action_t
    frames = self._frames_in(buf, big_buf)
    if prepare_only and self.warp is not None:
      t0 = time.perf_counter()
      self._call(self.warp, frames)
      self.last_times = (time.perf_counter() - t0, 0.0)
      return None, None
    t0 = time.perf_counter()
    raws = {name: read_output(t) for name, t in self._call(self.step, frames).items()}
    t1 = time.perf_counter()
    sliced: dict[str, np.ndarray] = {}
    for name, raw in raws.items():
      sliced.update(slice_outputs(raw, self.slices[name]))
    out = parse_policy_outputs(parse_vision_outputs(sliced))
    raw = np.concatenate(list(raws.values())) if len(raws) > 1 else next(iter(raws.values()))
    self.last_times = (t1 - t0, time.perf_counter() - t1)
    if SEND_RAW_PRED:
      out["raw_pred"] = raw.copy()
    return out, raw

  @property
  def reads_action_t(self) -> bool:
    return "action_t" in self.host


def _state_buffers(*jits) -> list[Any]:
  """Device buffers the captured programs read before they write them in a call: the image, feature and desire queues.

  Weights are only read and intermediates are written before they are read, so neither is touched by a reset. Found
  from the kernels' declared outputs and inputs in call order; [] when a call's accesses are not declared (e.g. a
  device graph batching several kernels), which makes the caller fall back to reloading."""
  try:
    from tinygrad.engine.realize import get_call_arg_uops, get_call_outs_ins
    from tinygrad.uop.ops import Ops, buffers
    state: dict[int, Any] = {}
    for jit in jits:
      first: dict[Any, str] = {}  # buffer uop -> "read" or "write", whichever a call did first
      written: set[Any] = set()
      for call in jit.captured.linear.src:
        if call.op is not Ops.CALL or call.src[0].op not in (Ops.PROGRAM, Ops.COPY):
          return []
        args = get_call_arg_uops(call)
        outs, ins = get_call_outs_ins(call)
        for kind, idx in (("read", ins), ("write", outs)):
          for k in idx:
            u = args[k] if (cv := args[k].contiguous_view()) is None else cv[0]
            if u.op is Ops.BUFFER:
              first.setdefault(u, kind)
              if kind == "write":
                written.add(u)
      for u in written:
        if first[u] == "read" and (buf := buffers.get(u)) is not None:
          state[id(buf)] = buf
    return list(state.values())
  except (AttributeError, ImportError, IndexError, TypeError):
    return []
