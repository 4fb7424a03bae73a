"""Replay logged segments through the same per-frame pipeline as `serve` (ModeldCore), deterministically.

Frames: every camera state is paired with its picture through the encode index (offcar/frame_map.py).

Steps: events are fed in log order, after the segment's first deviceState and liveCalibration (as model_replay
prepends them). A model step fires when a road state and a wide state whose start-of-frame times are within 25 ms (the
window modeld pairs frames in) have both arrived (road alone for a single-camera segment). The core's clock is the log's
time (logMonoTime of the event being processed), so modelExecutionTime is 0 and the output bytes depend only on the
inputs and the artifact.

Across segments (`mode`): "segment" starts every segment from a fresh model state; "warmup" first feeds the last
`warmup_steps` steps of the previous segment of the route and throws those outputs away, so segments stay independent
tasks yet start close to a continuous drive; "route" runs the segments of a route in order through one core, carrying
its state across boundaries. One loaded artifact serves all segments of a worker (`ModeldCore.reset()` between
independent ones); `replay_many(jobs=N)` runs tasks in N worker processes.

Driver monitoring: with a DM artifact (`dm_artifact`: one, or a release bundle holding dmonitoring/<w>x<h>/), a segment
that has the driver camera (driverCameraState, driverEncodeIdx, dcamera.hevc) also runs every driver frame through
DMonitoringCore, the step dmonitoringmodeld runs, fed the log's liveCalibration; its driverStateV2 go into the same
output log, so `regress` compares them like modeld's outputs (openpilot's model_replay does the same for both).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from artifact.format import MANIFEST, resolve_artifact
from modeld_msm.core import ModeldCore
from modeld_msm.dm_core import DMonitoringCore
from modeld_msm.frames import Frame, older_capture
from offcar.frame_map import SegmentPlan, plan_segment
from selfdrive_glue.errors import UserError
from selfdrive_glue.logs import LOG_SUFFIXES, LogWriter
from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.route import Segment, find_log, open_segment, segment_name

RING = 2  # camera buffers per stream, as process_replay's VisionIpcServer has
WARMUP_STEPS = 100  # 5 s at 20 Hz: the policy's whole feature history (docs/replay-at-scale.md)
MODES = ("segment", "warmup", "route")


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
  mapping: str = ""  # how camera states were paired with video frames
  skipped: int = 0  # camera states without an encoded frame (not shown to the model)
  recovered: int = 0  # states whose missing encode-index entry was recovered from the entries around it
  start: str = "fresh"  # the model state the segment started from (fresh, warm-up, or carried from the previous segment)
  video_damage: str | None = None  # what the decoder reported about damaged camera files (which frames), one line per file
  damaged_frames: int = 0  # frames the decoder reported errors for, all camera files together
  dm_published: int = 0  # driverStateV2 written (driver frames through the DM artifact)
  dm_note: str = ""  # why the segment's driver frames were not replayed, with a DM artifact given

  @property
  def fps(self) -> float:
    return self.frames / self.seconds if self.seconds > 0 else 0.0

  def summary(self) -> str:
    skipped = f"; {self.skipped} camera state(s) without an encoded frame skipped" if self.skipped else ""
    recovered = f"; {self.recovered} lost index entr{'y' if self.recovered == 1 else 'ies'} recovered" if self.recovered else ""
    damaged = f"; DAMAGED VIDEO: decode errors in {self.damaged_frames} frame(s)" if self.video_damage else ""
    dm = ""
    if self.dm_published:
      dm = f"; driver monitoring: {self.dm_published} driverStateV2"
    elif self.dm_note:
      dm = f"; no driver monitoring ({self.dm_note})"
    return (f"{self.segment}: {self.frames} frames, {self.events_out} events -> {self.out}  ({self.fps:.1f} frames/s)  "
            f"frames by {self.mapping}{skipped}{recovered}; start: {self.start}{dm}{damaged}")


class _LogClock:
  """The core's clock during replay: the log time of the event being processed, never the wall clock."""

  def __init__(self):
    self.now_ns = 0

  def __call__(self) -> float:
    return self.now_ns / 1e9


