"""One frame step of dmonitoringmodeld, shared by `serve-dm` (live) and replay: calibration + driver frame in,
driverStateV2 out. Like ModeldCore it never touches sockets or clocks of its own.

As openpilot's: calib is rpyCalib of the newest liveCalibration (or extrinsicsCalibration, the newest master's name;
zeros until the first), the warp matrix is the driver camera's (from the frame width; the artifact was built with it,
checked at load), every frame is run (no frame skip), and driverStateV2 goes out with valid=True.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from artifact.format import REBUILD_HINT, ArtifactError, VerifiedArtifact, verify_artifact
from artifact.load import load_programs, read_output
from modeld_msm.constants import SEND_RAW_PRED
from modeld_msm.dm_outputs import fill_driver_state, parse_dm_outputs
from modeld_msm.frame_tensors import FrameTensors
from modeld_msm.frames import Frame
from modeld_msm.inputs_check import CALIB_ANGLE, InputCheck
from modeld_msm.named_program import NamedProgram, host_arrays, host_tensors
from selfdrive_glue import messaging
from selfdrive_glue.camera import dm_warp_matrix
from selfdrive_glue.nv12 import nv12_info

log = logging.getLogger("dmonitoringmodeld")

SUBSCRIBED = ("liveCalibration", "extrinsicsCalibration")   # 0.11's and the newest master's name for the calibration
PUBLISHED = ("driverStateV2",)
PROVIDED = {"frame", "calib"}   # what this process feeds a driver-monitoring program


@dataclass
class DMStats:
  frames: int = 0
  published: int = 0
  dropped_steps: int = 0      # frames that could not be run (a bad buffer): nothing published for them
  nonfinite_steps: int = 0
  bad_inputs: int = 0
  last_model_s: float = 0.0
  last_gpu_s: float = 0.0     # the program's run and read-back alone (driverStateV2.gpuExecutionTime), as openpilot times it


def warp_matrix_of(artifact: VerifiedArtifact) -> np.ndarray:
  """The warp matrix the artifact's program was built with, refused unless it is the one openpilot computes for the
  artifact's camera (the program cannot take another)."""
  want = dm_warp_matrix(artifact.camera[0])
  got = np.asarray(artifact.meta.get("dm_warp", {}).get("matrix", np.full((3, 3), np.nan)), np.float32)
  if got.shape != (3, 3) or not np.array_equal(got, want):
    raise ArtifactError(f"artifact {artifact.path}: its DM warp matrix {got.tolist()} is not the {artifact.camera[0]}-wide driver "
                        f"camera's {want.tolist()}; {REBUILD_HINT}")
  return got


class DMonitoringCore:
  def __init__(self, artifact: str | Path | VerifiedArtifact, clock: Callable[[], float] | None = None, device: str | None = None,
               camera: tuple[int, int] | None = None):
    self.artifact = artifact if isinstance(artifact, VerifiedArtifact) else verify_artifact(artifact, device=device, camera=camera,
                                                                                             process="dmonitoringmodeld")
    file, spec = self.artifact.program("step")
    self.program = NamedProgram(load_programs(self.artifact)["step"], spec, file)
    self.program.require(PROVIDED)
    from tinygrad import Device
    self.camera = self.artifact.camera
    self.warp_matrix = warp_matrix_of(self.artifact)
    self.frames = FrameTensors(Device.DEFAULT, nv12_info(*self.camera))
    (out,) = spec["outputs"]
    self.slices = self.artifact.output_slices(out["slices"])
    self.host = host_arrays(spec)
    self.host_t = host_tensors(self.host)
    self.clock = clock or time.perf_counter
    self.reset()

  def reset(self) -> None:
    """Forget calibration and counters (the program keeps no state between frames): the next step is a first step."""
    self.host["calib"][...] = 0
    self.stats = DMStats()
    self.inputs = InputCheck(log, self.stats)   # every number read from a message: checked, counted in stats.bad_inputs
    self._nonfinite_burst = False

  def switch_main(self, main_wide: bool) -> None:
    pass   # one camera: nothing to switch

  def on_message(self, evt) -> None:
    if (which := evt.which()) in SUBSCRIBED:
      self.on_member(which, getattr(evt, which))

  def on_member(self, which: str, msg) -> None:
    if which not in SUBSCRIBED:
      return
    # a bad one keeps the last calib; never fatal
    if (rpy := self.inputs.vector(f"{which}.rpyCalib", msg.rpyCalib, 3, CALIB_ANGLE)) is not None:
      self.host["calib"][0] = rpy

  def run(self, buf: np.ndarray) -> np.ndarray:
    """The raw output vector (float32) for one driver-camera buffer under the current calib and warp matrix."""
    frame = self.frames.get("driver", buf, upload=True)
    t = self.clock()
    (out,) = self.program({"frame": frame, **self.host_t}).values()
    raw = read_output(out)
    self.stats.last_gpu_s = self.clock() - t
    return raw

  def on_frame(self, main: Frame, extra: Frame | None = None, log_mono_time: int | None = None) -> list[tuple[str, bytes]]:
    self.stats.frames += 1
    t1 = self.clock()
    try:
      raw = self.run(main.buf)
    except ValueError as e:
      self.stats.dropped_steps += 1
      self.stats.bad_inputs += 1
      log.error("skipping driver frame %d: %s", main.frame_id, e)
      return []
    t2 = self.clock()
    self.stats.last_model_s = t2 - t1
    finite = bool(np.isfinite(raw).all())
    if not finite:
      self.stats.nonfinite_steps += 1
      if not self._nonfinite_burst:
        log.error("driver-monitoring output has NaN/inf at frame %d; publishing with valid=False until it clears", main.frame_id)
    self._nonfinite_burst = not finite
    msg = messaging.new_message("driverStateV2", valid=finite)
    if log_mono_time is not None:
      msg.logMonoTime = log_mono_time
    fill_driver_state(msg, parse_dm_outputs(raw, self.slices), main.frame_id, t2 - t1, self.stats.last_gpu_s,
                      raw if SEND_RAW_PRED else None)
    self.stats.published += 1
    return [("driverStateV2", msg.to_bytes())]
