"""Loading a verified artifact: open its device, unpickle its programs through the allowlist, check their frame inputs.

The car runs this, and only this, of the artifact code besides the checks in artifact/format.py: nothing here builds.
"""
from __future__ import annotations

import hashlib
import math
import os
from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes

from artifact import cpu_replay, cpu_threads
from artifact.format import METADATA, REBUILD_HINT, ArtifactError, VerifiedArtifact
from artifact.jit_pickle import PickleRefused, unpickle_programs
from artifact.kinds import FRAME
from selfdrive_glue.nv12 import CAMERA_SIZES, nv12_info


def activate_target(art: VerifiedArtifact) -> None:
  """Point tinygrad at the artifact's device/renderer before anything is unpickled (pickles open their device)."""
  from tinygrad.helpers import DEV
  target = os.environ.get("MODELD_DEV") or art.meta["load_target"]
  if art.device == "QCOM":
    import backend
    backend.install()
    backend.set_kernel_costs(art.meta.get("kernel_us") or {})   # before any graph binds: they are cut into submits by it
  DEV.value = target
  from tinygrad import Device
  try:
    Device[Device.DEFAULT]
  except Exception as e:
    raise ArtifactError(f"artifact {art.path} is for {art.device} ({target}), which cannot be opened here ({_why(e)}); "
                        f"use an artifact compiled for this machine (e.g. `modeld-msm compile --device CPU`)") from None
  if art.device == "CPU":   # its kernels' THREAD parts run on all cores, not one after another (artifact/cpu_threads.py)
    cpu_threads.install(Device.DEFAULT)


def _why(e: BaseException) -> str:
  """tinygrad tries each kernel interface and raises a group of failures: name each one, briefly."""
  if isinstance(e, BaseExceptionGroup):
    return "; ".join(_why(x) for x in e.exceptions)
  return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def frame_slots(spec: dict[str, Any]) -> tuple[int, ...]:
  """The argument positions of a program's camera frames (flat uint8 NV12), from its recorded inputs."""
  return tuple(i for i, io in enumerate(spec["inputs"]) if io["role"] == FRAME)


def load_programs(art: VerifiedArtifact) -> dict[str, Any]:
  """Unpickle the TinyJits of an already verified artifact, admitting only the classes a JIT needs; on a CPU each is replayed
  by artifact/cpu_replay.py. -> {program role ("step", "warp"): its JIT}."""
  activate_target(art)
  names = tuple(art.programs)
  try:
    jits = unpickle_programs(*(_read_checked(art, n) for n in names), names=names)
  except PickleRefused as e:
    raise ArtifactError(f"artifact {art.path} refused: {e}; {REBUILD_HINT}") from None
  _check_frame_inputs(art, jits)
  from tinygrad import Device

  return {art.programs[n]["role"]: cpu_replay.wrap(j, Device.DEFAULT) for n, j in zip(names, jits)}


def frame_input_bytes(jit: Any, slots: tuple[int, ...] = (0, 1)) -> dict[int, int]:
  """{argument position: bytes} of the camera frames (the arguments at `slots`, flat uint8) a captured JIT was built for,
  read off its own input parameters: the size is baked into its kernels, whatever metadata.json says."""
  from tinygrad.engine.realize import get_call_arg_uops
  from tinygrad.uop.ops import Ops
  sizes: dict[int, int] = {}
  for call in jit.captured._linear.src:   # a graph call lists every input it reads as its own argument, so one level suffices
    if call.op is not Ops.CALL:
      continue
    for u in (p for a in get_call_arg_uops(call) for p in a.toposort() if p.op is Ops.PARAM and p.arg.slot in slots):
      sizes[u.arg.slot] = max(sizes.get(u.arg.slot, 0), int(math.prod(u.shape)) * u.dtype.itemsize)
  return sizes


def _check_frame_inputs(art: VerifiedArtifact, jits: tuple[Any, ...]) -> None:
  # an unsigned artifact's metadata can be rewritten together with its manifest: the programs' own frame size is the check
  want = nv12_info(*art.camera).size
  for (name, spec), jit in zip(art.programs.items(), jits):
    got = set(frame_input_bytes(jit, frame_slots(spec)).values())
    if got and got != {want}:
      built = [c for c, wh in CAMERA_SIZES.items() if nv12_info(*wh).size in got]
      raise ArtifactError(f"artifact {art.path}: {METADATA} says camera {art.camera[0]}x{art.camera[1]} ({want}-byte frames), but {name} "
                          f"was compiled for {'/'.join(map(str, sorted(got)))}-byte frames ({', '.join(built) or 'another camera'}): "
                          f"the metadata was edited; {REBUILD_HINT}")


def _read_checked(art: VerifiedArtifact, name: str) -> bytes:
  # hash the exact bytes we unpickle, so a file swapped after verify_artifact is still refused
  data = (art.path / name).read_bytes()
  if hashlib.sha256(data).hexdigest() != art.digests[name]:
    raise ArtifactError(f"artifact {art.path}: {name} changed after verification; {REBUILD_HINT}")
  return data


def frame_tensor(buf: np.ndarray, device: str):
  """A flat uint8 device tensor over a camera buffer: zero-copy on CPU (the buffer must outlive the tensor)."""
  if device.split(":")[0] == "CPU":
    return Tensor.from_blob(buf.ctypes.data, (buf.size,), dtype=dtypes.uint8, device=device)
  return Tensor(buf, device=device)


def read_output(t: Tensor) -> np.ndarray:
  """A program output's values on the host, flat, copied straight out of its device buffer. Tensor.numpy() schedules and
  runs a copy program on every call, host time paid for each output of every frame (measured in docs/performance-cpu.md
  §6 and docs/gpu.md). Every tinygrad allocator's copyout
  synchronises the device first, so this is the same read. Falls back to numpy() for anything but a whole, realized buffer."""
  from tinygrad.device import Buffer
  from tinygrad.helpers import prod
  from tinygrad.uop.ops import Ops
  np_dtype = np.dtype(t.dtype.fmt) if t.dtype.fmt else None
  u = t.uop
  while u.op is Ops.RESHAPE:   # the JIT hands its outputs back reshaped; any other view falls back
    u = u.src[0]
  buf = u.buffer if u.op is Ops.BUFFER else None
  if (not isinstance(buf, Buffer) or np_dtype is None or not buf.is_allocated() or buf.size != prod(t.shape)
      or getattr(buf._buf, "size", buf.nbytes) != buf.nbytes):   # QCOM's copyout copies the whole allocation
    return t.numpy().reshape(-1)
  out = np.empty(buf.size, np_dtype)
  buf.allocator._copyout(memoryview(out.data).cast("B"), buf._buf)
  return out
