"""Replay logged segments through the same per-frame pipeline as `serve` (ModeldCore), deterministically.

Events are fed in log order, after the segment's first deviceState and liveCalibration (as model_replay prepends
them). Like openpilot's process_replay, a model step fires once both roadCameraState and
wideRoadCameraState have arrived since the last step (road alone for a single-camera segment); the k-th camera state
of a stream goes with the k-th frame of its camera file. The core's clock is the log's time (logMonoTime of the event
being processed), so modelExecutionTime is 0 and the output bytes depend only on the inputs and the artifact.

Many segments run in worker processes (`replay_many(jobs=N)`), one segment per task, a fresh ModeldCore per segment.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modeld_msm.errors import UserError
from selfdrive_glue.logs import LOG_SUFFIXES, LogReader, LogWriter
from selfdrive_glue.route import ROAD_CAMERA, WIDE_CAMERA, Segment, open_segment

RING = 2  # camera buffers per stream, as process_replay's VisionIpcServer has
SENSOR_SIZES = {"ar0231": (1928, 1208), "ox03c10": (1928, 1208), "os04c10": (1344, 760)}


@dataclass
class ReplayResult:
  segment: str
  out: Path
  frames: int  # model steps fed
  published: int  # steps that produced outputs
  events_in: int
  events_out: int
  seconds: float
  damage: str | None = None
  error: str | None = None

  @property
  def fps(self) -> float:
    return self.frames / self.seconds if self.seconds > 0 else 0.0


class _LogClock:
  """The core's clock during replay: the log time of the event being processed, never the wall clock."""

  def __init__(self):
    self.now_ns = 0

  def __call__(self) -> float:
    return self.now_ns / 1e9


def _video_frames(path: Path, expect_size: tuple[int, int], n_states: int, log_damaged: bool, label: str):
  from selfdrive_glue.video import VideoReader
  vr = VideoReader(path)
  if (vr.width, vr.height) != expect_size:
    raise UserError(f"{path}: video is {vr.width}x{vr.height} but the log's {label} says {expect_size[0]}x{expect_size[1]}; "
                    "the camera file does not belong to this log")
  n_video = vr.count()
  if n_video < n_states or (n_video != n_states and not log_damaged):
    raise UserError(f"{path}: {n_video} frames but the log has {n_states} {label} messages; the camera file and log do not match")
  ring = [np.zeros(vr.info.size, dtype=np.uint8) for _ in range(RING)]
  return vr, vr.frames(ring)


def replay_segment(seg: str | os.PathLike | Segment, artifact: str | os.PathLike, out: str | os.PathLike,
                   on_frame: Callable[[int, int], None] | None = None) -> ReplayResult:
  """Replay one segment into the log file `out`. on_frame(done, total) reports progress."""
  from modeld_msm.core import Frame, ModeldCore
  t_start = time.perf_counter()
  seg = seg if isinstance(seg, Segment) else open_segment(seg)
  rlog = seg.log("rlog")
  if rlog is None:
    raise UserError(f"segment {seg.path} has no rlog; replay needs every camera state, which a qlog decimates away")
  reader = LogReader(rlog)
  events = list(reader.events_with_bytes())
  damage = reader.damage
  road_states = [ev.roadCameraState for ev, _ in events if ev.which() == "roadCameraState"]
  n_road = len(road_states)
  n_wide = sum(1 for ev, _ in events if ev.which() == "wideRoadCameraState")
  if n_road == 0:
    raise UserError(f"{rlog}: no roadCameraState messages; nothing to replay")
  sensor = str(road_states[0].sensor)
  size = SENSOR_SIZES.get(sensor)
  road_path, wide_path = seg.camera(ROAD_CAMERA), seg.camera(WIDE_CAMERA)
  if road_path is None:
    raise UserError(f"segment {seg.path}: missing camera file {ROAD_CAMERA} for {n_road} roadCameraState messages")
  if n_wide and wide_path is None:
    raise UserError(f"segment {seg.path}: missing camera file {WIDE_CAMERA} for {n_wide} wideRoadCameraState messages")
  if size is None:
    from selfdrive_glue.video import VideoReader
    vr = VideoReader(road_path)
    size = (vr.width, vr.height)
  label = f"roadCameraState (sensor {sensor})"
  _, road_frames = _video_frames(road_path, size, n_road, damage is not None, label)
  wide_frames = None
  if n_wide and wide_path is not None:
    wide_frames = _video_frames(wide_path, size, n_wide, damage is not None, "wideRoadCameraState")[1]

  car_params = next((ev.carParams for ev, _ in events if ev.which() == "carParams"), None)
  clock = _LogClock()
  core = ModeldCore(Path(artifact), car_params=car_params, clock=clock, camera=size)

  # like model_replay: the segment's first deviceState and liveCalibration are known from the start, so a segment cut
  # from the middle of a drive does not begin with uncalibrated (valid=False) frames
  for service in ("deviceState", "liveCalibration"):
    first = next((ev for ev, _ in events if ev.which() == service), None)
    if first is not None:
      clock.now_ns = events[0][0].logMonoTime
      core.on_message(first)

  out = Path(out)
  road = wide = None  # (state, frame buffer) received since the last step
  steps = published = 0
  total_steps = n_road
  with LogWriter(out) as w:
    for ev, _ in events:
      which = ev.which()
      clock.now_ns = ev.logMonoTime
      core.on_message(ev)
      if which == "roadCameraState":
        road = (ev.roadCameraState, _next_frame(road_frames, road_path))
      elif which == "wideRoadCameraState" and wide_frames is not None:
        wide = (ev.wideRoadCameraState, _next_frame(wide_frames, wide_path or road_path))
      else:
        continue
      if road is None or (wide_frames is not None and wide is None):
        continue
      main = Frame(road[1], int(road[0].frameId), int(road[0].timestampSof), int(road[0].timestampEof))
      extra = Frame(wide[1], int(wide[0].frameId), int(wide[0].timestampSof), int(wide[0].timestampEof)) if wide is not None else None
      outs = core.on_frame(main, extra, ev.logMonoTime)
      for o in outs:
        w.write(o[1] if isinstance(o, tuple) else o)
      steps += 1
      published += bool(outs)
      road = wide = None
      if on_frame is not None:
        on_frame(steps, total_steps)
    n_out = w.count
  return ReplayResult(segment=seg.name, out=out, frames=steps, published=published, events_in=len(events), events_out=n_out,
                      seconds=time.perf_counter() - t_start, damage=damage)


