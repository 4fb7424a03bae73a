"""Camera files with PyAV: raw HEVC (fcamera.hevc / ecamera.hevc) and H.264 in MPEG-TS (qcamera.ts).

Decoding yields frames in the VENUS NV12 layout camerad allocates (Y rows at the stride, UV from uv_offset), which is
what the model pipeline reads; tight NV12 (h*w*3/2, what openpilot's FrameReader returns) converts both ways.
Encoding follows the recorder's settings (HEVC 10 Mbit/s GOP 30 at 1928 wide, 5 Mbit/s GOP 20 at <= 1344 wide, no
B-frames; qcamera H.264 526x330 256 kbit/s GOP 15) with x265/x264 presets fast enough for a laptop.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import av
import numpy as np

from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import NV12Info, nv12_info

QCAMERA_SIZE = (526, 330)
_FORMATS = {".hevc": ("hevc", "libx265"), ".h265": ("hevc", "libx265"), ".ts": ("mpegts", "libx264"), ".h264": ("h264", "libx264"),
            ".mkv": ("matroska", "libx265")}


def _container_format(path: Path) -> tuple[str, str]:
  fmt = _FORMATS.get(path.suffix.lower())
  if fmt is None:
    raise UserError(f"{path}: unknown video file type '{path.suffix}'; use .hevc (fcamera/ecamera) or .ts (qcamera)")
  return fmt


def venus_planes(buf: np.ndarray, info: NV12Info) -> tuple[np.ndarray, np.ndarray]:
  """Views of a VENUS buffer: Y (h, w) and interleaved UV (h/2, w)."""
  buf = buf.reshape(-1)
  y = buf[:info.stride * info.y_height].reshape(info.y_height, info.stride)[:info.height, :info.width]
  uv = buf[info.uv_offset:info.uv_offset + info.stride * info.uv_height].reshape(info.uv_height, info.stride)[:info.height // 2, :info.width]
  return y, uv


def tight_to_venus(nv12: np.ndarray, width: int, height: int, out: np.ndarray | None = None) -> np.ndarray:
  """Tight NV12 (h*3/2 rows of w) -> VENUS buffer; padding is zero in a fresh buffer."""
  info = nv12_info(width, height)
  out = np.zeros(info.size, dtype=np.uint8) if out is None else out
  flat = nv12.reshape(-1)
  y, uv = venus_planes(out, info)
  y[...] = flat[:width * height].reshape(height, width)
  uv[...] = flat[width * height:width * height * 3 // 2].reshape(height // 2, width)
  return out


def venus_to_tight(buf: np.ndarray, width: int, height: int) -> np.ndarray:
  y, uv = venus_planes(buf, nv12_info(width, height))
  return np.concatenate([y.reshape(-1), uv.reshape(-1)])


def _plane(frame: av.VideoFrame, i: int, w: int, h: int) -> np.ndarray:
  p = frame.planes[i]
  return np.frombuffer(memoryview(p), dtype=np.uint8).reshape(-1, p.line_size)[:h, :w]


def frame_to_venus(frame: av.VideoFrame, out: np.ndarray | None = None) -> np.ndarray:
  """A decoded frame (yuv420p/yuvj420p/nv12) -> VENUS NV12 buffer at the frame's native size."""
  w, h = frame.width, frame.height
  info = nv12_info(w, h)
  out = np.zeros(info.size, dtype=np.uint8) if out is None else out
  y, uv = venus_planes(out, info)
  fmt = frame.format.name
  if fmt not in ("yuv420p", "yuvj420p", "nv12"):
    frame = frame.reformat(format="yuv420p")
    fmt = "yuv420p"
  y[...] = _plane(frame, 0, w, h)
  if fmt == "nv12":
    uv[...] = _plane(frame, 1, w, h // 2)
  else:
    uv3 = uv.reshape(h // 2, w // 2, 2)
    uv3[..., 0] = _plane(frame, 1, w // 2, h // 2)
    uv3[..., 1] = _plane(frame, 2, w // 2, h // 2)
  return out


@contextmanager
def _decoder_messages() -> Iterator[list[tuple[int, str, str]]]:
  """FFmpeg's warnings and errors while the body runs, collected instead of dropped. PyAV discards all of FFmpeg's messages
  unless a level is set, so it is raised for the body only, and repeats are not folded into a later "repeated N times" line
  (each packet gets its own)."""
  level, skip = av.logging.get_level(), av.logging.get_skip_repeated()
  raise_level = level is None or level < av.logging.WARNING
  if raise_level:
    av.logging.set_level(av.logging.WARNING)
  av.logging.set_skip_repeated(False)
  logs: list[tuple[int, str, str]] = []
  try:
    with av.logging.Capture(local=False) as got:  # not local: slice threads log from their own threads
      yield logs
  finally:
    av.logging.set_skip_repeated(skip)
    if raise_level:
      av.logging.set_level(level)
  logs.extend(m for m in got if m[0] <= av.logging.WARNING)


@dataclass
class DecodeReport:
  """What the decoder said about one pass over a camera file: frames whose packet it reported errors for (it conceals
  them: the picture is partly made up), frames it gave nothing for (lost), and where the keyframes are (a damaged frame
  spoils every frame predicted from it, up to the next keyframe)."""
  path: Path
  errors: dict[int, list[str]] = field(default_factory=dict)  # frame index -> the decoder's messages about its packet
  lost: list[int] = field(default_factory=list)
  keyframes: list[int] = field(default_factory=list)
  decoded: int = 0  # frames read so far (index of the last one + 1)

  def __bool__(self) -> bool:
    return bool(self.errors)

  def affected(self) -> list[tuple[int, int]]:
    """Ranges [first, last] of frames that are damaged or predict from a damaged frame, among the frames read."""
    out: list[tuple[int, int]] = []
    for f in sorted(self.errors):
      if f >= self.decoded:
        continue
      end = min([k - 1 for k in self.keyframes if k > f] + [self.decoded - 1])
      if out and f <= out[-1][1] + 1:
        out[-1] = (out[-1][0], max(out[-1][1], end))
      else:
        out.append((f, end))
    return out

  def describe(self, camera_frame: dict[int, int] | None = None) -> str | None:
    """One line for the user, or None when the decoder said nothing. camera_frame: video frame index -> camera frameId."""
    bad = [f for f in sorted(self.errors) if f < self.decoded]
    if not bad:
      return None

    def frames(ix: list[int]) -> str:
      shown = ", ".join(map(str, ix[:12])) + (f" and {len(ix) - 12} more" if len(ix) > 12 else "")
      ids = [camera_frame[i] for i in ix[:12] if camera_frame and i in camera_frame]
      return shown + (f" = camera frames {', '.join(map(str, ids))}{', ...' if len(ix) > 12 else ''}" if ids else "")
    first = self.errors[bad[0]][0]
    first = first if len(first) <= 80 else first[:77] + "..."
    lost = [f for f in self.lost if f < self.decoded]
    n_aff = sum(b - a + 1 for a, b in self.affected())
    ranges = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in self.affected())
    msg = (f"{self.path.name} is damaged: the decoder reported errors in {len(bad)} of {self.decoded} frames (video frames {frames(bad)}; "
           f"first: {first!r}) and concealed them")
    if lost:
      msg += f"; {len(lost)} it could not decode at all (video frames {frames(lost)}), the frame before stands in"
    return (msg + f"; {n_aff} frames are damaged or predict from a damaged one (video frames {ranges}): their outputs are not "
            "trustworthy; copy the file from the device again if you can")


class VideoReader:
  """Sequential decoder of one camera file; `frames()` yields VENUS NV12 buffers.

  By default each frame is a fresh array; with `ring=[buf, ...]` frames are decoded into those buffers in turn, like
  camerad's VisionIPC ring (consumers that cache per buffer address, as ModelState does, then see a fixed set)."""

  def __init__(self, path: str | os.PathLike):
    self.path = Path(path)
    if not self.path.exists():
      raise UserError(f"camera file {self.path} not found; check the segment directory (expected fcamera.hevc, ecamera.hevc or qcamera.ts)")
    self._fmt, _ = _container_format(self.path)
    try:
      with av.open(str(self.path), format=self._fmt) as c:
        if not c.streams.video:
          raise UserError(f"{self.path}: no video stream")
        first = next(c.decode(video=0), None)
    except av.error.FFmpegError as e:
      raise UserError(f"{self.path}: not a readable {self._fmt} video ({e}); re-record or re-encode it") from None
    if first is None:
      raise UserError(f"{self.path}: contains no decodable frames")
    self.width, self.height = first.width, first.height
    self.info = nv12_info(self.width, self.height)
    self.error: str | None = None  # set when decoding stopped early on damaged data
    self.report = DecodeReport(self.path)  # what the decoder said during the last frames()

  def frames(self, ring: list[np.ndarray] | None = None, start: int = 0) -> Iterator[np.ndarray]:
    """Frames from index `start` on. start > 0 decodes from the keyframe at or before it (at most a GOP of extra work), not
    from frame 0: replay's warm-up reads only the tail of the previous segment's video.

    What the decoder says about damaged data is kept in `report` (frames it concealed, frames it gave nothing for); a
    frame the decoder drops is replaced by the one before it, so frame k stays the k-th picture of the file."""
    self.error = None
    self.report = DecodeReport(self.path)
    key = self._keyframe_at_or_before(start) if start > 0 else 0
    rep = self.report
    n = 0  # frames yielded
    pos = key  # index of the next frame the decoder returns
    last: av.VideoFrame | None = None  # the last picture the decoder gave: the stand-in for a lost one
    with av.open(str(self.path), format=self._fmt) as c:
      st = c.streams.video[0]
      # slice threads (still parallel over WPP rows) rather than frame threads: the decoder's messages about a packet then
      # arrive while that packet is decoded, so they can be pinned on its frame; frame threads report them later, from elsewhere
      st.thread_type = "SLICE"
      packets = c.demux(st)
      i = -1  # index of the last packet with data
      while True:
        with _decoder_messages() as logs:
          try:
            pkt = next(packets, None)
            if pkt is None:
              return
            if pkt.size:
              i += 1
              if i < key:
                continue
            decoded = st.decode(pkt)  # the empty packet at the end of the stream flushes the decoder
          except av.error.FFmpegError as e:
            self.error = f"{self.path}: decoding stopped early: {e}"
            return
        if pkt.size and pkt.is_keyframe:
          rep.keyframes.append(i)
        if logs and pkt.size:
          rep.errors.setdefault(i, []).extend(m.strip() for _, _, m in logs)
          if not decoded and pos == i:
            # the decoder gave nothing for a damaged packet, and it has kept up so far (no reordering delay): that picture is
            # lost; the previous one stands in, as a player would show it, and the frames after keep their indices
            decoded = [None]   # type: ignore[list-item]
            rep.lost.append(i)
        for frame in decoded:
          if frame is not None and (frame.width, frame.height) != (self.width, self.height):
            raise UserError(f"{self.path}: frame size changes mid-stream ({frame.width}x{frame.height} after {self.width}x{self.height})")
          last = frame if frame is not None else last
          if pos >= start:
            out = None if not ring else ring[n % len(ring)]
            if last is not None:
              buf = frame_to_venus(last, out)
            else:  # lost before any picture: black
              buf = np.zeros(self.info.size, dtype=np.uint8) if out is None else out
              venus_planes(buf, self.info)[0][...] = 16
              venus_planes(buf, self.info)[1][...] = 128
            rep.decoded = pos + 1
            yield buf
            n += 1
          pos += 1
        if not pkt.size:
          return

  def _keyframe_at_or_before(self, start: int) -> int:
    key = 0
    with av.open(str(self.path), format=self._fmt) as c:
      for i, p in enumerate(q for q in c.demux(video=0) if q.size):
        if i > start:
          break
        if p.is_keyframe:
          key = i
    return key

  def count(self) -> int:
    """Number of frames, by demuxing packets only (no decode)."""
    with av.open(str(self.path), format=self._fmt) as c:
      return sum(1 for p in c.demux(video=0) if p.size)


class VideoWriter:
  """Encoder for one camera file, written to a temp file and moved into place by close()."""

  def __init__(self, path: str | os.PathLike, width: int, height: int, fps: int = 20, bitrate: int | None = None, gop: int | None = None,
               preset: str = "ultrafast"):
    self.path = Path(path)
    fmt, codec = _container_format(self.path)
    self.width, self.height = width, height
    self.info = nv12_info(width, height)
    if gop is None:
      gop = 15 if codec == "libx264" else (30 if width > 1344 else 20)
    if bitrate is None:
      bitrate = 256_000 if codec == "libx264" else (10_000_000 if width > 1344 else 5_000_000)
    self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
    self._c = av.open(str(self._tmp), "w", format=fmt)
    self._s: Any = cast(Any, self._c.add_stream(codec, rate=fps))
    self._s.width, self._s.height, self._s.pix_fmt = width, height, "yuv420p"
    self._s.bit_rate = bitrate
    cc = self._s.codec_context
    cc.gop_size = gop
    cc.max_b_frames = 0
    if codec == "libx265":
      cc.options = {"preset": preset, "x265-params": f"keyint={gop}:min-keyint={gop}:bframes=0:scenecut=0:log-level=error:pools=1:frame-threads=1"}
    else:
      cc.options = {"preset": preset, "bf": "0", "g": str(gop), "threads": "1"}
    self._n = 0
    self._closed = False

  def write(self, buf: np.ndarray) -> None:
    """Encode one frame given as a VENUS NV12 buffer of this writer's size."""
    y, uv = venus_planes(np.asarray(buf, dtype=np.uint8), self.info)
    frame = av.VideoFrame(self.width, self.height, "yuv420p")
    u3 = uv.reshape(self.height // 2, self.width // 2, 2)
    for i, src in enumerate((y, u3[..., 0], u3[..., 1])):
      p = frame.planes[i]
      dst = np.frombuffer(memoryview(p), dtype=np.uint8).reshape(-1, p.line_size)
      dst[:src.shape[0], :src.shape[1]] = src
    frame.pts = self._n
    self._n += 1
    for pkt in self._s.encode(frame):
      self._c.mux(pkt)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    for pkt in self._s.encode(None):
      self._c.mux(pkt)
    self._c.close()
    os.replace(self._tmp, self.path)

  def abort(self) -> None:
    if not self._closed:
      self._closed = True
      try:
        self._c.close()
      finally:
        self._tmp.unlink(missing_ok=True)

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, tb):
    if exc_type is None:
      self.close()
    else:
      self.abort()


def scale_venus(buf: np.ndarray, src_w: int, src_h: int, dst_w: int, dst_h: int) -> np.ndarray:
  """Resize a VENUS frame (for qcamera.ts) with swscale; returns a VENUS buffer of the new size."""
  frame = av.VideoFrame.from_ndarray(venus_to_tight(buf, src_w, src_h).reshape(src_h * 3 // 2, src_w), format="nv12")
  return frame_to_venus(frame.reformat(width=dst_w, height=dst_h, format="yuv420p", interpolation="AREA"))
