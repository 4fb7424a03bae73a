"""Which video frame belongs to which camera state: the encode-index mapping replay pairs frames by.

Every camera state is paired with its picture through the encode index, as openpilot's process_replay does:
roadEncodeIdx / wideRoadEncodeIdx say, for each encoded frame, which camera frameId it is and where it sits in the
segment's video (segmentNum, segmentId). Video and states do not line up one to one on a device (segment 0's video
starts a few frames after the first state; the encoder drops frames), so states without an encoded frame are skipped
(and not shown to the model), an index entry lost from the log is recovered when the entries around it pin it down
exactly, and what the index cannot explain is refused: an entry past the end of the video, video frames no entry
accounts for (a shifted or foreign camera file), an index out of camera order. Logs without an encode index (old or
synthetic) fall back to order — state k of a stream goes with frame k of its file — and every result says which
mapping it used.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfdrive_glue.errors import UserError
from selfdrive_glue.logs import LogReader
from selfdrive_glue.route import DRIVER_CAMERA, ROAD_CAMERA, WIDE_CAMERA, Segment
from selfdrive_glue.video import VideoReader

SENSOR_SIZES = {"ar0231": (1928, 1208), "ox03c10": (1928, 1208), "os04c10": (1344, 760)}
STREAMS = (("road", "roadCameraState", "roadEncodeIdx", ROAD_CAMERA), ("wide", "wideRoadCameraState", "wideRoadEncodeIdx", WIDE_CAMERA),
           ("driver", "driverCameraState", "driverEncodeIdx", DRIVER_CAMERA))
# an encode-index entry and its camera state carry the same start-of-frame time (encoderd copies camerad's frame metadata);
# a frame apart is 50 ms, so anything beyond this names another frame
SOF_TOLERANCE_NS = 1_000_000


@dataclass
class StreamMap:
  """One camera's states -> frames of its video file."""
  name: str  # road / wide
  path: Path
  by_index: bool  # through the encode index (else by order)
  frame_of: dict[int, int]  # event position of a camera state -> index of its frame in the video
  n_video: int
  skipped: int = 0
  recovered: int = 0

  @property
  def mapping(self) -> str:
    return "encode index" if self.by_index else "order (no encode index in the log)"


@dataclass
class SegmentPlan:
  """A segment read and checked: its events, and where each camera state's picture is."""
  seg: Segment
  events: list[Any]
  damage: str | None
  size: tuple[int, int]
  car_params: Any
  road: StreamMap
  wide: StreamMap | None
  road_steps: list[int] = field(default_factory=list)  # event positions of the mapped road states, in log order
  driver: StreamMap | None = None   # the driver camera (dmonitoringmodeld's), when the segment has its states and dcamera.hevc
  driver_note: str = ""             # why there is none

  @property
  def mapping(self) -> str:
    if self.wide is None or self.wide.by_index == self.road.by_index:
      return self.road.mapping
    return f"road: {self.road.mapping}, wide: {self.wide.mapping}"

  def streams(self) -> list[StreamMap]:
    return [self.road] + ([self.wide] if self.wide is not None else [])


def _check_index_times(entries: list[Any], state_sof: dict[int, int], rlog: Path, service: str, state_svc: str) -> None:
  """UserError when index entries' start-of-frame times are not their camera states' (frameIds shifted, or from another
  drive): pairing by frameId would then give every state another picture. Entries without a time (older logs) pass."""
  bad = [(int(e.frameId), int(e.timestampSof)) for e in entries
         if e.timestampSof and state_sof.get(int(e.frameId)) and abs(int(e.timestampSof) - state_sof[int(e.frameId)]) > SOF_TOLERANCE_NS]
  if not bad:
    return
  fid, t = bad[0]
  ts = state_sof[fid]
  by_time = sorted((v, k) for k, v in state_sof.items() if v)
  k = bisect.bisect_left(by_time, (t - SOF_TOLERANCE_NS, -(1 << 62)))
  owner = by_time[k][1] if k < len(by_time) and abs(by_time[k][0] - t) <= SOF_TOLERANCE_NS else None
  why = (f"that is camera frame {owner}'s start of frame, so its frameIds are shifted by {fid - owner:+d}" if owner is not None
         else "no camera state started then")
  raise UserError(f"{rlog}: {service} puts camera frame {fid} at start of frame {t} ns, but its {state_svc} says {ts} ns "
                  f"({(t - ts) / 1e6:+.1f} ms; {len(bad)} of {len(entries)} entries disagree): {why}; the encode index does not "
                  "match the camera states, so the frames cannot be paired")


