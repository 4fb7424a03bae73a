"""One frame step of modeld, shared by `serve` (live msgq/VisionIPC) and `replay` (logs): state in, messages out.

The caller feeds every subscribed Event it receives (`on_message`) and each paired camera frame (`on_frame`);
ModeldCore never touches sockets or clocks of its own, which is what makes replay deterministic.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from artifact.format import VerifiedArtifact
from modeld_msm.actions import Action, get_action, model_action_t
from modeld_msm.fill_msg import PublishState, fill_lane_change, fill_model_msg, fill_pose_msg, lane_change_prob
from modeld_msm.frames import Frame
from modeld_msm.inputs_check import CALIB_ANGLE, LATERAL_DELAY, LONG_ACTUATOR_DELAY, STEERING_TORQUE, V_EGO, InputCheck
from modeld_msm.model_state import ModelState
from selfdrive_glue import messaging
from selfdrive_glue.camera import model_transforms
from selfdrive_glue.desire_helper import DesireHelper
from selfdrive_glue.filters import FrameDropFilter

log = logging.getLogger("modeld")

SUBSCRIBED = ("deviceState", "carState", "roadCameraState", "liveCalibration", "driverMonitoringState", "carControl", "liveDelay",
              # openpilot master's names of three of them (since 2026-08): both are read, so modeld serves whichever openpilot
              # runs and never waits on a name it does not publish; each is kept under its 0.11 name
              "narrowRoadCameraState", "extrinsicsCalibration", "lateralDelay")
PUBLISHED = ("modelV2", "drivingModelData", "cameraOdometry")
DEMO_LONG_ACTUATOR_DELAY = 0.15   # used when no CarParams are available (openpilot's --demo does the same kind of thing)
DEFAULT_LAT_DELAY = 0.2

_NO_CARSTATE = SimpleNamespace(vEgo=0.0, leftBlinker=False, rightBlinker=False, steeringPressed=False, steeringTorque=0.0,
                               leftBlindspot=False, rightBlindspot=False)


@dataclass
class StepTiming:
  model_s: float = 0.0     # warp + vision + policy + readback + parse (modelExecutionTime)
  fill_s: float = 0.0      # action + message filling + serialisation


@dataclass
class CoreStats:
  frames: int = 0
  published: int = 0
  dropped_steps: int = 0
  nonfinite_steps: int = 0
  bad_inputs: int = 0
  last: StepTiming = field(default_factory=StepTiming)


class ModeldCore:
  def __init__(self, artifact: str | Path | VerifiedArtifact, car_params=None, clock: Callable[[], float] | None = None, main_wide: bool = False,
               device: str | None = None, camera: tuple[int, int] | None = None):
    self.model = ModelState(artifact, device=device, camera=camera)
    self.clock = clock or time.perf_counter
    self.main_wide = main_wide
    self.camera = self.model.artifact.camera
    self._init_state(car_params)

  def switch_main(self, main_wide: bool) -> None:
    """The main stream is now the wide camera (or the road one again): the warp transforms change, so they are recomputed
    from the last calibration on the next frame."""
    if main_wide != self.main_wide:
      self.main_wide = main_wide
      if "liveCalibration" in self.latest:
        self.updated.add("liveCalibration")

  def reset(self, car_params=None) -> None:
    """Forget everything seen so far (device queues, desire pulse, filters, DesireHelper, calibration, latest messages,
    counters) but keep the loaded artifact: the next step behaves exactly like the first step of a new core, so one
    load serves many segments. car_params: the next drive's CarParams (None: the demo default)."""
    self.model.reset()
    self._init_state(car_params)

  def _init_state(self, car_params) -> None:
    self.stats = CoreStats()
    self.inputs = InputCheck(log, self.stats)   # every number read from a message: checked, counted in stats.bad_inputs
    self.long_delay = (self.inputs.number("CarParams.longitudinalActuatorDelay", car_params.longitudinalActuatorDelay, LONG_ACTUATOR_DELAY)
                       if car_params is not None else DEMO_LONG_ACTUATOR_DELAY)
    self.dh = DesireHelper()
    self.drop_filter = FrameDropFilter()
    self.publish_state = PublishState()
    self.prev_action = Action(0.0, 0.0, False)
    self.latest: dict[str, Any] = {}  # capnp readers of the newest message per service
    self.updated: set[str] = set()
    self.tfm = np.zeros((3, 3), np.float32)
    self.big_tfm = np.zeros((3, 3), np.float32)
    self.live_calib_seen = False
    self.last_vipc_frame_id = 0
    self._nonfinite_burst = False
    self._calib_error: str | None = None
    self._bad_action = False

  def on_message(self, evt) -> None:
    """Feed one Event (replay: every logged Event in order; unsubscribed services are ignored)."""
    which = evt.which()
    if which in SUBSCRIBED:
      self.on_member(which, getattr(evt, which))

  def on_member(self, which: str, msg) -> None:
    """Feed the union member of an Event directly (serve: what SubMaster.update() brought in)."""
    which = messaging.MEMBER_OF_SERVICE.get(which, which)
    self.latest[which] = msg
    self.updated.add(which)

  def _get(self, service: str, attr: str, default):
    msg = self.latest.get(service)
    return getattr(msg, attr) if msg is not None else default

  def _carstate(self) -> SimpleNamespace:
    """The carState fields the step reads, each checked (DesireHelper gets these, not the message)."""
    cs = self.latest.get("carState", _NO_CARSTATE)
    return SimpleNamespace(vEgo=self.inputs.number("carState.vEgo", cs.vEgo, V_EGO), leftBlinker=bool(cs.leftBlinker),
                           rightBlinker=bool(cs.rightBlinker), steeringPressed=bool(cs.steeringPressed),
                           steeringTorque=self.inputs.number("carState.steeringTorque", cs.steeringTorque, STEERING_TORQUE),
                           leftBlindspot=bool(getattr(cs, "leftBlindspot", False)), rightBlindspot=bool(getattr(cs, "rightBlindspot", False)))

  def _update_transforms(self) -> None:
    # like openpilot: only on a fresh liveCalibration, and only once the camera and device are known
    if not ("liveCalibration" in self.updated and "roadCameraState" in self.latest and "deviceState" in self.latest):
      return
    try:
      if (rpy := self.inputs.vector("liveCalibration.rpyCalib", self.latest["liveCalibration"].rpyCalib, 3, CALIB_ANGLE)) is None:
        return   # counted and logged by the check; the previous transforms stay
      self.tfm[:], self.big_tfm[:] = model_transforms(rpy, str(self.latest["deviceState"].deviceType),
                                                      str(self.latest["roadCameraState"].sensor), self.main_wide)
      self.live_calib_seen = True
      self._calib_error = None
    except Exception as e:  # a bad calibration message must not stop the model; keep the previous transforms
      self.stats.bad_inputs += 1
      if str(e) != self._calib_error:
        log.error("ignoring liveCalibration: %s", e)
        self._calib_error = str(e)

  def on_frame(self, main: Frame, extra: Frame | None = None, log_mono_time: int | None = None) -> list[tuple[str, bytes]]:
    """Run one step. Returns [(service, serialized Event)] in send order, or [] on a dropped (prepare-only) frame."""
    extra = main if extra is None else extra
    self.stats.frames += 1
    desire = self.dh.desire  # the previous step's DesireHelper state, as openpilot does
    is_rhd = bool(self._get("driverMonitoringState", "isRHD", False))
    frame_id = int(self._get("roadCameraState", "frameId", 0))
    carstate = self._carstate()
    v_ego = max(carstate.vEgo, 0.0)
    lat_delay = self.inputs.number("liveDelay.lateralDelay", self._get("liveDelay", "lateralDelay", DEFAULT_LAT_DELAY), LATERAL_DELAY) + 0.0
    self._update_transforms()
    self.updated.clear()

    traffic_convention = np.zeros((1, 2), np.float32)
    traffic_convention[0, int(is_rhd)] = 1
    vec_desire = np.zeros(8, np.float32)
    if 0 <= desire < 8:
      vec_desire[desire] = 1

    dropped = max(0, main.frame_id - self.last_vipc_frame_id - 1)
    drop_ratio = self.drop_filter.update(dropped)
    prepare_only = dropped > 0
    if prepare_only:
      log.debug("skipping model eval, dropped %d frames", dropped)

    t1 = self.clock()
    outputs, raw = self.model.run(main.buf, extra.buf, self.tfm, self.big_tfm, vec_desire, traffic_convention, prepare_only,
                                  action_t=model_action_t(self.long_delay, lat_delay))   # a program that reads no action_t ignores it
    t2 = self.clock()
    self.stats.last = StepTiming(model_s=t2 - t1)
    self.last_vipc_frame_id = main.frame_id
    if outputs is None or raw is None:
      self.stats.dropped_steps += 1
      return []

    finite = bool(np.isfinite(raw).all())
    if not finite:
      self.stats.nonfinite_steps += 1
      if not self._nonfinite_burst:
        log.error("model output has NaN/inf at frame %d; publishing with valid=False until it clears", main.frame_id)
    self._nonfinite_burst = not finite
    valid = self.live_calib_seen and finite

    lat_active = bool(self._get("carControl", "latActive", False))
    # a kind with an action head (master's combined model) steers by it where the model has one, else by the plan
    head = outputs.get("action") if self.model.artifact.spec.action_head else None
    action = get_action(outputs["plan"][0], self.prev_action, self.long_delay, lat_delay, v_ego, head=head)
    if np.isfinite([action.desiredCurvature, action.desiredAcceleration]).all():
      self.prev_action = action   # a NaN carried into the smoothing would stay there (tau 0 keeps 0*NaN): never sticky
      self._bad_action = False
    else:
      valid = False
      if not self._bad_action:
        log.error("action is NaN/inf at frame %d; published with valid=False, the previous action kept for smoothing", main.frame_id)
      self._bad_action = True

    model_msg = messaging.new_message("modelV2")
    drv_msg = messaging.new_message("drivingModelData")
    pose_msg = messaging.new_message("cameraOdometry")
    fill_model_msg(model_msg, drv_msg, outputs, action, self.publish_state, main.frame_id, extra.frame_id, frame_id, drop_ratio,
                   main.timestamp_eof, t2 - t1, valid)
    self.dh.update(carstate, lat_active, lane_change_prob(model_msg))
    fill_lane_change(model_msg, drv_msg, self.dh.lane_change_state, self.dh.lane_change_direction)
    fill_pose_msg(pose_msg, outputs, main.frame_id, dropped, main.timestamp_eof, self.live_calib_seen and finite)
    out = []
    for svc, msg in zip(PUBLISHED, (model_msg, drv_msg, pose_msg)):
      if log_mono_time is not None:
        msg.logMonoTime = log_mono_time
      out.append((svc, msg.to_bytes()))
    self.stats.published += 1
    self.stats.last.fill_s = self.clock() - t2
    return out