class _Frames:
  """Frames of one video on demand, in increasing index order, decoded into a fixed ring of buffers."""

  def __init__(self, path: Path, ring: list[np.ndarray], start: int = 0):
    from selfdrive_glue.video import VideoReader
    self.path, self.next_index = path, start
    self.reader = VideoReader(path)
    self._it: Iterator[np.ndarray] = self.reader.frames(ring, start=start)

  def get(self, index: int) -> np.ndarray:
    while True:
      buf = next(self._it, None)
      if buf is None:
        why = f" ({self.reader.error})" if self.reader.error else ""
        raise UserError(f"{self.path}: ran out of frames at frame {self.next_index}{why}; the camera file is damaged or shorter than the log")
      self.next_index += 1
      if self.next_index - 1 == index:
        return buf


def _previous_segment(seg: Segment, others: list[Segment]) -> Segment | None:
  """The segment before `seg` in its route: among `others`, else a sibling directory `<route>--<n-1>` with an rlog."""
  if seg.route is None or not seg.number:
    return None
  want = segment_name(seg.route, seg.number - 1)
  for o in others:
    if o.route == seg.route and o.number == seg.number - 1:
      return o
  sib = seg.path.parent / want
  return Segment(sib) if sib.is_dir() and find_log(sib, "rlog") is not None else None