def _index_map(name: str, path: Path, states: list[tuple[int, int]], entries: list[Any], n_video: int, damaged: bool, rlog: Path,
               service: str, state_sof: dict[int, int] | None = None, state_svc: str = "camera state") -> StreamMap:
  """Map states [(event position, frameId)] through encode-index entries; UserError for what the index cannot explain.
  state_sof: frameId -> the state's timestampSof, checked against the entries'."""
  seg_num = Counter(int(e.segmentNum) for e in entries).most_common(1)[0][0]  # entries of other numbers: frames in a neighbour's file
  sid_of: dict[int, int] = {}
  fid_of: dict[int, int] = {}
  for e in entries:
    if int(e.segmentNum) != seg_num:
      continue
    fid, sid = int(e.frameId), int(e.segmentId)
    if sid_of.setdefault(fid, sid) != sid or fid_of.setdefault(sid, fid) != fid:
      raise UserError(f"{rlog}: {service} puts camera frame {fid} at video frame {sid} and another entry says otherwise "
                      f"(frame {fid_of[sid]} at {sid_of[fid]}); the encode index is corrupt, so the frames cannot be paired")
  known = sorted(sid_of.items())
  for (fa, sa), (fb, sb) in zip(known, known[1:]):
    if sb <= sa:
      raise UserError(f"{rlog}: {service} is not in camera order (frame {fb} at video frame {sb}, before frame {fa} at {sa}); "
                      "the encode index is corrupt, so the frames cannot be paired")
  if state_sof:
    _check_index_times([e for e in entries if int(e.segmentNum) == seg_num], state_sof, rlog, service, state_svc)
  first_fid, first_sid = known[0]
  last_fid, last_sid = known[-1]
  if last_sid >= n_video:
    raise UserError(f"{path}: {n_video} frames, but the log's {service} puts camera frame {last_fid} at video frame {last_sid}; "
                    "the camera file is from another segment or cut short")
  if first_sid > 0:
    raise UserError(f"{path}: video frames 0..{first_sid - 1} are not in the log's {service} (its first entry is camera frame "
                    f"{first_fid} at video frame {first_sid}); the camera file does not match this log")
  if last_sid < n_video - 1 and not damaged:
    raise UserError(f"{path}: {n_video} frames, but the log's {service} accounts for {last_sid + 1} (up to camera frame {last_fid}); "
                    "the camera file is shifted against the log or from another segment")
  # an entry lost from the log: a gap of g video frames between two entries whose camera frames are g + 1 apart is
  # exactly the frames in between; any other gap (the encoder also dropped some) cannot be pinned and its states are skipped
  recoverable: dict[int, int] = {}
  for (fa, sa), (fb, sb) in zip(known, known[1:]):
    if sb - sa > fb - fa:
      raise UserError(f"{rlog}: {service} puts {sb - sa - 1} video frames between camera frames {fa} and {fb}, more than there "
                      "are camera frames; the encode index is corrupt")
    if sb - sa > 1 and sb - sa == fb - fa:
      recoverable.update({fa + j: sa + j for j in range(1, sb - sa)})
  m = StreamMap(name, path, True, {}, n_video)
  prev = -1
  for pos, fid in states:
    at = sid_of.get(fid)
    if at is None and (at := recoverable.get(fid)) is not None:
      m.recovered += 1
    if at is None:
      m.skipped += 1  # never encoded, or encoded into a neighbouring segment's file
      continue
    if at <= prev:
      raise UserError(f"{rlog}: camera frame {fid} is logged again or out of order (its video frame {at} comes before one already used)")
    m.frame_of[pos] = prev = at
  if not m.frame_of:
    raise UserError(f"{rlog}: no {name} camera state has a frame in {path.name} ({len(states)} states, {len(sid_of)} index entries); "
                    "the log and camera file are from different segments")
  return m


def _order_map(name: str, path: Path, states: list[tuple[int, int]], n_video: int, damaged: bool, label: str) -> StreamMap:
  if n_video < len(states) or (n_video != len(states) and not damaged):
    raise UserError(f"{path}: {n_video} frames but the log has {len(states)} {label} messages; the camera file and log do not match")
  return StreamMap(name, path, False, {pos: k for k, (pos, _) in enumerate(states)}, n_video)


