"""The modeld process: VisionIPC frames + cereal messages in, modelV2 / drivingModelData / cameraOdometry out.

Reads like openpilot's selfdrive/modeld/modeld.py: discover streams, pair frames on start-of-frame time, feed the
step (modeld_msm.core), publish. Run by openpilot's manager as `python -m modeld_msm.modeld` (or `selfdrive.modeld.modeld`
via the shim in release/), or as `modeld-msm serve`.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from compile.artifact import MANIFEST, activate_target, resolve_artifact, verify_artifact
from modeld_msm.core import PUBLISHED, SUBSCRIBED, Frame, ModeldCore
from selfdrive_glue import messaging
from selfdrive_glue.capnp_check import check_pointers
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.visionipc import VisionIpcClient, VisionStreamType

log = logging.getLogger("modeld")
PAIR_WINDOW_NS = 25_000_000     # frames closer than this belong to the same capture
OUT_OF_SYNC_NS = 10_000_000
RT_CORE, RT_PRIORITY = 7, 54
# where `python -m release.build` installs the per-camera artifacts; what openpilot's process table runs without arguments
DEFAULT_BUNDLE = Path(__file__).resolve().parents[1] / "artifacts"


@dataclass
class ServeOptions:
  artifact: str
  car_params: str | None = None
  server: str = "camerad"
  max_frames: int = 0          # 0 = run forever
  realtime: bool = True
  use_params: bool = True      # read CarParams from openpilot's Params when no file is given


def config_realtime(core: int = RT_CORE, priority: int = RT_PRIORITY) -> str:
  """SCHED_FIFO + core pinning like openpilot's config_realtime_process; returns a note of what was (not) applied."""
  gc.disable()
  notes = []
  try:
    if core < (os.cpu_count() or 1):
      os.sched_setaffinity(0, {core})
      notes.append(f"pinned to core {core}")
    else:
      notes.append(f"core {core} absent, not pinned")
  except OSError as e:
    notes.append(f"no core pinning ({e.strerror})")
  try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    notes.append(f"SCHED_FIFO {priority}")
  except (OSError, PermissionError) as e:
    notes.append(f"no realtime priority ({getattr(e, 'strerror', e)})")
  return ", ".join(notes)


class CycleCollector:
  """modeld runs with the cyclic garbage collector off (config_realtime, like openpilot: a collection in the middle of a step
  is a latency spike). But the libraries under a step (capnp, tinygrad's JIT call, ctypes) leave a few reference cycles per
  frame, and with the collector off those are never freed: the slow growth a 10,000-frame soak measured (~1.8 Python blocks,
  0.15 KB a frame). So collect on our own schedule, between frames: everything alive after start-up is frozen out of the
  collector's sight (gc.freeze), the youngest generation is collected after each frame modeld handled, all generations every
  `full_every` frames; both only look at what was allocated since start-up, so they stay short (`longest_ms` says how short).
  The first frames build state for good too (tinygrad's JIT captures on its second call; on the emulated node executing the
  a630's code, each program's interpreter is built at first use: 440k objects), which every full collection would traverse
  (202 ms every 200th frame in a 10,000-frame level-B soak). So after `settle_frames` frames, one full collection frees what
  is garbage and everything still alive is frozen as well. Passes up to then are start-up (`settle_ms`: the longest of them,
  the freeze's own included); `longest_ms` is the longest pass after."""

  def __init__(self, full_every: int = 200, settle_frames: int = 20):
    self.full_every, self.settle_frames = full_every, settle_frames
    self.frames, self.freed, self.longest_ms, self.settle_ms = 0, 0, 0.0, 0.0

  def start(self) -> None:
    gc.freeze()

  def after_frame(self) -> None:
    t = time.perf_counter()
    self.frames += 1
    if self.frames == self.settle_frames:
      self.freed += gc.collect(2)
      gc.freeze()
    else:
      self.freed += gc.collect(2 if self.frames % self.full_every == 0 else 0)
    ms = (time.perf_counter() - t) * 1e3
    if self.frames <= self.settle_frames:
      self.settle_ms = max(self.settle_ms, ms)
    else:
      self.longest_ms = max(self.longest_ms, ms)


def _car_params_from(data: bytes):
  check_pointers(data)   # as_builder() on an out-of-bounds pointer aborts the process instead of raising
  with messaging.car.CarParams.from_bytes(data) as cp:
    return cp.as_builder().as_reader()


