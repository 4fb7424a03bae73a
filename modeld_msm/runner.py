"""The process every model of ours runs in: artifact, VisionIPC streams, SubMaster/PubMaster, realtime settings, the
garbage-collector discipline, timing, clean exit.

A model kind plugs in a `ModelProcess`: its services, its realtime slot, which camera streams it reads, and how to make
its per-frame step (a `Core`: program + output parser + message filler) from a verified artifact. The driving model
(modeld_msm/modeld.py) is the first; `serve` is the same loop for every kind.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from artifact import kinds
from artifact.format import MANIFEST, VerifiedArtifact, require_camera, resolve_artifact, verify_artifact
from modeld_msm import gpu_turn
from modeld_msm.frames import OUT_OF_SYNC_NS, Frame, older_capture, still_paired_capture
from selfdrive_glue import messaging
from selfdrive_glue.argtypes import integer
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.visionipc import VisionIpcClient, VisionStreamType

ARTIFACT_ENV = "MODELD_ARTIFACT"
# where `python -m release.build` installs the per-camera artifacts; what openpilot's process table runs without arguments
DEFAULT_BUNDLE = Path(__file__).resolve().parents[1] / "artifacts"


class CoreStats(Protocol):
  @property
  def frames(self) -> int: ...
  @property
  def published(self) -> int: ...
  @property
  def dropped_steps(self) -> int: ...


class Core(Protocol):
  """One model's per-frame step: fed every subscribed message and each (paired) frame, it returns what to publish."""
  @property
  def stats(self) -> CoreStats: ...
  @property
  def camera(self) -> tuple[int, int]: ...

  def on_member(self, which: str, msg) -> None: ...
  def on_frame(self, main: Frame, extra: Frame | None = None) -> list[tuple[str, bytes]]: ...
  def switch_main(self, main_wide: bool) -> None: ...


@dataclass(frozen=True)
class StreamChoice:
  main: int                 # VisionStreamType
  extra: int | None         # a second camera paired with main on start-of-frame time, or None
  main_wide: bool           # main is the wide camera (the road camera is absent)


@dataclass(frozen=True)
class ModelProcess:
  name: str                                                   # openpilot's name for the process, also the logger's
  subscribed: tuple[str, ...]
  published: tuple[str, ...]
  rt_core: int
  rt_priority: int
  choose_streams: Callable[[set[int]], StreamChoice | None]   # the streams camerad offers -> what to read (None: wait)
  make_core: Callable[[VerifiedArtifact], Core]
  gpu_turn: str = ""   # on the shared GPU (modeld_msm/gpu_turn.py): "lead" marks its frames, "follow" yields to them


