"""Replay's inputs when they are damaged or inconsistent (issue 24): each must be reported or refused, never replayed
silently into wrong outputs. No model is needed here: what is checked happens before or beside the model step."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest

from offcar.frame_map import plan_segment
from offcar.replay import output_paths
from selfdrive_glue import messaging
from selfdrive_glue.errors import UserError
from selfdrive_glue.logs import LogReader, LogWriter
from selfdrive_glue.road_render import RoadScene
from selfdrive_glue.route import Segment, open_segment
from selfdrive_glue.synth import synth_segment
from selfdrive_glue.video import VideoReader, VideoWriter

ROOT = Path(__file__).resolve().parents[1]
GOP = 10


@pytest.fixture(scope="module")
def seg(tmp_path_factory) -> Path:
  d = tmp_path_factory.mktemp("bad_input") / "00000001--abcdef0123--0"
  synth_segment(d, 1.0, 31, "1344x760", progress=False)
  return d


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> tuple[Path, list[np.ndarray], list[tuple[int, int]]]:
  """25 rendered frames encoded with a keyframe every 10; -> (file, its clean decode, (byte offset, size) per packet)."""
  d = tmp_path_factory.mktemp("bad_clip")
  s = RoadScene(9, "1344x760")
  with VideoWriter(d / "fcamera.hevc", s.width, s.height, gop=GOP) as w:
    for i in range(25):
      w.write(s.render(i * 0.05))
  clean = [f.copy() for f in VideoReader(d / "fcamera.hevc").frames()]
  with av.open(str(d / "fcamera.hevc"), format="hevc") as c:
    packets = [(p.pos, p.size) for p in c.demux(video=0) if p.size]
  return d / "fcamera.hevc", clean, packets


def _copy(src: Path, dst: Path) -> Path:
  shutil.copytree(src, dst)
  return dst


def _rewrite_index(seg: Path, dst: Path, edit) -> Path:
  """A copy of `seg` whose encode-index entries went through edit(entry builder); every other event byte for byte."""
  _copy(seg, dst)
  with LogWriter(dst / "rlog.zst") as w:
    for ev, b in LogReader(seg / "rlog.zst").events_with_bytes():
      if ev.which() in ("roadEncodeIdx", "wideRoadEncodeIdx"):
        e = ev.as_builder()
        edit(getattr(e, ev.which()))
        b = e.to_bytes()
      w.write(b)
  return dst


def _spoil_slice_header(data: bytes, pos: int) -> bytes:
  """0xff over the slice header of the packet at `pos` (after its start code and NAL header): the decoder cannot use
  the slice; 0xff never forms a start code, so the packets around it stay as they are."""
  b = bytearray(data)
  b[pos + 6:pos + 14] = b"\xff" * 8
  return bytes(b)


# ---- 6: a damaged camera file ----

def test_decoder_errors_are_reported_with_their_frames(clip, tmp_path):
  """Scattered byte errors: the decoder conceals them without failing; every frame it reports is one that came out
  different, and the report names the frames up to the next keyframe as spoiled."""
  path, clean, _ = clip
  data = bytearray(path.read_bytes())
  rng = np.random.default_rng(3)
  for p in rng.integers(len(data) // 3, len(data), 120):
    data[p] = int(rng.integers(0, 256))
  bad = tmp_path / "fcamera.hevc"
  bad.write_bytes(bytes(data))
  r = VideoReader(bad)
  frames = [f.copy() for f in r.frames()]
  assert len(frames) == len(clean) and r.error is None
  reported = sorted(r.report.errors)
  assert reported, "the decoder's messages were dropped"
  differ = {i for i, (a, b) in enumerate(zip(frames, clean)) if not np.array_equal(a, b)}
  assert set(reported) <= differ
  line = r.report.describe({i: 100 + i for i in range(len(clean))})
  assert line is not None and f"errors in {len(reported)} of {len(clean)} frames" in line
  assert f"video frames {reported[0]}" in line and f"camera frames {100 + reported[0]}" in line
  first = reported[0]
  assert f"{first}-{(first // GOP + 1) * GOP - 1}" in line  # spoiled up to the frame before the next keyframe
  # a clean file says nothing
  r = VideoReader(path)
  assert sum(1 for _ in r.frames()) == len(clean) and not r.report and r.report.describe() is None


def test_a_frame_the_decoder_drops_keeps_the_later_frames_in_place(clip, tmp_path):
  """A slice the decoder cannot use gives no picture (and the frames predicted from it none either). Frame k must stay
  the k-th picture of the file, or every later state is paired with another picture: the frame before stands in."""
  path, clean, packets = clip
  bad = tmp_path / "fcamera.hevc"
  bad.write_bytes(_spoil_slice_header(path.read_bytes(), packets[3][0]))
  r = VideoReader(bad)
  frames = [f.copy() for f in r.frames()]
  assert r.count() == len(frames) == len(clean)
  assert r.report.lost == list(range(3, GOP))  # up to the next keyframe, every frame referenced a lost one
  assert all(np.array_equal(frames[i], clean[2]) for i in range(3, GOP))
  assert all(np.array_equal(a, b) for a, b in zip(frames[GOP:], clean[GOP:]))
  assert "could not decode at all" in r.report.describe()
  # from an index (replay's warm-up reads a tail): the same frames
  tail = [f.copy() for f in r.frames(start=5)]
  assert len(tail) == len(clean) - 5 and all(np.array_equal(a, b) for a, b in zip(tail, frames[5:]))


# ---- 13: damage inside one compressed stream ----

def _events(n: int) -> list[bytes]:
  rng = np.random.default_rng(0)
  out = []
  for i in range(n):
    e = messaging.new_message("logMessage", valid=True)
    e.logMessage = rng.integers(0, 2**63, 12).tobytes().hex()  # not too compressible: bz2 blocks of 900 kB hold few events
    e.logMonoTime = i
    out.append(e.to_bytes())
  return out


@pytest.mark.parametrize("suffix,decompressor", [(".bz2", "bz2"), (".zst", "zstd")])
def test_damage_inside_a_compressed_stream_keeps_the_readable_prefix(tmp_path, suffix, decompressor):
  import bz2

  import zstandard
  events = _events(8000)  # ~1.9 MB
  log = tmp_path / f"rlog{suffix}"
  with LogWriter(log) as w:
    w.write_all(events)
  data = log.read_bytes()
  whole = (lambda b: bz2.BZ2Decompressor().decompress(b)) if decompressor == "bz2" else \
          (lambda b: zstandard.ZstdDecompressor().decompressobj().decompress(b))
  # 16 zero bytes past the middle, where decompressing the whole file at once fails (not every spot is detected: zstd
  # without a checksum decodes some damage into wrong bytes silently)
  for frac in np.linspace(0.55, 0.95, 41):
    at = int(len(data) * frac)
    damaged = data[:at] + bytes(16) + data[at + 16:]
    try:
      whole(damaged)
    except (OSError, ValueError, zstandard.ZstdError):
      break
  else:
    pytest.fail("no detectable damage spot")
  bad = tmp_path / f"bad{suffix}"
  bad.write_bytes(damaged)
  r = LogReader(bad)  # before: "no readable events"
  got = list(r.raw_events())
  assert len(got) >= 1000 and got == events[:len(got)]
  assert len(list(r)) == len(got)
  assert r.damage is not None and f"{decompressor} stream corrupt" in r.damage
  assert f"recovered {len(got)} events ({sum(map(len, got))} bytes)" in r.damage and "the rest of the file is lost" in r.damage


# ---- 12: inconsistent inputs ----

def test_encode_index_shifted_against_the_camera_states_is_refused(seg, tmp_path):
  """Every entry's frameId +2, timestamps left as they were (100 ms off the states'): counts and order still fit, so
  only the timestamps show that each state would get the picture taken two frames earlier."""
  def shift(ei):
    ei.frameId += 2
  plan_segment(open_segment(seg))
  shifted = _rewrite_index(seg, tmp_path / "shifted", shift)
  with pytest.raises(UserError, match=r"roadEncodeIdx puts camera frame \d+ .*-100\.0 ms.*frameIds are shifted by \+2"):
    plan_segment(open_segment(shifted))


def test_encode_index_without_timestamps_is_still_used(seg, tmp_path):
  """Older logs carry no start-of-frame time in the index: nothing to check against, and nothing refused."""
  def no_times(ei):
    ei.timestampSof = 0
  plan = plan_segment(open_segment(_rewrite_index(seg, tmp_path / "old", no_times)))
  assert plan.road.by_index and plan.road.frame_of == plan_segment(open_segment(seg)).road.frame_of


def test_qlog_named_rlog_is_refused(seg, tmp_path):
  """A qlog (one camera state in 20) renamed rlog.bz2 replayed 1 step and no output, exit 0."""
  q = _copy(seg, tmp_path / "q")
  (q / "rlog.zst").unlink()
  with LogWriter(q / "rlog.bz2") as w:
    w.write_all(LogReader(seg / "qlog.zst").raw_events())
  (q / "qlog.zst").unlink()
  with pytest.raises(UserError, match="roadCameraState messages are 1 for 17 encoded frames .*looks like a qlog"):
    plan_segment(open_segment(q))
  # 2 s: two states (frames 0 and 20) that replayed one step after a gap, so no output, and exit 0
  two = synth_segment(tmp_path / "two", 2.0, 1, "1344x760", progress=False, qcamera=False).path
  (two / "rlog.zst").unlink()
  with LogWriter(two / "rlog.bz2") as w:
    w.write_all(LogReader(two / "qlog.zst").raw_events())
  with pytest.raises(UserError, match=r"one every 20 camera frames \(frames 0, 20\).*looks like a qlog"):
    plan_segment(open_segment(two))
  r = subprocess.run([sys.executable, "-m", "cli.main", "replay", "--quiet", str(q), "--artifact", str(tmp_path / "unused"),
                      "-o", str(tmp_path / "out.zst")], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert r.returncode == 2 and "looks like a qlog" in r.stderr and "Traceback" not in r.stderr, r.stderr
  assert not (tmp_path / "out.zst").exists()


# ---- 10: messages that must say what is wrong ----

def test_qlog_and_qcamera_segment_says_why_with_or_without_artifact(seg, tmp_path):
  """What a user downloads first (qlog + qcamera): the real reason, whether or not --artifact is given."""
  q = tmp_path / "qonly"
  q.mkdir()
  shutil.copy(seg / "qlog.zst", q / "qlog.zst")
  shutil.copy(seg / "qcamera.ts", q / "qcamera.ts")
  for extra in ([], ["--artifact", str(tmp_path / "unused")]):
    r = subprocess.run([sys.executable, "-m", "cli.main", "replay", "--quiet", str(q), "-o", str(tmp_path / "out.zst"), *extra],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2, (extra, r.stderr)
    assert "has no rlog (it has qlog.zst only)" in r.stderr and "a qlog decimates away" in r.stderr, (extra, r.stderr)
    assert "fcamera.hevc" not in r.stderr.split("download")[0], (extra, r.stderr)  # not "missing fcamera.hevc"


def test_output_file_for_one_segment_is_not_about_several(tmp_path):
  one = [Segment(tmp_path / "r--0")]
  (tmp_path / "notes.txt").write_text("x")
  with pytest.raises(UserError) as e:
    output_paths(one, tmp_path / "notes.txt")
  assert "several" not in str(e.value) and "not named like a log" in str(e.value) and ".zst" in str(e.value)
  with pytest.raises(UserError, match="several segments"):
    output_paths(one + [Segment(tmp_path / "r--1")], tmp_path / "notes.txt")


@pytest.mark.slow
def test_replay_without_artifact_speaks_as_replay(tmp_path):
  """No --artifact: the reference models come from the demo's cache (compiled there the first time), but the lines say
  replay, not [demo]."""
  seg = tmp_path / "seg1"
  r = subprocess.run([sys.executable, "-m", "cli.main", "synth", "-o", str(seg), "--seconds", "2", "--seed", "1"],
                     capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert r.returncode == 0, r.stderr
  r = subprocess.run([sys.executable, "-m", "cli.main", "replay", "--quiet", str(seg), "-o", str(tmp_path / "out.zst")],
                     capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert r.returncode == 0, r.stderr
  assert "[replay] " in r.stderr and "[demo]" not in r.stderr, r.stderr