def load_car_params(path: str | None, use_params: bool = True):
  """CarParams from --car-params FILE, else openpilot's Params, else None (demo defaults)."""
  if path:
    try:
      return _car_params_from(open(path, "rb").read())
    except FileNotFoundError:
      raise UserError(f"car params file not found: {path}") from None
    except Exception as e:
      raise UserError(f"{path} is not serialized car.CarParams bytes ({type(e).__name__}); pass the Params file CarParams") from None
  if not use_params:
    return None
  from selfdrive_glue.params import Params
  stored = Params().get("CarParams")
  if stored:
    try:
      return _car_params_from(stored)
    except Exception as e:
      log.error("Params CarParams unreadable (%s); using demo defaults", e)
  return None


def check_artifact_path(path: str | Path) -> None:
  """Refuse at once a path that holds no artifact at all, rather than learn it once a camera shows up."""
  p = Path(path)
  if (p / MANIFEST).exists():
    return
  if not p.exists():
    raise UserError(f"artifact {path} does not exist; pass a directory written by `modeld-msm compile`, or a release bundle")
  try:
    bundle = p.is_dir() and any((sub / MANIFEST).exists() for sub in p.iterdir())
  except OSError as e:
    raise UserError(f"cannot read artifact {path}: {e.strerror}; check the path and its permissions") from None
  if not bundle:
    raise UserError(f"{path} is neither an artifact (no {MANIFEST}) nor a bundle of them (no <w>x<h>/{MANIFEST}); "
                    "pass what `modeld-msm compile` or the release build wrote")


def connect_streams(server: str, stop) -> tuple[VisionIpcClient, VisionIpcClient | None, bool]:
  """Wait for camerad; main = road (or wide when road is absent), extra = wide when both exist.

  The clients do not reconnect by themselves: after a camerad restart recv() reports the loss, and the caller comes
  back here, so the new server's streams and geometry are checked again (they may differ)."""
  while not stop():
    streams = VisionIpcClient.available_streams(server, block=False)
    if streams:
      use_extra = VisionStreamType.ROAD in streams and VisionStreamType.WIDE_ROAD in streams
      main_wide = VisionStreamType.ROAD not in streams
      main = VisionIpcClient(server, VisionStreamType.WIDE_ROAD if main_wide else VisionStreamType.ROAD, True, auto_reconnect=False)
      extra = VisionIpcClient(server, VisionStreamType.WIDE_ROAD, False, auto_reconnect=False) if use_extra else None
      while not stop() and not main.connect(False):
        time.sleep(0.1)
      while extra is not None and not stop() and not extra.connect(False):
        time.sleep(0.1)
      return main, extra, main_wide
    time.sleep(0.1)
  raise KeyboardInterrupt


def check_geometry(client: VisionIpcClient) -> tuple[int, int]:
  """Refuse streams whose buffers are not camerad's VENUS NV12 layout; returns the camera size."""
  size = (client.width, client.height)
  info = nv12_info(*size)
  if client.stride != info.stride or client.uv_offset != info.uv_offset or client.buffer_len < info.size:
    raise UserError(f"camera stream {size[0]}x{size[1]} has stride/uv_offset/len {client.stride}/{client.uv_offset}/{client.buffer_len}, "
                    f"not the VENUS NV12 layout {info.stride}/{info.uv_offset}/{info.size}; refusing the stream")
  return size


@dataclass
class Streams:
  main: VisionIpcClient
  extra: VisionIpcClient | None
  main_wide: bool
  camera: tuple[int, int]

  def connected(self) -> bool:
    return self.main.is_connected() and (self.extra is None or self.extra.is_connected())

  def close(self) -> None:
    self.main.close()
    if self.extra is not None:
      self.extra.close()


def open_streams(server: str, stop) -> Streams:
  """connect_streams plus the geometry checks; the same path at start-up and after every camerad restart."""
  main, extra, main_wide = connect_streams(server, stop)
  try:
    cam = check_geometry(main)
    if extra is not None and check_geometry(extra) != cam:
      raise UserError(f"road and wide streams differ in size ({cam} vs {extra.width}x{extra.height}); both cameras must share one size")
  except UserError:
    main.close()
    if extra is not None:
      extra.close()
    raise
  return Streams(main, extra, main_wide, cam)


def adopt_streams(core, old: Streams, new: Streams, make_core, sm) -> ModeldCore:
  """The core to run on after a reconnect. A new camera size needs its own artifact: a fresh core, given the latest
  message of every service seen so far. A swap of the main stream (road <-> wide) changes the warp transforms: the
  core learns it and recomputes them from the last calibration on its next frame."""
  if new.camera != old.camera:
    log.warning("camera size changed from %dx%d to %dx%d; loading its artifact", *old.camera, *new.camera)
    core = make_core(new)
    for svc in SUBSCRIBED:
      if sm.seen[svc]:
        core.on_member(svc, sm[svc])
  elif new.main_wide != core.main_wide:
    core.main_wide = new.main_wide
    if sm.seen["liveCalibration"]:
      core.on_member("liveCalibration", sm["liveCalibration"])
  return core