@dataclass
class ServeOptions:
  artifact: str
  server: str = "camerad"
  max_frames: int = 0          # 0 = run forever
  realtime: bool = True


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The options every model process takes (a kind adds its own)."""
  p.add_argument("--artifact", default=os.environ.get(ARTIFACT_ENV),
                 help=f"artifact directory (modeld-msm compile), or a bundle with one per camera size; its device picks the backend "
                      f"(default ${ARTIFACT_ENV}, which the installed launcher sets, else the artifacts/ folder of this checkout)")
  p.add_argument("--server", default="camerad", help="VisionIPC server name")
  p.add_argument("--max-frames", type=integer(0), default=0, help="stop after publishing N frames (0 = run until SIGINT)")
  p.add_argument("--no-realtime", action="store_true", help="skip SCHED_FIFO/core pinning")


def options(args: argparse.Namespace) -> ServeOptions:
  logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
  return ServeOptions(args.artifact or str(DEFAULT_BUNDLE), args.server, args.max_frames, not args.no_realtime)


def config_realtime(core: int, priority: int) -> str:
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
  """A model process runs with the cyclic garbage collector off (config_realtime, like openpilot: a collection in the
  middle of a step is a latency spike). But the libraries under a step (capnp, tinygrad's JIT call, ctypes) leave a few
  reference cycles per frame, and with the collector off those are never freed: a slow growth over a long drive. So
  collect on our own schedule, between frames: everything alive after start-up is frozen out of the collector's sight
  (gc.freeze), the youngest generation is collected after each frame, all generations every `full_every` frames; both
  only look at what was allocated since start-up, so they stay short (`longest_ms` says how short).
  The first frames build state for good too (tinygrad's JIT captures on its second call; on the emulated node each
  program's interpreter is built at first use), which every full collection would traverse. So after `settle_frames`
  frames, one full collection frees what is garbage and everything still alive is frozen as well. Passes up to then are
  start-up (`settle_ms`: the longest of them, the freeze's own included); `longest_ms` is the longest pass after."""

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


class ArtifactSource:
  """The verified artifact for a camera size, each checked once: a single artifact at start-up (so a wrong one is refused
  before any camera is waited for), a bundle's artifact when camerad first reports its size."""

  def __init__(self, path: str | Path, process: str = "modeld"):
    check_artifact_path(path)
    self.path, self.process = Path(path), process
    self.single = verify_artifact(path, process=process) if (self.path / MANIFEST).exists() else None
    served = kinds.served_by(process)
    if self.single is None and all(k.bundle_dir for k in served) and not any(any((self.path / k.bundle_dir).glob(f"*/{MANIFEST}")) for k in served):
      # a bundle without this process's artifacts is refused now, not once a camera shows up
      raise UserError(f"bundle {path} has no {served[0].name} artifacts (no {served[0].bundle_dir}/<w>x<h>/{MANIFEST}); build it with "
                      f"`modeld-msm release {served[0].compile_flags} ...`, or pass an artifact of that kind")
    self.current = self.single   # the artifact the running core was made from

  def for_camera(self, camera: tuple[int, int]) -> VerifiedArtifact:
    if self.single is not None:
      require_camera(self.single, camera)
      self.current = self.single
    else:
      self.current = verify_artifact(resolve_artifact(self.path, camera, self.process), camera=camera, process=self.process)
    return self.current


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
  label: str = ""      # which streams, for the log

  @staticmethod
  def describe(pick: StreamChoice) -> str:
    def name(s: int | None) -> str:
      return "none" if s is None else VisionStreamType(s).name.lower() if s in {int(t) for t in VisionStreamType} else f"stream {s}"
    return f"main={name(pick.main)} extra={name(pick.extra)}"

  def connected(self) -> bool:
    return self.main.is_connected() and (self.extra is None or self.extra.is_connected())

  def close(self) -> None:
    self.main.close()
    if self.extra is not None:
      self.extra.close()


def open_streams(server: str, choose: Callable[[set[int]], StreamChoice | None], stop: Callable[[], bool]) -> Streams:
  """Wait for camerad, connect what `choose` picks and check its geometry: the same path at start-up and after every
  camerad restart (the clients do not reconnect by themselves: recv() reports the loss and the loop comes back here, so
  the new server's streams and geometry are checked again; they may differ)."""
  while not stop():
    if (pick := choose(set(VisionIpcClient.available_streams(server, block=False)))) is not None:
      main = VisionIpcClient(server, pick.main, True, auto_reconnect=False)
      extra = VisionIpcClient(server, pick.extra, False, auto_reconnect=False) if pick.extra is not None else None
      while not stop() and not main.connect(False):
        time.sleep(0.1)
      while extra is not None and not stop() and not extra.connect(False):
        time.sleep(0.1)
      try:
        cam = check_geometry(main)
        if extra is not None and check_geometry(extra) != cam:
          raise UserError(f"the two camera streams differ in size ({cam} vs {extra.width}x{extra.height}); both cameras must share one size")
      except UserError:
        main.close()
        if extra is not None:
          extra.close()
        raise
      return Streams(main, extra, pick.main_wide, cam, Streams.describe(pick))
    time.sleep(0.1)
  raise KeyboardInterrupt


def adopt_streams(core: Core, old: Streams, new: Streams, make_core: Callable[[Streams], Core], sm, name: str = "modeld") -> Core:
  """The core to run on after a reconnect. A new camera size needs its own artifact: a fresh core, given the latest
  message of every service seen so far. A swap of the main stream (road <-> wide) is the core's to handle (the driving
  core recomputes its warp transforms from the last calibration)."""
  if new.camera != old.camera:
    logging.getLogger(name).warning("camera size changed from %dx%d to %dx%d; loading its artifact", *old.camera, *new.camera)
    core = make_core(new)
    for svc, seen in sm.seen.items():
      if seen:
        core.on_member(svc, sm[svc])
  elif new.main_wide != old.main_wide:
    core.switch_main(new.main_wide)
  return core


def _frame(client: VisionIpcClient) -> Frame | None:
  buf = client.recv()
  return None if buf is None else Frame(buf.data, client.frame_id, client.timestamp_sof, client.timestamp_eof)


def receive(streams: Streams, extra_frame: Frame | None, log: logging.Logger) -> tuple[Frame | None, Frame | None]:
  """The next main frame and, with two cameras, the extra frame of its capture (modeld_msm/frames.py); (None, ...) when a
  receive timed out or the server went away. extra_frame: the one paired last, kept across calls as openpilot does."""
  main_frame = None
  while main_frame is None or (extra_frame is not None and still_paired_capture(main_frame.timestamp_sof, extra_frame.timestamp_sof)):
    if (main_frame := _frame(streams.main)) is None or streams.extra is None:
      return main_frame, extra_frame
  assert streams.extra is not None
  while extra_frame is None or older_capture(extra_frame.timestamp_sof, main_frame.timestamp_sof):
    if (extra_frame := _frame(streams.extra)) is None:
      return None, None
  if abs(main_frame.timestamp_sof - extra_frame.timestamp_sof) > OUT_OF_SYNC_NS:
    log.error("frames out of sync! main: %d (%.5f), extra: %d (%.5f)", main_frame.frame_id, main_frame.timestamp_sof / 1e9,
              extra_frame.frame_id, extra_frame.timestamp_sof / 1e9)
  return main_frame, extra_frame


def serve(proc: ModelProcess, opts: ServeOptions) -> int:
  log = logging.getLogger(proc.name)
  source = ArtifactSource(opts.artifact, proc.name)   # before anything slow: a wrong path or artifact must not wait for a camera
  stopping = False

  def _stop(*_):
    nonlocal stopping
    stopping = True
  signal.signal(signal.SIGINT, _stop)
  signal.signal(signal.SIGTERM, _stop)
  if opts.realtime:
    log.info("realtime: %s", config_realtime(proc.rt_core, proc.rt_priority))

  turn = gpu_turn.serve_turn(proc.gpu_turn)   # before the device opens: it may set the follower's chunks in flight
  # a single artifact is loaded now, so a device that cannot open is refused before we wait for cameras
  core: Core | None = proc.make_core(source.single) if source.single is not None else None
  log.info("connecting to VisionIPC server %r", opts.server)
  streams = open_streams(opts.server, proc.choose_streams, lambda: stopping)

  def make_core(st: Streams) -> Core:
    return proc.make_core(source.for_camera(st.camera))
  if core is None or core.camera != streams.camera:
    core = make_core(streams)
  core.switch_main(streams.main_wide)
  assert source.current is not None
  log.info("streams: %s, artifact %s (%s)", streams.label, source.current.path, source.current.target)
  pm = messaging.PubMaster(list(proc.published))
  sm = messaging.SubMaster(list(proc.subscribed))
  cycles = CycleCollector()
  cycles.start()

  extra_frame = None
  published = 0
  while not stopping and (opts.max_frames == 0 or published < opts.max_frames):
    if not streams.connected():
      log.warning("camera server changed; reconnecting")
      streams.close()
      new = open_streams(opts.server, proc.choose_streams, lambda: stopping)
      core = adopt_streams(core, streams, new, make_core, sm, proc.name)
      streams, extra_frame = new, None   # frames held from the old server are not paired with new ones
      log.info("streams: %s", streams.label)
    main_frame, extra_frame = receive(streams, extra_frame, log)
    if main_frame is None:
      continue
    sm.update(0)
    for svc in proc.subscribed:
      if sm.updated[svc]:
        core.on_member(svc, sm[svc])
    with turn.frame():
      out = core.on_frame(main_frame, extra_frame)
    for svc, dat in out:
      pm.send(svc, dat)
    published = max(published, core.stats.published)
    cycles.after_frame()
  log.info("%s stopping: %d frames, %d published, %d dropped steps; %d cyclic objects freed between frames (longest pass %.2f ms; "
           "the first %d frames, whose state is then frozen: %.2f ms)", proc.name, core.stats.frames, core.stats.published,
           core.stats.dropped_steps, cycles.freed, cycles.longest_ms, cycles.settle_frames, cycles.settle_ms)
  if turn.stats:
    log.info("GPU turn: %s", ", ".join(f"{k} {v}" for k, v in sorted(turn.stats.items())))
  return 0


def main(proc: ModelProcess, argv: list[str] | None, add_kind_arguments: Callable[[argparse.ArgumentParser], None],
         run: Callable[[argparse.Namespace], int], description: str) -> int:
  """`python -m modeld_msm.<process>`: the options and code of `modeld-msm serve...` (the launcher `install` writes runs this)."""
  p = argparse.ArgumentParser(prog=proc.name, description=description)
  add_arguments(p)
  add_kind_arguments(p)
  a = p.parse_args(argv)
  try:
    return run(a)
  except UserError as e:
    print(f"{proc.name}: error: {e}", file=sys.stderr)
    return e.exit_code
