"""The demo's camera + sensor process: rendered road and wide frames over VisionIPC at 20 Hz, and the cereal services
modeld subscribes to at their rates, all from one deterministic RoadScene (the renderer `synth` also uses); with
`--driver`, the driver camera too (the cabin of selfdrive_glue/cabin_render.py, for dmonitoringmodeld)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from selfdrive_glue import messaging
from selfdrive_glue import synth as S
from selfdrive_glue.cabin_render import CabinScene
from selfdrive_glue.files import write_atomic
from selfdrive_glue.nv12 import nv12_info, parse_camera
from selfdrive_glue.road_render import RoadScene
from selfdrive_glue.services import RENAMED
from selfdrive_glue.visionipc import VisionIpcServer, VisionStreamType

FRAME_NS = 50_000_000
LATERAL_DELAY = 0.2  # s, the liveDelay.lateralDelay sent (what modeld's desiredCurvature is aimed by)
N_BUFFERS = 6
SENSOR_SERVICES = ["roadCameraState", "wideRoadCameraState", "driverCameraState", "carState", "carControl", "liveCalibration",
                   "liveDelay", "deviceState", "driverMonitoringState"]


def scene_time(frame_id: int) -> float:
  """Scene time (s) of the picture sent as VisionIPC frameId `frame_id`: frame i is rendered at i * FRAME_NS and sent as i + 1."""
  return (frame_id - 1) * FRAME_NS / 1e9


def run(camera: str, seconds: float, seed: int, server: str = "camerad", period_ns: int = FRAME_NS, driver: bool = False,
        master_names: bool = False) -> dict:
  """period_ns: wall time between frames. The scene still advances FRAME_NS per frame id (slow motion when longer): a
  consumer slower than 20 Hz (the emulator executing the a630's code) sees every frame, as modeld would on the car.
  master_names: publish under openpilot master's names since 2026-09 only (narrowRoadCameraState, cabinCameraState,
  extrinsicsCalibration, lateralDelay; the streams NARROW_ROAD and CABIN, the same ids), as that openpilot's camerad does."""
  name = {old: new for new, old in RENAMED.items()} if master_names else {}

  def svc(service: str) -> str:
    return name.get(service, service)
  w, h = parse_camera(camera)
  info = nv12_info(w, h)
  scene = RoadScene(seed, camera)
  cabin = CabinScene(seed, camera, scene.calib_rpy) if driver else None
  vipc = VisionIpcServer(server)
  for st in (VisionStreamType.ROAD, VisionStreamType.WIDE_ROAD) + ((VisionStreamType.DRIVER,) if driver else ()):
    vipc.create_buffers_with_sizes(st, N_BUFFERS, w, h, info.size, info.stride, info.uv_offset)
  vipc.start_listener()
  pm = messaging.PubMaster([svc(s) for s in SENSOR_SERVICES])
  sensor, device = S.sensor_and_device(camera)
  stop = False

  def _stop(*_):
    nonlocal stop
    stop = True
  signal.signal(signal.SIGTERM, _stop)
  signal.signal(signal.SIGINT, _stop)

  def send(service: str, fill) -> None:
    ev = messaging.new_message(svc(service), valid=True)
    fill(getattr(ev, service))   # a renamed service keeps its member (and ordinal): the Event is the 0.11 member's
    pm.send(svc(service), ev)

  dev_fill = S.fill_device_state(device, time.monotonic_ns())
  delay_fill = S.fill_live_delay(LATERAL_DELAY)
  n_frames = int(seconds * 1e9 / period_ns) if seconds > 0 else 1 << 62
  start = time.monotonic_ns() + period_ns
  late = 0
  sent = 0
  for i in range(n_frames):
    if stop:
      break
    deadline = start + i * period_ns
    now = time.monotonic_ns()
    if now < deadline:
      time.sleep((deadline - now) / 1e9)
    elif now - deadline > period_ns:
      late += 1
    t = scene_time(i + 1)  # the listener reads the truth of this picture back from the frameId it is sent with
    # render straight into the shared buffers (zero-copy), like camerad's ISP output
    road, wide = vipc.get_buffer(VisionStreamType.ROAD), vipc.get_buffer(VisionStreamType.WIDE_ROAD)
    scene.render_into(road.data, t, "road")
    scene.render_into(wide.data, t, "wide")
    # like camerad, a frame is handed out after its readout: EOF is now, SOF one readout earlier
    eof = time.monotonic_ns()
    sof = eof - S.READOUT_NS
    vipc.send_buf(road, i + 1, sof, eof)
    vipc.send_buf(wide, i + 1, sof, eof)
    if cabin is not None:   # camerad's three sensors are synced: the same frame id and times
      drv = vipc.get_buffer(VisionStreamType.DRIVER)
      cabin.render_into(drv.data, t)
      vipc.send_buf(drv, i + 1, sof, eof)
      send("driverCameraState", S.fill_frame(sensor, i + 1, sof))
    send("roadCameraState", S.fill_frame(sensor, i + 1, sof))
    send("wideRoadCameraState", S.fill_frame(sensor, i + 1, sof))
    send("driverMonitoringState", S.fill_driver_monitoring)
    ego = scene.ego(t)
    for _ in range(5):  # 100 Hz services, in a burst per frame period
      send("carState", S.fill_car_state(ego))
      send("carControl", S.fill_car_control(ego))
    if i % 5 == 0:
      send("liveCalibration", S.fill_live_calibration(scene.calib_rpy, i // 5))
      send("liveDelay", delay_fill)
    if i % 10 == 0:
      send("deviceState", dev_fill)
    sent += 1
  vipc.close()
  return {"frames_sent": sent, "late_frames": late}


def main() -> int:
  p = argparse.ArgumentParser(prog="demo_camera")
  p.add_argument("--camera", default="1928x1208")
  p.add_argument("--seconds", type=float, default=0)
  p.add_argument("--period-ms", type=float, default=FRAME_NS / 1e6, help="wall time between frames (default 50: 20 Hz)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--driver", action="store_true", help="also serve the driver camera (a rendered cabin)")
  p.add_argument("--stats", help="write a JSON summary here on exit")
  p.add_argument("--master-names", action="store_true", help="publish under openpilot master's service names since 2026-09 only")
  a = p.parse_args()
  if a.period_ms <= 0:
    p.error("--period-ms must be > 0")
  stats = run(a.camera, a.seconds, a.seed, period_ns=int(a.period_ms * 1e6), driver=a.driver, master_names=a.master_names)
  if a.stats:
    write_atomic(a.stats, json.dumps(stats))
  return 0


if __name__ == "__main__":
  sys.exit(main())