def _next_frame(frames, path: Path) -> np.ndarray:
  buf = next(frames, None)
  if buf is None:
    raise UserError(f"{path}: ran out of frames (decoding stopped early); the camera file is damaged or shorter than the log")
  return buf


def output_paths(segments: list[Segment], out: str | os.PathLike) -> list[Path]:
  """One segment and a log-file name -> that file; otherwise OUT is a directory holding <segment name>.zst each."""
  out = Path(out)
  log_name = out.suffix in LOG_SUFFIXES or out.suffix in (".rlog", ".log")
  if len(segments) == 1 and log_name:
    return [out]
  if log_name and not out.is_dir():
    raise UserError(f"-o {out} names one log file but there are {len(segments)} segments; pass a directory")
  if out.exists() and not out.is_dir():
    raise UserError(f"-o {out} is a file; with several segments -o must be a directory")
  names = [s.name for s in segments]
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    raise UserError(f"several segments are named {dupes[0]}; replay them into separate -o directories")
  return [out / f"{n}.zst" for n in names]


def _worker(args: tuple[str, str, str]) -> ReplayResult:
  seg, artifact, out = args
  try:
    return replay_segment(seg, artifact, out)
  except UserError as e:
    return ReplayResult(segment=Path(seg).name, out=Path(out), frames=0, published=0, events_in=0, events_out=0, seconds=0.0, error=str(e))


def replay_many(segments: list[Segment], artifact: str | os.PathLike, out: str | os.PathLike, jobs: int = 1,
                progress: bool = True) -> list[ReplayResult]:
  """Replay segments (in parallel worker processes when jobs > 1). Errors are per segment, in ReplayResult.error."""
  from tqdm import tqdm
  outs = output_paths(segments, out)
  for o in outs:
    o.parent.mkdir(parents=True, exist_ok=True)
  tasks = [(str(s.path), str(artifact), str(o)) for s, o in zip(segments, outs)]
  results: list[ReplayResult] = []
  if jobs <= 1 or len(tasks) == 1:
    for s, o in zip(segments, outs):
      bar = tqdm(desc=s.name, unit="frame", disable=not progress, leave=False)

      def tick(done, total, bar=bar):
        bar.total = total
        bar.update(done - bar.n)
      try:
        results.append(replay_segment(s, artifact, o, on_frame=tick))
      except UserError as e:
        results.append(ReplayResult(segment=s.name, out=o, frames=0, published=0, events_in=0, events_out=0, seconds=0.0, error=str(e)))
      finally:
        bar.close()
    return results
  import multiprocessing as mp
  from concurrent.futures import ProcessPoolExecutor, as_completed
  # spawn: a fresh interpreter per worker, no forked tinygrad/device state
  with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
    futs = {ex.submit(_worker, t): i for i, t in enumerate(tasks)}
    done: list[ReplayResult | None] = [None] * len(tasks)
    for f in tqdm(as_completed(futs), total=len(futs), desc="replay", unit="segment", disable=not progress):
      done[futs[f]] = f.result()
  return [r for r in done if r is not None]