class Replayer:
  """One loaded artifact replaying many segments: a fresh model state per segment (`ModeldCore.reset()`), a warm-up on
  the previous segment's tail, or state carried on from the segment replayed just before."""

  def __init__(self, artifact: str | os.PathLike, dm_artifact: str | os.PathLike | None = None):
    self.artifact = Path(artifact)
    self.dm_artifact = Path(dm_artifact) if dm_artifact is not None else None
    self.clock = _LogClock()
    self.core: Any = None
    self.dm: DMonitoringCore | None = None
    self.dm_published = 0   # driverStateV2 written by the last _run
    self.rings: dict[tuple[str, tuple[int, int]], list[np.ndarray]] = {}  # fixed buffers, so the model's per-buffer tensors are reused
    self.last: Segment | None = None  # the segment whose state the core holds (after a complete replay)
    self.video_reports: list[tuple[str, int]] = []  # the last _run's decoder reports: (line, damaged frames) per camera file

  def _ring(self, name: str, size: tuple[int, int]) -> list[np.ndarray]:
    if (name, size) not in self.rings:
      self.rings[(name, size)] = [np.zeros(nv12_info(*size).size, dtype=np.uint8) for _ in range(RING)]
    return self.rings[(name, size)]

  def _fresh_core(self, plan: SegmentPlan):
    if self.core is None:
      self.core = ModeldCore(self.artifact, car_params=plan.car_params, clock=self.clock, camera=plan.size)
    else:
      cam = self.core.model.artifact.camera
      if tuple(cam) != plan.size:
        raise UserError(f"segment {plan.seg.path} is {plan.size[0]}x{plan.size[1]} but artifact {self.artifact} is for camera "
                        f"{cam[0]}x{cam[1]}; replay segments of one camera size per run, or compile one with `--camera "
                        f"{plan.size[0]}x{plan.size[1]}`")
      self.core.reset(plan.car_params)
    self.last = None
    return self.core

  def _fresh_dm(self, plan: SegmentPlan) -> tuple[DMonitoringCore | None, str]:
    """The DM core for this segment's driver frames (reset: it starts from calib zero), or (None, why not)."""
    if self.dm_artifact is None:
      return None, ""
    if plan.driver is None:
      return None, plan.driver_note
    if self.dm is None or tuple(self.dm.camera) != plan.size:
      path = self.dm_artifact if (self.dm_artifact / MANIFEST).exists() else resolve_artifact(self.dm_artifact, plan.size, "dmonitoringmodeld")
      self.dm = DMonitoringCore(path, clock=self.clock, camera=plan.size)
    self.dm.reset()
    return self.dm, ""

  def _prime(self, plan: SegmentPlan, before: int) -> None:
    """Tell the core the device and calibration a continuous run would know at event `before` (the newest earlier ones;
    else the segment's first, as model_replay prepends them, so a segment cut mid-drive starts calibrated)."""
    self.clock.now_ns = plan.events[0].logMonoTime
    for service in ("deviceState", "liveCalibration"):
      ev = next((e for e in reversed(plan.events[:before]) if e.which() == service), None)
      ev = ev or next((e for e in plan.events if e.which() == service), None)
      if ev is not None:
        self.core.on_message(ev)

  def _run(self, plan: SegmentPlan, start: int, writer: LogWriter | None, on_frame: Callable[[int, int], None] | None,
           dm: DMonitoringCore | None = None) -> tuple[int, int]:
    """Feed plan.events[start:] to the core (and the driver frames to `dm`); -> (steps, published). Outputs go to writer
    (None: thrown away). What the decoder reported about the camera files is left in self.video_reports
    (DecodeReport.describe lines, frames); the driverStateV2 written are counted in self.dm_published."""
    core, clock = self.core, self.clock
    streams = plan.streams() + ([plan.driver] if dm is not None and plan.driver is not None else [])
    starts = {m.name: min((v for p, v in m.frame_of.items() if p >= start), default=0) for m in streams}
    frames = {m.name: _Frames(m.path, self._ring(m.name, plan.size), starts[m.name]) for m in streams}
    maps = {"roadCameraState": plan.road, "wideRoadCameraState": plan.wide}
    if dm is not None:
      maps["driverCameraState"] = plan.driver
    self.dm_published = 0
    total = sum(1 for p in plan.road_steps if p >= start)
    pending: dict[str, Any] = {}  # stream -> Frame received since the last step
    steps = published = 0
    for pos in range(start, len(plan.events)):
      ev = plan.events[pos]
      which = ev.which()
      m = maps.get(which)
      if m is not None and pos not in m.frame_of:
        continue  # no encoded frame: process_replay drops the state too
      clock.now_ns = ev.logMonoTime
      core.on_message(ev)
      if dm is not None:
        dm.on_message(ev)
      if m is None:
        continue
      st = getattr(ev, which)
      frame = Frame(frames[m.name].get(m.frame_of[pos]), int(st.frameId), int(st.timestampSof), int(st.timestampEof))
      if m.name == "driver":
        assert dm is not None
        for _, dat in dm.on_frame(frame, log_mono_time=ev.logMonoTime):
          if writer is not None:
            writer.write(dat)
          self.dm_published += 1
        continue
      pending[m.name] = frame
      road, wide = pending.get("road"), pending.get("wide")
      if road is None or (plan.wide is not None and wide is None):
        continue
      if wide is not None and older_capture(wide.timestamp_sof, road.timestamp_sof):
        del pending["wide"]  # its road frame was never encoded; it has no partner
        continue
      if wide is not None and older_capture(road.timestamp_sof, wide.timestamp_sof):
        del pending["road"]
        continue
      outs = core.on_frame(road, wide, ev.logMonoTime)
      if writer is not None:
        for o in outs:
          writer.write(o[1] if isinstance(o, tuple) else o)
      steps += 1
      published += bool(outs)
      pending.clear()
      if on_frame is not None:
        on_frame(steps, total)
    self.video_reports = []
    for m in streams:
      svc = {"road": "roadCameraState", "wide": "wideRoadCameraState", "driver": "driverCameraState"}[m.name]
      camera_frame = {v: int(getattr(plan.events[p], svc).frameId) for p, v in m.frame_of.items()}
      rep = frames[m.name].reader.report
      line = rep.describe(camera_frame)
      if line is not None:
        self.video_reports.append((line, sum(1 for f in rep.errors if f < rep.decoded)))
    return steps, published

  def _warm_up(self, prev: Segment, steps: int, car_params) -> str:
    """Feed the last `steps` steps of `prev` with their outputs thrown away; -> what the result's `start` says. A previous
    segment that cannot be replayed costs the warm-up, not the segment: it then starts fresh and says why."""
    try:
      plan = plan_segment(prev)
      if plan.size != tuple(self.core.model.artifact.camera):
        return f"fresh (warm-up segment {prev.name} is {plan.size[0]}x{plan.size[1]})"
      start = plan.road_steps[-steps] if 0 < steps <= len(plan.road_steps) else 0
      self._prime(plan, start)
      done, _ = self._run(plan, start, None, None)
    except UserError as e:
      self.core.reset(car_params)
      return f"fresh (no warm-up: {e})"
    return f"warm-up on the last {done} frames of {prev.name}"

  def replay(self, seg: str | os.PathLike | Segment, out: str | os.PathLike, mode: str = "segment", previous: Segment | None = None,
             warmup_steps: int = WARMUP_STEPS, on_frame: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Replay one segment into the log file `out`. mode "warmup": first the tail of `previous`; mode "route": carry on
    from the core's state if `previous` is the segment replayed just before (else start fresh)."""
    if mode not in MODES:
      raise UserError(f"unknown replay mode '{mode}'; use one of {', '.join(MODES)}")
    t_start = time.perf_counter()
    seg = seg if isinstance(seg, Segment) else open_segment(seg)
    plan = plan_segment(seg)
    carry = mode == "route" and previous is not None and self.last is not None and self.last.path == previous.path and self.core is not None
    if carry and tuple(self.core.model.artifact.camera) != plan.size:
      carry = False
    if carry:
      assert previous is not None
      start = f"carried on from {previous.name}"  # as on the car: one modeld process (and one CarParams) for the whole drive
    if not carry:
      self._fresh_core(plan)
      start = "fresh"
      if mode == "warmup" and previous is not None and warmup_steps > 0:
        start = self._warm_up(previous, warmup_steps, plan.car_params)
      elif mode == "route" and previous is not None:
        start = f"fresh (previous segment {previous.name} failed)"
      elif mode in ("warmup", "route") and seg.number:
        start = f"fresh (no previous segment {segment_name(seg.route or '?', seg.number - 1)})"
      if not start.startswith("warm-up"):
        self._prime(plan, 0)
    self.last = None
    dm, dm_note = self._fresh_dm(plan)
    if dm is not None:   # the calibration a continuous run would know, as for the driving core
      cal = next((e for e in plan.events if e.which() == "liveCalibration"), None)
      if cal is not None:
        dm.on_message(cal)
    out = Path(out)
    with LogWriter(out) as w:
      steps, published = self._run(plan, 0, w, on_frame, dm)
      n_out = w.count
      if not published:
        # an output log without a single model output would pass for a replay (and `regress` would compare nothing)
        raise UserError(f"segment {seg.path}: {steps} model step(s) but not one model output (a step right after a gap in the camera "
                        f"frames only fills the image queues; {len(plan.road_steps)} road camera state(s) had a picture); nothing written")
    self.last = seg
    reports = self.video_reports
    return ReplayResult(segment=seg.name, out=out, frames=steps, published=published, events_in=len(plan.events), events_out=n_out,
                        seconds=time.perf_counter() - t_start, damage=plan.damage, mapping=plan.mapping,
                        skipped=sum(m.skipped for m in plan.streams()), recovered=sum(m.recovered for m in plan.streams()), start=start,
                        video_damage="; ".join(line for line, _ in reports) or None, damaged_frames=sum(n for _, n in reports),
                        dm_published=self.dm_published, dm_note=dm_note)


def replay_segment(seg: str | os.PathLike | Segment, artifact: str | os.PathLike, out: str | os.PathLike,
                   on_frame: Callable[[int, int], None] | None = None, dm_artifact: str | os.PathLike | None = None) -> ReplayResult:
  """Replay one segment into the log file `out`, from a fresh model state. on_frame(done, total) reports progress."""
  return Replayer(artifact, dm_artifact).replay(seg, out, on_frame=on_frame)


def output_paths(segments: list[Segment], out: str | os.PathLike) -> list[Path]:
  """One segment and a log-file name -> that file; otherwise OUT is a directory holding <segment name>.zst each."""
  out = Path(out)
  log_name = out.suffix in LOG_SUFFIXES or out.suffix in (".rlog", ".log")
  if len(segments) == 1 and log_name:
    return [out]
  if log_name and not out.is_dir():
    raise UserError(f"-o {out} names one log file but there are {len(segments)} segments; pass a directory")
  if out.exists() and not out.is_dir():
    if len(segments) == 1:
      raise UserError(f"-o {out} is an existing file that is not named like a log; name the output log .zst or .bz2, or pass a "
                      "directory (it then gets <segment>.zst)")
    raise UserError(f"-o {out} is a file; with several segments -o must be a directory")
  names = [s.name for s in segments]
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    raise UserError(f"several segments are named {dupes[0]}; replay them into separate -o directories")
  return [out / f"{n}.zst" for n in names]


# one task: [(segment, out, previous segment or None)] replayed in order by one Replayer (several only in route mode)
_Task = list[tuple[Segment, Path, Segment | None]]


def plan_tasks(segments: list[Segment], outs: list[Path], mode: str) -> list[_Task]:
  """Segments -> tasks. route: one task per route, its segments in number order; else one task per segment."""
  if mode != "route":
    prevs = [_previous_segment(s, segments) if mode == "warmup" else None for s in segments]
    return [[(s, o, p)] for s, o, p in zip(segments, outs, prevs)]
  groups: dict[str, list[tuple[Segment, Path]]] = {}
  for s, o in zip(segments, outs):
    groups.setdefault(s.route if s.route is not None else f"\0{s.path}", []).append((s, o))
  tasks = []
  for members in groups.values():
    members.sort(key=lambda so: so[0].number or 0)
    task: _Task = []
    for k, (s, o) in enumerate(members):
      before = members[k - 1][0] if k else None
      task.append((s, o, before if before is not None and before.number == (s.number or 0) - 1 else None))
    tasks.append(task)
  return tasks


def _error_result(seg: Segment, out: Path, e: Exception) -> ReplayResult:
  return ReplayResult(segment=seg.name, out=out, frames=0, published=0, events_in=0, events_out=0, seconds=0.0, error=str(e))


def _run_task(replayer: Replayer, task: _Task, mode: str, warmup_steps: int, progress_for=None) -> list[ReplayResult]:
  results = []
  for seg, out, prev in task:
    tick = progress_for(seg) if progress_for is not None else (None, None)
    try:
      results.append(replayer.replay(seg, out, mode=mode, previous=prev, warmup_steps=warmup_steps, on_frame=tick[0]))
    except UserError as e:
      replayer.last = None  # a route continues from a fresh state after a failed segment
      results.append(_error_result(seg, out, e))
    finally:
      if tick[1] is not None:
        tick[1]()
  return results


_WORKER: Replayer | None = None  # one per worker process: the artifact is loaded once and serves every task it gets


def _worker(args: tuple[str, str | None, _Task, str, int]) -> list[ReplayResult]:
  global _WORKER
  artifact, dm_artifact, task, mode, warmup_steps = args
  if _WORKER is None or _WORKER.artifact != Path(artifact) or _WORKER.dm_artifact != (Path(dm_artifact) if dm_artifact else None):
    _WORKER = Replayer(artifact, dm_artifact)
  try:
    return _run_task(_WORKER, task, mode, warmup_steps)
  except UserError as e:  # the artifact itself (e.g. refused on load): every segment of the task gets the error
    _WORKER = None
    return [_error_result(s, o, e) for s, o, _ in task]


def replay_many(segments: list[Segment], artifact: str | os.PathLike, out: str | os.PathLike, jobs: int = 1, progress: bool = True,
                mode: str = "segment", warmup_steps: int = WARMUP_STEPS, dm_artifact: str | os.PathLike | None = None) -> list[ReplayResult]:
  """Replay segments (tasks in parallel worker processes when jobs > 1), results in the order of `segments`.
  Errors are per segment, in ReplayResult.error."""
  from tqdm import tqdm
  if mode not in MODES:
    raise UserError(f"unknown replay mode '{mode}'; use one of {', '.join(MODES)}")
  if warmup_steps < 0:
    raise UserError(f"--warmup-steps must be >= 0, got {warmup_steps}")
  outs = output_paths(segments, out)
  for o in outs:
    o.parent.mkdir(parents=True, exist_ok=True)
  tasks = plan_tasks(segments, outs, mode)
  order = {s.path: i for i, s in enumerate(segments)}
  results: list[ReplayResult | None] = [None] * len(segments)
  if jobs <= 1 or len(tasks) == 1:
    replayer = Replayer(artifact, dm_artifact)

    def progress_for(seg: Segment):
      bar = tqdm(desc=seg.name, unit="frame", disable=not progress, leave=False)

      def tick(done, total):
        bar.total = total
        bar.update(done - bar.n)
      return tick, bar.close
    for task in tasks:
      try:
        rs = _run_task(replayer, task, mode, warmup_steps, progress_for)
      except UserError as e:
        rs = [_error_result(s, o, e) for s, o, _ in task]
      for (s, _, _), r in zip(task, rs):
        results[order[s.path]] = r
    return [r for r in results if r is not None]
  import multiprocessing as mp
  from concurrent.futures import ProcessPoolExecutor, as_completed
  # spawn: a fresh interpreter per worker, no forked tinygrad/device state
  with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
    futs = {ex.submit(_worker, (str(artifact), str(dm_artifact) if dm_artifact else None, t, mode, warmup_steps)): t for t in tasks}
    with tqdm(total=len(segments), desc="replay", unit="segment", disable=not progress) as bar:
      for f in as_completed(futs):
        for (s, _, _), r in zip(futs[f], f.result()):
          results[order[s.path]] = r
          bar.update(1)
  return [r for r in results if r is not None]
