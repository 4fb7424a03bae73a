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
from modeld_msm.host_inputs import HostInputs
from modeld_msm.parse_outputs import parse_policy_outputs, parse_vision_outputs, slice_outputs
from selfdrive_glue.nv12 import nv12_info


class ModelState:
  def __init__(self, artifact: str | Path | VerifiedArtifact, device: str | None = None, camera: tuple[int, int] | None = None):
    self.artifact = artifact if isinstance(artifact, VerifiedArtifact) else verify_artifact(artifact, device=device, camera=camera)
    self.policy_jit, self.warp_jit = load_programs(self.artifact)
    from tinygrad import Device
    self.device = Device.DEFAULT
    self.nv12 = nv12_info(*self.artifact.camera)
    # master's combined model (kind supercombo) is one program with one output and an action_t input; 0.11's, two outputs
    self.combined = self.artifact.kind == "supercombo"
    if self.combined:
      self.slices = self.artifact.output_slices("supercombo")
    else:
      self.vision_slices = self.artifact.output_slices("vision")
      self.policy_slices = self.artifact.output_slices("policy")
    self.host = HostInputs.zeros()
    self.host_t = self.host.tensors()
    self.action_t = np.zeros((1, 2), np.float32)   # [lateral, longitudinal] action delay, s (combined model only)
    self.action_t_t = Tensor(self.action_t, device="NPY")
    self.prev_desire = np.zeros(DESIRE_LEN, np.float32)
    self.frames = FrameTensors(self.device, self.nv12)
    self.last_times = (0.0, 0.0)  # (device program incl. readback, host parse) of the last run, seconds
    self.state_buffers: list[Any] | None = None  # the JITs' device buffers that carry state between calls (found on first reset)
    self._zero = np.zeros(self.nv12.size, np.uint8)  # the warm-up frame tensors point into it
    self._warm_up()

  def _warm_up(self) -> None:
    self._call(self.warp_jit, self._frame("main", self._zero), self._frame("extra", self._zero))  # like openpilot: warm the warp once

  def reset(self) -> None:
    """Back to the state of a freshly loaded artifact (device queues zero, desire pulse and host inputs cleared, warp warmed),
    keeping the loaded programs, so one load serves many segments. When the programs' state buffers cannot be identified
    (a JIT shape this code does not know), the programs are loaded again instead: slower, never wrong."""
    if self.state_buffers is None:
      self.state_buffers = _state_buffers(self.policy_jit, self.warp_jit)
    if self.state_buffers:
      from tinygrad.device import Buffer
      for buf in self.state_buffers:
        buf.copy_from(Buffer("PYTHON", buf.size, buf.dtype, opaque=memoryview(bytearray(buf.nbytes))))
    else:
      self.policy_jit, self.warp_jit = load_programs(self.artifact)
    for a in (self.host.desire, self.host.traffic_convention, self.host.tfm, self.host.big_tfm, self.prev_desire, self.action_t):
      a[...] = 0
    self.last_times = (0.0, 0.0)
    self._warm_up()

  def _frame(self, key: str, buf: np.ndarray, upload: bool = False):
    return self.frames.get(key, buf, upload)

  def _call(self, jit, frame, big_frame):
    h = self.host_t
    if self.combined:
      return jit(frame, big_frame, h["desire"], h["traffic_convention"], self.action_t_t, h["tfm"], h["big_tfm"])
    return jit(frame, big_frame, h["desire"], h["traffic_convention"], h["tfm"], h["big_tfm"])

  def run(self, buf: np.ndarray, big_buf: np.ndarray, tfm: np.ndarray, big_tfm: np.ndarray, desire: np.ndarray,
          traffic_convention: np.ndarray, prepare_only: bool,
          action_t: np.ndarray | None = None) -> tuple[dict[str, np.ndarray] | None, np.ndarray | None]:
    """-> (parsed outputs, raw concat) or (None, None) on a prepare-only (dropped) frame. action_t: [[lateral,
    longitudinal]] action delays in s, which master's combined model reads (ignored by 0.11's)."""
    desire = np.asarray(desire, np.float32).copy()
    desire[0] = 0
    # a pulse only on rising edges; prev is updated on dropped frames too, so an edge there is lost (as in openpilot)
    self.host.desire[:] = np.where(desire - self.prev_desire > .99, desire, 0)
    self.prev_desire[:] = desire
    self.host.traffic_convention[:] = traffic_convention
    self.host.tfm[:] = tfm
    self.host.big_tfm[:] = big_tfm
    if action_t is not None:
      self.action_t[:] = action_t
    frame, big_frame = self._frame("main", buf, upload=True), self._frame("extra", big_buf, upload=True)
    if prepare_only:
      t0 = time.perf_counter()
      self._call(self.warp_jit, frame, big_frame)
      self.last_times = (time.perf_counter() - t0, 0.0)
      return None, None
    t0 = time.perf_counter()
    if self.combined:
      raw = read_output(self._call(self.policy_jit, frame, big_frame))
      t1 = time.perf_counter()
      out = parse_policy_outputs(parse_vision_outputs(slice_outputs(raw, self.slices)))
    else:
      v, p = self._call(self.policy_jit, frame, big_frame)
      vision, policy = read_output(v), read_output(p)
      t1 = time.perf_counter()
      out = {**parse_vision_outputs(slice_outputs(vision, self.vision_slices)), **parse_policy_outputs(slice_outputs(policy, self.policy_slices))}
      raw = np.concatenate([vision, policy])
    self.last_times = (t1 - t0, time.perf_counter() - t1)
    if SEND_RAW_PRED:
      out["raw_pred"] = raw.copy()
    return out, raw


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
