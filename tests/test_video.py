import os

import numpy as np
import pytest

from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import nv12_info
from selfdrive_glue.road_render import RoadScene
from selfdrive_glue.video import QCAMERA_SIZE, VideoReader, VideoWriter, frame_to_venus, scale_venus, tight_to_venus, venus_planes, venus_to_tight


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
  """10 rendered 1344x760 frames and their raw-HEVC encoding."""
  d = tmp_path_factory.mktemp("video")
  s = RoadScene(9, "1344x760")
  frames = [s.render(i * 0.05) for i in range(10)]
  with VideoWriter(d / "fcamera.hevc", s.width, s.height) as w:
    for f in frames:
      w.write(f)
  return s, frames, d / "fcamera.hevc"


def test_raw_hevc_annex_b_without_container(clip):
  _, _, path = clip
  head = path.read_bytes()[:6]
  assert head[:4] == b"\x00\x00\x00\x01"
  assert (head[4] >> 1) & 0x3F == 32  # the stream opens with a VPS NAL unit, no container around it


def test_decode_round_trip_native_size_venus_layout(clip):
  s, frames, path = clip
  r = VideoReader(path)
  assert (r.width, r.height) == (1344, 760) and r.count() == 10
  out = list(r.frames())
  assert len(out) == 10 and r.error is None
  info = nv12_info(1344, 760)
  for i, buf in enumerate(out):
    assert buf.dtype == np.uint8 and buf.size == info.size
    y_dec, uv_dec = venus_planes(buf, info)
    y_src, uv_src = venus_planes(frames[i], info)
    assert np.abs(y_dec.astype(int) - y_src).mean() < 2.0
    assert np.abs(uv_dec.astype(int) - uv_src).mean() < 2.0
    # each decoded frame is closest to its own source frame (order preserved, nothing dropped)
    errs = [np.abs(y_dec.astype(int) - venus_planes(f, info)[0]).mean() for f in frames]
    assert int(np.argmin(errs)) == i or errs[i] == min(errs)


def test_decode_into_a_ring_of_buffers(clip):
  _, _, path = clip
  ring = [np.zeros(nv12_info(1344, 760).size, np.uint8) for _ in range(2)]
  ids = [id(b) for b in VideoReader(path).frames(ring)]
  assert ids == [id(ring[i % 2]) for i in range(10)]


def test_tight_and_venus_convert_both_ways():
  rng = np.random.default_rng(0)
  w, h = 1928, 1208
  tight = rng.integers(0, 256, w * h * 3 // 2, dtype=np.uint8)
  venus = tight_to_venus(tight, w, h)
  info = nv12_info(w, h)
  assert venus.size == info.size
  assert np.array_equal(venus[info.uv_offset:info.uv_offset + w], tight[w * h:w * h + w])  # UV starts at uv_offset
  assert np.array_equal(venus_to_tight(venus, w, h), tight)


def test_qcamera_ts_h264_round_trip(tmp_path, clip):
  s, frames, _ = clip
  small = [scale_venus(f, s.width, s.height, *QCAMERA_SIZE) for f in frames[:5]]
  with VideoWriter(tmp_path / "qcamera.ts", *QCAMERA_SIZE) as w:
    for f in small:
      w.write(f)
  data = (tmp_path / "qcamera.ts").read_bytes()
  assert data[0] == 0x47 and data[188] == 0x47  # MPEG-TS packets
  r = VideoReader(tmp_path / "qcamera.ts")
  assert (r.width, r.height) == QCAMERA_SIZE
  dec = list(r.frames())
  assert len(dec) == 5
  info = nv12_info(*QCAMERA_SIZE)
  assert np.abs(venus_planes(dec[2], info)[0].astype(int) - venus_planes(small[2], info)[0]).mean() < 6


def test_frame_to_venus_handles_nv12_frames():
  import av
  rng = np.random.default_rng(1)
  tight = rng.integers(0, 256, 64 * 48 * 3 // 2, dtype=np.uint8)
  frame = av.VideoFrame.from_ndarray(tight.reshape(72, 64), format="nv12")
  assert np.array_equal(venus_to_tight(frame_to_venus(frame), 64, 48), tight)


def test_writer_is_atomic(tmp_path):
  target = tmp_path / "fcamera.hevc"
  with pytest.raises(RuntimeError):
    with VideoWriter(target, 1344, 760) as w:
      w.write(np.zeros(nv12_info(1344, 760).size, np.uint8))
      assert not target.exists()
      raise RuntimeError("boom")
  assert not target.exists() and os.listdir(tmp_path) == []


def test_bad_camera_files(tmp_path):
  with pytest.raises(UserError, match="not found"):
    VideoReader(tmp_path / "fcamera.hevc")
  (tmp_path / "movie.avi").write_bytes(b"x" * 100)
  with pytest.raises(UserError, match="unknown video file type"):
    VideoReader(tmp_path / "movie.avi")
  (tmp_path / "fcamera.hevc").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
  with pytest.raises(UserError, match="fcamera.hevc"):
    VideoReader(tmp_path / "fcamera.hevc")
  (tmp_path / "ecamera.hevc").write_bytes(b"")
  with pytest.raises(UserError, match="ecamera.hevc"):
    VideoReader(tmp_path / "ecamera.hevc")


def test_truncated_hevc_decodes_a_prefix(tmp_path, clip):
  _, _, path = clip
  data = path.read_bytes()
  cut = tmp_path / "fcamera.hevc"
  cut.write_bytes(data[:len(data) * 6 // 10])
  r = VideoReader(cut)
  n = len(list(r.frames()))
  assert 1 <= n < 10


@pytest.mark.parametrize("w,h,gop", [(128, 96, 20), (1400, 64, 30)])
def test_recorder_gop_and_no_b_frames(tmp_path, w, h, gop):
  import av
  rng = np.random.default_rng(0)
  with VideoWriter(tmp_path / "x.hevc", w, h) as vw:
    for _ in range(2 * gop + 2):
      vw.write(rng.integers(0, 256, nv12_info(w, h).size, dtype=np.uint8))
  with av.open(str(tmp_path / "x.hevc"), format="hevc") as c:
    keys = [i for i, p in enumerate(c.demux(video=0)) if p.size and p.is_keyframe]
  with av.open(str(tmp_path / "x.hevc"), format="hevc") as c:
    types = {int(getattr(f.pict_type, "value", f.pict_type)) for f in c.decode(video=0)}
  assert keys == [0, gop, 2 * gop]
  assert types == {1, 2}  # AV_PICTURE_TYPE_I and _P only: no B-frames (3), like the recorder


def test_frames_from_an_index_match_a_full_decode(tmp_path):
  """start=k decodes from the keyframe before k (replay's warm-up reads a video's tail): bit-identical to frames()[k:]."""
  s = RoadScene(5, "1344x760")
  with VideoWriter(tmp_path / "f.hevc", s.width, s.height, gop=4) as w:
    for i in range(11):
      w.write(s.render(i * 0.05))
  r = VideoReader(tmp_path / "f.hevc")
  full = [f.copy() for f in r.frames()]
  for k in (1, 4, 6, 10):
    tail = list(r.frames(start=k))
    assert len(tail) == 11 - k and r.error is None, k
    assert all(np.array_equal(a, b) for a, b in zip(tail, full[k:])), k
  assert list(r.frames(start=11)) == []
