"""Synthetic drive segments in openpilot's real formats, deterministic from a seed.

A segment directory gets fcamera.hevc + ecamera.hevc (20 Hz HEVC rendered by road_render), qcamera.ts, and rlog.zst /
qlog.zst holding what modeld subscribes to, at the service table's rates: roadCameraState, wideRoadCameraState and
driverMonitoringState 20 Hz, carState and carControl 100 Hz, liveCalibration and liveDelay 4 Hz, deviceState 2 Hz, plus
one carParams. carState follows the rendered scene (speed, steering, blinkers); liveCalibration carries the renderer's
camera rotation, so a model sees pictures and messages that agree.

Segments are shaped like real ones: the log opens with initData, and every encoded frame is announced by
roadEncodeIdx / wideRoadEncodeIdx (camera frameId -> index in the segment's video). As on a device, the video and the
camera states do not line up one to one: in segment 0 the videos start ENCODER_LEAD frames after the first camera
state (the encoder is still starting), and in every segment one road frame is dropped by the encoder (its state is
logged, its picture is not in fcamera.hevc). `encode_index=False` writes the old shape instead: no index, and frame k of
each video is camera state k.

`driver=True` adds the driver camera, as a device records it: dcamera.hevc (the cabin of selfdrive_glue/cabin_render.py),
driverCameraState at 20 Hz and driverEncodeIdx for every encoded frame (the same encoder lead in segment 0).
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selfdrive_glue.cabin_render import CabinScene
from selfdrive_glue.camera import sensor_and_device
from selfdrive_glue.errors import UserError
from selfdrive_glue.logs import LogWriter, write_qlog
from selfdrive_glue.road_render import STEER_RATIO, WHEELBASE, EgoState, RoadScene
from selfdrive_glue.route import DRIVER_CAMERA, QCAMERA, ROAD_CAMERA, WIDE_CAMERA, route_name, segment_name
from selfdrive_glue.video import QCAMERA_SIZE, VideoWriter, scale_venus

FPS = 20
BOOT_NS = 20_000_000_000  # logMonoTime of the drive's first frame: boot time is never zero on a device
READOUT_NS = 30_000_000  # sof -> eof
ISP_NS = 3_000_000  # eof -> camera state published
WIDE_SOF_OFFSET_NS = 300_000  # the two sensors are synced, not identical
DRIVER_SOF_OFFSET_NS = 600_000
ENCODE_NS = 8_000_000  # camera state published -> encode index published
ENCODER_LEAD = 2  # segment 0: camera states start this many frames before the videos (a real 0.9.7 drive shows 2)


@dataclass(frozen=True)
class SynthResult:
  path: Path
  frames: int  # camera states per stream
  events: int
  route: str
  encoded: int = 0  # frames in fcamera.hevc


def encoded_positions(n_frames: int, index: int, encode_index: bool = True) -> tuple[list[int], list[int]]:
  """Which of a segment's camera states (0..n_frames-1) have their frame in the road / the wide video, in video order.

  Real-shaped: segment 0 starts ENCODER_LEAD states late, and the middle road frame is dropped. Segments too short to
  show both keep every frame they cannot spare."""
  every = list(range(n_frames))
  if not encode_index:
    return every, every
  lead = ENCODER_LEAD if index == 0 and n_frames > ENCODER_LEAD + 2 else 0
  wide = every[lead:]
  road = list(wide)
  if len(road) >= 3:
    road.pop(len(road) // 2)
  return road, wide


class _Events:
  """Events of one segment, sorted by logMonoTime (ties: insertion order) when written."""

  def __init__(self):
    from selfdrive_glue import messaging
    self.m = messaging
    self.items: list[tuple[int, int, bytes]] = []

  def add(self, mono: int, service: str, fill) -> None:
    ev = self.m.new_message(service, logMonoTime=mono, valid=True)
    fill(getattr(ev, service))
    self.items.append((mono, len(self.items), ev.to_bytes()))

  def sorted(self) -> list[bytes]:
    return [b for _, _, b in sorted(self.items)]


def fill_frame(sensor: str, frame_id: int, sof: int):
  """Filler for a roadCameraState / wideRoadCameraState FrameData (also used by the demo's camera server)."""
  def fill(fd):
    fd.frameId = frame_id
    fd.frameIdSensor = frame_id
    fd.encodeId = frame_id
    fd.requestId = frame_id
    fd.timestampSof = sof
    fd.timestampEof = sof + READOUT_NS
    fd.sensor = sensor
    fd.integLines = 800
    fd.gain = 1.0
    fd.processingTime = 0.003
    fd.measuredGreyFraction = 0.25
    fd.targetGreyFraction = 0.25
    fd.exposureValPercent = 50.0
  return fill


def fill_encode_index(frame_id: int, encode_id: int, segment_num: int, segment_id: int, sof: int):
  """Filler for a roadEncodeIdx / wideRoadEncodeIdx: where the camera frame `frame_id` sits in the segment's video."""
  def fill(ei):
    ei.frameId = frame_id
    ei.type = "fullHEVC"
    ei.encodeId = encode_id
    ei.segmentNum = segment_num
    ei.segmentId = segment_id
    ei.segmentIdEncode = segment_id  # no B-frames: encode order is presentation order
    ei.timestampSof = sof
    ei.timestampEof = sof + READOUT_NS
  return fill


def fill_init_data(seed: int, device: str):
  def fill(d):
    d.dongleId = f"{seed & 0xffffffffffffffff:016x}"
    d.deviceType = device
    d.version = "modeld-msm synth"
    d.gitBranch = "synth"
    d.wallTimeNanos = 1_700_000_000_000_000_000  # fixed: the same seed writes the same bytes
  return fill


def fill_car_state(e: EgoState):
  """Filler for carState from the scene's ego state."""
  def fill(cs):
    cs.vEgo = e.v_ego
    cs.vEgoRaw = e.v_ego
    cs.aEgo = e.a_ego
    cs.standstill = e.v_ego < 0.1
    cs.steeringAngleDeg = e.steering_angle_deg
    cs.steeringRateDeg = e.steering_rate_deg
    cs.yawRate = e.yaw_rate
    cs.leftBlinker = e.left_blinker
    cs.rightBlinker = e.right_blinker
    cs.gearShifter = "drive"
    cs.canValid = True
  return fill


def fill_car_control(e: EgoState):
  """Filler for carControl from the scene's ego state (lateral and longitudinal active)."""
  def fill(cc):
    cc.enabled = True
    cc.latActive = True
    cc.longActive = True
    cc.leftBlinker = e.left_blinker
    cc.rightBlinker = e.right_blinker
    cc.currentCurvature = e.curvature
  return fill



def fill_driver_monitoring(dm) -> None:
  dm.faceDetected = True
  dm.isRHD = False
  dm.awarenessStatus = 1.0
  dm.awarenessActive = 1.0
  dm.awarenessPassive = 1.0
  dm.isActiveMode = True


def fill_live_calibration(rpy, cycle: int):
  def fill(lc):
    lc.rpyCalib = list(rpy)
    lc.rpyCalibSpread = [0.0, 0.002, 0.002]
    lc.calStatus = "calibrated"
    lc.calPerc = 100
    lc.calCycle = cycle
    lc.validBlocks = 50
    lc.height = [1.22]
    lc.wideFromDeviceEuler = [0.0, 0.0, 0.0]
  return fill


def fill_live_delay(lateral_delay: float):
  def fill(ld):
    ld.lateralDelay = lateral_delay
    ld.lateralDelayEstimate = lateral_delay
    ld.lateralDelayEstimateStd = 0.01
    ld.validBlocks = 50
    ld.calPerc = 100
    ld.status = "estimated"
  return fill


def fill_device_state(device: str, started_mono: int):
  def fill(ds):
    ds.deviceType = device
    ds.started = True
    ds.startedMonoTime = started_mono
    ds.thermalStatus = "green"
    ds.freeSpacePercent = 80.0
    ds.memoryUsagePercent = 40
    ds.cpuTempC = [45.0] * 8
    ds.gpuTempC = [44.0]
    ds.maxTempC = 47.0
  return fill


def segment_events(scene: RoadScene, start_s: float, seconds: float, n_frames: int, wide: bool = True, lateral_delay: float = 0.2,
                   index: int = 0, encode_index: bool = True, driver: bool = False) -> list[bytes]:
  """Serialized, time-ordered Events of segment `index`, starting `start_s` into the drive."""
  sensor, device = sensor_and_device(scene.camera)
  ev = _Events()
  t0 = BOOT_NS + int(round(start_s * 1e9))
  end = t0 + int(round(seconds * 1e9))
  first_frame = int(round(start_s * FPS))
  rpy = list(scene.calib_rpy)
  if encode_index:
    ev.add(t0 - 1_000_000, "initData", fill_init_data(scene.seed, device))

  def cp_fill(cp):
    cp.brand = "mock"
    cp.carFingerprint = "MOCK"
    cp.wheelbase = WHEELBASE
    cp.steerRatio = STEER_RATIO
    cp.mass = 1500.0
    cp.centerToFront = WHEELBASE * 0.44
    cp.minSteerSpeed = 0.0
    cp.pcmCruise = True
    cp.longitudinalActuatorDelay = 0.15
    cp.steerActuatorDelay = 0.1
  ev.add(t0, "carParams", cp_fill)

  def frame_sof(i: int) -> int:
    return t0 + i * (1_000_000_000 // FPS)

  for i in range(n_frames):
    sof = frame_sof(i)
    fid = first_frame + i
    ev.add(sof + READOUT_NS + ISP_NS, "roadCameraState", fill_frame(sensor, fid, sof))
    if wide:
      wsof = sof + WIDE_SOF_OFFSET_NS
      ev.add(wsof + READOUT_NS + ISP_NS, "wideRoadCameraState", fill_frame(sensor, fid, wsof))
    if driver:
      dsof = sof + DRIVER_SOF_OFFSET_NS
      ev.add(dsof + READOUT_NS + ISP_NS, "driverCameraState", fill_frame(sensor, fid, dsof))

    ev.add(sof + 12_000_000, "driverMonitoringState", fill_driver_monitoring)

  if encode_index:
    # encodeId counts from the start of the route: the frames every earlier segment encoded come first
    before = [encoded_positions(n_frames, j) for j in range(index)]
    # the driver video has the wide one's frames: the encoder's start-up lead, no dropped frame
    streams = [("roadEncodeIdx", 0, 0)] + ([("wideRoadEncodeIdx", 1, WIDE_SOF_OFFSET_NS)] if wide else []) + \
              ([("driverEncodeIdx", 1, DRIVER_SOF_OFFSET_NS)] if driver else [])
    for service, which, sof_offset in streams:
      encoded = encoded_positions(n_frames, index)[which]
      base = sum(len(b[which]) for b in before)
      for k, i in enumerate(encoded):
        sof = frame_sof(i) + sof_offset
        ev.add(sof + READOUT_NS + ISP_NS + ENCODE_NS, service, fill_encode_index(first_frame + i, base + k, index, k, sof))

  for k in range(int(math.ceil(seconds * 100))):
    mono = t0 + k * 10_000_000 + 1_000_000
    if mono >= end:
      break
    e = scene.ego(start_s + (mono - t0) / 1e9)
    ev.add(mono, "carState", fill_car_state(e))
    ev.add(mono + 2_000_000, "carControl", fill_car_control(e))

  for k in range(int(math.ceil(seconds * 4))):
    mono = t0 + k * 250_000_000 + 5_000_000
    if mono >= end:
      break

    ev.add(mono, "liveCalibration", fill_live_calibration(rpy, k))
    ev.add(mono + 7_000_000, "liveDelay", fill_live_delay(lateral_delay))

  for k in range(int(math.ceil(seconds * 2))):
    mono = t0 + k * 500_000_000 + 9_000_000
    if mono >= end:
      break

    ev.add(mono, "deviceState", fill_device_state(device, BOOT_NS - 5_000_000_000))
  return ev.sorted()


def synth_segment(out: str | os.PathLike, seconds: float, seed: int, camera: str = "1928x1208", index: int = 0, wide: bool = True,
                  qcamera: bool = True, progress: bool = True, overwrite: bool = False, encode_index: bool = True,
                  driver: bool = False) -> SynthResult:
  """Write segment `index` of the drive `seed` (seconds long, starting index*seconds in) into directory `out`.

  encode_index=False: the old shape (no initData or encode index; video frame k is camera state k). driver: also the
  driver camera (dcamera.hevc + driverCameraState + driverEncodeIdx)."""
  out = Path(out)
  if seconds <= 0 or seconds > 3600:
    raise UserError(f"--seconds must be in (0, 3600], got {seconds}")
  if out.exists():
    if not out.is_dir():
      raise UserError(f"{out} exists and is not a directory")
    if any(out.iterdir()) and not overwrite:
      raise UserError(f"{out} already exists and is not empty; choose another -o or pass --force")
  try:
    scene = RoadScene(seed, camera)
  except ValueError as e:
    raise UserError(str(e)) from None
  n_frames = int(round(seconds * FPS))
  start_s = index * seconds
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a segment is an ordinary folder
  try:
    from tqdm import tqdm
    writers = [VideoWriter(tmp / ROAD_CAMERA, scene.width, scene.height)]
    if wide:
      writers.append(VideoWriter(tmp / WIDE_CAMERA, scene.width, scene.height))
    qw = VideoWriter(tmp / QCAMERA, *QCAMERA_SIZE) if qcamera else None
    cabin = CabinScene(seed, camera, scene.calib_rpy) if driver else None
    dw = VideoWriter(tmp / DRIVER_CAMERA, scene.width, scene.height) if driver else None
    buf = np.zeros(scene.info.size, dtype=np.uint8)
    road_pos, wide_pos = (set(p) for p in encoded_positions(n_frames, index, encode_index))
    for i in tqdm(range(n_frames), desc=f"synth {out.name}", unit="frame", disable=not progress, leave=False):
      t = start_s + i / FPS
      if i in road_pos:
        scene.render_into(buf, t, "road")
        writers[0].write(buf)
        if qw is not None:
          qw.write(scale_venus(buf, scene.width, scene.height, *QCAMERA_SIZE))
      if wide and i in wide_pos:
        scene.render_into(buf, t, "wide")
        writers[1].write(buf)
      if cabin is not None and dw is not None and i in wide_pos:
        cabin.render_into(buf, t)
        dw.write(buf)
    for w in writers + ([qw] if qw else []) + ([dw] if dw else []):
      w.close()
    events = segment_events(scene, start_s, seconds, n_frames, wide=wide, index=index, encode_index=encode_index, driver=driver)
    with LogWriter(tmp / "rlog.zst") as lw:
      lw.write_all(events)
    write_qlog(tmp / "rlog.zst", tmp / "qlog.zst")
    if out.exists():
      shutil.rmtree(out)
    os.replace(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return SynthResult(out, n_frames, len(events), route_name(seed), len(road_pos))


def synth_route(parent: str | os.PathLike, segments: int, seconds: float, seed: int, camera: str = "1928x1208", **kw) -> list[SynthResult]:
  """`segments` consecutive segments of one drive as `parent/<route>--<n>`."""
  route = route_name(seed)
  return [synth_segment(Path(parent) / segment_name(route, n), seconds, seed, camera, index=n, **kw) for n in range(segments)]