def serve(opts: ServeOptions) -> int:
  check_artifact_path(opts.artifact)   # before anything slow: a wrong path must not wait for a camera
  stopping = False

  def _stop(*_):
    nonlocal stopping
    stopping = True
  signal.signal(signal.SIGINT, _stop)
  signal.signal(signal.SIGTERM, _stop)
  if opts.realtime:
    log.info("realtime: %s", config_realtime())

  car_params = load_car_params(opts.car_params, opts.use_params)
  if (Path(opts.artifact) / MANIFEST).exists():
    # a single artifact: check it and open its device now, so a wrong one is refused before we wait for cameras
    activate_target(verify_artifact(opts.artifact))
  log.info("connecting to VisionIPC server %r", opts.server)
  streams = open_streams(opts.server, lambda: stopping)

  def make_core(st: Streams) -> ModeldCore:
    return ModeldCore(resolve_artifact(opts.artifact, st.camera), car_params=car_params, main_wide=st.main_wide, camera=st.camera)
  core = make_core(streams)
  log.info("streams: main=%s extra=%s, artifact %s (%s)", "wide" if streams.main_wide else "road", "wide" if streams.extra else "none",
           opts.artifact, core.model.artifact.target)
  pm = messaging.PubMaster(list(PUBLISHED))
  sm = messaging.SubMaster(list(SUBSCRIBED))
  cycles = CycleCollector()
  cycles.start()

  main_frame = extra_frame = None
  published = 0
  while not stopping and (opts.max_frames == 0 or published < opts.max_frames):
    if not streams.connected():
      log.warning("camera server changed; reconnecting")
      streams.close()
      new = open_streams(opts.server, lambda: stopping)
      core = adopt_streams(core, streams, new, make_core, sm)
      streams, main_frame, extra_frame = new, None, None   # frames held from the old server are not paired with new ones
      log.info("streams: main=%s extra=%s", "wide" if streams.main_wide else "road", "wide" if streams.extra else "none")
    main, extra = streams.main, streams.extra
    # pair main and extra on start-of-frame time (openpilot's 25 ms rule)
    while main_frame is None or (extra_frame is not None and main_frame.timestamp_sof < extra_frame.timestamp_sof + PAIR_WINDOW_NS):
      buf = main.recv()
      if buf is None:
        main_frame = None
        break
      main_frame = Frame(buf.data, main.frame_id, main.timestamp_sof, main.timestamp_eof)
      if extra is None:
        break
    if main_frame is None:
      continue
    if extra is not None:
      while extra_frame is None or main_frame.timestamp_sof > extra_frame.timestamp_sof + PAIR_WINDOW_NS:
        buf = extra.recv()
        if buf is None:
          extra_frame = None
          break
        extra_frame = Frame(buf.data, extra.frame_id, extra.timestamp_sof, extra.timestamp_eof)
      if extra_frame is None:
        main_frame = None
        continue
      if abs(main_frame.timestamp_sof - extra_frame.timestamp_sof) > OUT_OF_SYNC_NS:
        log.error("frames out of sync! main: %d (%.5f), extra: %d (%.5f)", main_frame.frame_id, main_frame.timestamp_sof / 1e9,
                  extra_frame.frame_id, extra_frame.timestamp_sof / 1e9)
    sm.update(0)
    for svc in SUBSCRIBED:
      if sm.updated[svc]:
        core.on_member(svc, sm[svc])
    for svc, dat in core.on_frame(main_frame, extra_frame):
      pm.send(svc, dat)
    if core.stats.published > published:
      published = core.stats.published
    main_frame = None
    cycles.after_frame()
  log.info("modeld stopping: %d frames, %d published, %d dropped steps; %d cyclic objects freed between frames (longest pass %.2f ms; "
           "the first %d frames, whose state is then frozen: %.2f ms)", core.stats.frames, core.stats.published, core.stats.dropped_steps,
           cycles.freed, cycles.longest_ms, cycles.settle_frames, cycles.settle_ms)
  return 0


def main(argv: list[str] | None = None) -> int:
  # the same options and code as `modeld-msm serve` (modeld_msm/commands/serve.py): the launcher `install` writes runs this
  import argparse

  from modeld_msm.commands import serve as command
  p = argparse.ArgumentParser(prog="modeld", description=command.HELP)
  command.add_arguments(p)
  a = p.parse_args(argv)
  try:
    return command.run(a)
  except UserError as e:
    print(f"modeld: error: {e}", file=sys.stderr)
    return e.exit_code


if __name__ == "__main__":
  raise SystemExit(main())
