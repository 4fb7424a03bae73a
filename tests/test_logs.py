import bz2
import gzip
import os
import struct
from collections import Counter
from pathlib import Path

import capnp
import pytest
import zstandard

from selfdrive_glue import messaging
from selfdrive_glue.errors import UserError
from selfdrive_glue.logs import LogReader, LogWriter, decompress, qlog_filter, split_events, write_qlog
from selfdrive_glue.services import SERVICE_LIST

REF = Path(__file__).resolve().parents[2] / "shared" / "reference" / "cereal"


def _events(n_frames: int = 40) -> list[bytes]:
  """A small drive's worth of real Events: cameras at 20 Hz, carState at 100 Hz, calibration at 4 Hz, model outputs."""
  out = []
  for i in range(n_frames):
    t = 1_000_000_000 + i * 50_000_000
    m = messaging.new_message("roadCameraState", logMonoTime=t, valid=True)
    m.roadCameraState.frameId = i
    m.roadCameraState.timestampEof = t - 1000
    out.append(m.to_bytes())
    for k in range(5):
      c = messaging.new_message("carState", logMonoTime=t + k * 10_000_000, valid=True)
      c.carState.vEgo = 10.0 + 0.01 * (5 * i + k)
      out.append(c.to_bytes())
    if i % 5 == 0:
      c = messaging.new_message("liveCalibration", logMonoTime=t + 3, valid=True)
      c.liveCalibration.rpyCalib = [0.0, 0.01 * i, -0.002]
      out.append(c.to_bytes())
    mv = messaging.new_message("modelV2", logMonoTime=t + 7, valid=True)
    mv.modelV2.frameId = i
    mv.modelV2.position.x = [float(j) for j in range(33)]
    out.append(mv.to_bytes())
  return out


@pytest.mark.parametrize("name", ["rlog.zst", "rlog.bz2", "rlog"])
def test_round_trip_identical_bytes_per_event(tmp_path, name):
  evs = _events()
  with LogWriter(tmp_path / name) as w:
    w.write_all(evs)
  raw = (tmp_path / name).read_bytes()
  assert raw.startswith({"rlog.zst": b"\x28\xb5\x2f\xfd", "rlog.bz2": b"BZh", "rlog": evs[0][:8]}[name])
  r = LogReader(tmp_path / name)
  assert list(r.raw_events()) == evs
  parsed = list(r)
  assert [e.which() for e in parsed] == [messaging.log_from_bytes(b).which() for b in evs]
  assert parsed[1].carState.vEgo == pytest.approx(10.0)
  assert r.damage is None and r.unknown == 0


def test_builders_and_bytes_are_both_accepted(tmp_path):
  def make():
    m = messaging.new_message("liveDelay", logMonoTime=5, valid=True)
    m.liveDelay.lateralDelay = 0.3
    return m
  with LogWriter(tmp_path / "x.zst") as w:
    w.write(make())
    w.write(make().to_bytes())
  a, b = LogReader(tmp_path / "x.zst").raw_events()
  assert a == b == make().to_bytes()


@pytest.mark.skipif(not (REF / "log.capnp").exists(), reason="reference schema not present")
def test_openpilot_schema_reads_our_log(tmp_path):
  """Wire compatibility of the file: openpilot 0.11's own schema parses what LogWriter wrote, as its LogReader does."""
  evs = _events(10)
  with LogWriter(tmp_path / "rlog.zst") as w:
    w.write_all(evs)
  capnp.remove_import_hook()
  ref_log = capnp.load(str(REF / "log.capnp"))
  data = zstandard.ZstdDecompressor().stream_reader((tmp_path / "rlog.zst").read_bytes()).read()
  ref = list(ref_log.Event.read_multiple_bytes(data))
  assert [e.which() for e in ref] == [e.which() for e in LogReader(tmp_path / "rlog.zst")]
  cs = [e for e in ref if e.which() == "carState"]
  assert cs[3].carState.vEgo == pytest.approx(10.03)
  assert list(ref[-1].modelV2.position.x)[:3] == [0.0, 1.0, 2.0]


def test_truncated_log_gives_the_readable_prefix(tmp_path):
  evs = _events(800)  # several zstd blocks, so a cut leaves whole blocks before it
  with LogWriter(tmp_path / "rlog.zst") as w:
    w.write_all(evs)
  data = (tmp_path / "rlog.zst").read_bytes()
  cut = tmp_path / "cut" / "rlog.zst"
  cut.parent.mkdir()
  cut.write_bytes(data[:int(len(data) * 0.7)])
  r = LogReader(cut)
  got = list(r.raw_events())
  assert 0 < len(got) < len(evs)
  assert got == evs[:len(got)]
  assert len(list(r)) == len(got)
  assert r.damage and "truncated" in r.damage