def require_rlog(seg: Segment) -> Path:
  """The segment's rlog; UserError naming what is there instead (a qlog is no substitute)."""
  rlog = seg.log("rlog")
  if rlog is None:
    qlog = seg.log("qlog")
    has = f" (it has {qlog.name} only)" if qlog is not None else ""
    raise UserError(f"segment {seg.path} has no rlog{has}; replay needs every camera state, which a qlog decimates away: "
                    "download the segment's rlog and fcamera.hevc (+ ecamera.hevc)")
  return rlog


def _check_not_decimated(rlog: Path, service: str, frame_ids: list[int], index_ids: list[int]) -> None:
  """A qlog keeps one camera state in 20 (and every encode-index entry): renamed to rlog it would replay a handful of
  steps, each after a gap, so no output at all. Real rlogs step their frameIds by 1 (a drop now and then) and have a
  state for every encoded frame but those encoded into a neighbouring segment's file."""
  steps = sorted(b - a for a, b in zip(frame_ids, frame_ids[1:]))
  median = steps[(len(steps) - 1) // 2] if steps else 1
  have = set(frame_ids)
  without = sum(1 for f in index_ids if f not in have)
  if median >= 2 or (len(index_ids) >= 4 and without > len(index_ids) // 2):
    shown = ", ".join(map(str, frame_ids[:4])) + (", ..." if len(frame_ids) > 4 else "")
    how = f"one every {median} camera frames" if median >= 2 else f"{len(frame_ids)} for {len(index_ids)} encoded frames"
    raise UserError(f"{rlog}: its {service} messages are {how} (frames {shown}), not one per frame: this looks like a qlog "
                    "(decimated) under an rlog's name; replay needs the segment's real rlog")


def plan_segment(seg: Segment) -> SegmentPlan:
  """Read a segment's rlog and check it against its camera files (frame counts only; nothing is decoded yet)."""
  rlog = require_rlog(seg)
  reader = LogReader(rlog)
  events = [ev for ev, _ in reader.events_with_bytes()]
  damage = reader.damage
  which = [ev.which() for ev in events]
  road_states = [(i, ev.roadCameraState) for i, ev in enumerate(events) if which[i] == "roadCameraState"]
  if not road_states:
    raise UserError(f"{rlog}: no roadCameraState messages; nothing to replay")
  sensor = str(road_states[0][1].sensor)
  size = SENSOR_SIZES.get(sensor)
  maps: dict[str, StreamMap] = {}
  driver_note = "no driverCameraState in the log"
  for name, state_svc, index_svc, camera in STREAMS:
    states = [(i, int(getattr(events[i], state_svc).frameId)) for i in range(len(events)) if which[i] == state_svc]
    if not states:
      continue
    path = seg.camera(camera)
    if path is None and name == "driver":   # the driver camera is often not downloaded: only the DM replay needs it
      driver_note = f"no {camera} for its {len(states)} {state_svc} messages"
      continue
    if path is None:
      raise UserError(f"segment {seg.path}: missing camera file {camera} for {len(states)} {state_svc} messages")
    vr = VideoReader(path)
    if size is None:
      size = (vr.width, vr.height)
    label = f"roadCameraState (sensor {sensor})" if name == "road" else state_svc
    if (vr.width, vr.height) != size:
      raise UserError(f"{path}: video is {vr.width}x{vr.height} but the log's {label} says {size[0]}x{size[1]}; "
                      "the camera file does not belong to this log")
    entries = [getattr(events[i], index_svc) for i in range(len(events)) if which[i] == index_svc]
    _check_not_decimated(rlog, state_svc, [fid for _, fid in states], [int(e.frameId) for e in entries])
    n_video = vr.count()
    if entries:
      state_sof = {int(getattr(events[i], state_svc).frameId): int(getattr(events[i], state_svc).timestampSof) for i, _ in states}
      maps[name] = _index_map(name, path, states, entries, n_video, damage is not None, rlog, index_svc, state_sof, state_svc)
    else:
      maps[name] = _order_map(name, path, states, n_video, damage is not None, label)
  assert size is not None
  car_params = next((ev.carParams for i, ev in enumerate(events) if which[i] == "carParams"), None)
  plan = SegmentPlan(seg, events, damage, size, car_params, maps["road"], maps.get("wide"), driver=maps.get("driver"),
                     driver_note="" if "driver" in maps else driver_note)
  plan.road_steps = sorted(plan.road.frame_of)
  return plan