def test_uncompressed_log_cut_mid_event(tmp_path):
  evs = _events(5)
  blob = b"".join(evs)
  (tmp_path / "rlog").write_bytes(blob[:len(blob) - 20])
  r = LogReader(tmp_path / "rlog")
  assert list(r.raw_events()) == evs[:-1]
  assert "truncated" in r.damage


def test_garbage_in_the_middle_stops_there(tmp_path):
  evs = _events(5)
  blob = b"".join(evs[:7]) + b"\xff" * 64 + b"".join(evs[7:])
  (tmp_path / "rlog").write_bytes(blob)
  r = LogReader(tmp_path / "rlog")
  assert list(r.raw_events()) == evs[:7]
  assert "garbage" in r.damage


def test_corrupt_event_body_is_reported(tmp_path):
  evs = _events(3)
  bad = bytearray(evs[2])
  # point the root struct far outside the message: the framing is fine, the content is not
  struct.pack_into("<q", bad, 8, (0x7FFF_FFF0 << 2) | (2 << 32) | (1 << 48))
  (tmp_path / "rlog").write_bytes(b"".join(evs[:2]) + bytes(bad) + b"".join(evs[3:]))
  r = LogReader(tmp_path / "rlog")
  assert len(list(r)) == 2
  assert "corrupt" in r.damage


def test_unknown_union_members_are_skipped_and_counted(tmp_path):
  evs = _events(2)
  newer = bytearray(evs[1])
  # an Event member newer than our schema: discriminant past the last one we know
  off = 8 + 8 + 8 * ((struct.unpack_from("<q", newer, 8)[0] >> 2) & 0x3FFFFFFF)
  struct.pack_into("<H", newer, off + 8, 200)
  (tmp_path / "rlog").write_bytes(evs[0] + bytes(newer) + b"".join(evs[2:]))
  r = LogReader(tmp_path / "rlog")
  assert len(list(r)) == len(evs) - 1
  assert r.unknown == 1 and r.damage is None


def test_unknown_compression_and_non_logs(tmp_path):
  evs = b"".join(_events(2))
  (tmp_path / "rlog.gz").write_bytes(gzip.compress(evs))
  with pytest.raises(UserError, match="gzip"):
    LogReader(tmp_path / "rlog.gz")
  (tmp_path / "rlog.zst").write_bytes(bz2.compress(evs))  # mislabelled: still readable by its magic
  assert len(list(LogReader(tmp_path / "rlog.zst"))) == len(_events(2))
  (tmp_path / "fake.zst").write_bytes(evs)
  with pytest.raises(UserError, match="not zstd"):
    LogReader(tmp_path / "fake.zst")
  (tmp_path / "empty").write_bytes(b"")
  with pytest.raises(UserError, match="empty"):
    LogReader(tmp_path / "empty")
  (tmp_path / "noise").write_bytes(os.urandom(4096))
  with pytest.raises(UserError, match="no readable events"):
    LogReader(tmp_path / "noise")
  with pytest.raises(UserError, match="not found"):
    LogReader(tmp_path / "missing.zst")
  with pytest.raises(UserError, match="compression"):
    LogWriter(tmp_path / "x", compression="lzma")


def test_qlog_decimation_follows_the_service_table(tmp_path):
  evs = _events(40)
  with LogWriter(tmp_path / "rlog.zst") as w:
    w.write_all(evs)
  kept = write_qlog(tmp_path / "rlog.zst", tmp_path / "qlog.zst")
  counts = Counter(e.which() for e in LogReader(tmp_path / "qlog.zst"))
  rcounts = Counter(e.which() for e in LogReader(tmp_path / "rlog.zst"))
  assert sum(counts.values()) == kept
  for svc, n in rcounts.items():
    dec = SERVICE_LIST[svc].decimation
    assert counts.get(svc, 0) == (0 if dec is None else -(-n // dec)), svc
  assert "modelV2" not in counts and counts["carState"] == 20 and counts["roadCameraState"] == 2
  # the first message of each service is the one kept
  first_cs = next(b for b in evs if messaging.log_from_bytes(b).which() == "carState")
  assert first_cs in list(qlog_filter([("carState", first_cs)]))


def test_writer_is_atomic(tmp_path):
  target = tmp_path / "rlog.zst"
  with pytest.raises(RuntimeError):
    with LogWriter(target) as w:
      w.write(_events(1)[0])
      assert not target.exists()
      raise RuntimeError("crash mid-write")
  assert not target.exists() and list(tmp_path.iterdir()) == []


def test_split_and_decompress_helpers():
  evs = _events(3)
  parts, dmg = split_events(b"".join(evs))
  assert [bytes(p) for p in parts] == evs and dmg is None
  two_frames = zstandard.ZstdCompressor().compress(evs[0]) + zstandard.ZstdCompressor().compress(b"".join(evs[1:]))
  data, dmg = decompress(Path("rlog.zst"), two_frames)  # several zstd frames, as concatenated files are
  assert data == b"".join(evs) and dmg is None
