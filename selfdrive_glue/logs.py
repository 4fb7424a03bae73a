"""openpilot logs (rlog / qlog): concatenated serialized Events, compressed as one stream (zstd, bz2) or not at all.

Each Event is an unpacked capnp message with its own segment table, so the stream can be split into per-event byte
strings exactly (`raw_events`) without parsing; `LogReader` then parses each one. A damaged file (truncated download,
garbage after some point) yields its readable prefix and sets `LogReader.damage` to a one-line description, like
openpilot's LogReader stopping at "Corrupted events". An unreadable whole file (unknown compression, not a log at all)
raises UserError.
"""
from __future__ import annotations

import bz2
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import zstandard

from selfdrive_glue.errors import UserError
from selfdrive_glue.services import SERVICE_LIST

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BZ2_MAGIC = b"BZh"
# magic numbers of compressions openpilot never used, to name them in the error
_OTHER_MAGIC = {b"\x1f\x8b": "gzip", b"\xfd7zXZ\x00": "xz", b"\x04\x22\x4d\x18": "lz4", b"PK\x03\x04": "zip"}
MAX_SEGMENTS = 512  # an Event has a handful of segments; far more means we are not looking at a segment table
LOG_SUFFIXES = (".zst", ".bz2")


def compression_of(path: Path, head: bytes) -> str:
  """'zstd', 'bz2' or 'none', from the magic number (the extension is only a hint, as files get renamed)."""
  if head.startswith(ZSTD_MAGIC):
    return "zstd"
  if head.startswith(BZ2_MAGIC):
    return "bz2"
  for magic, name in _OTHER_MAGIC.items():
    if head.startswith(magic):
      raise UserError(f"{path}: {name} compression is not an openpilot log format; decompress it or recompress with zstd (.zst)")
  if path.suffix in (".zst", ".bz2"):
    raise UserError(f"{path}: named {path.suffix} but is not {'zstd' if path.suffix == '.zst' else 'bz2'} data; the file is damaged or mislabelled")
  return "none"


CHUNK = 64 << 10  # compressed bytes fed at a time
FINE_CHUNK = 256  # ... and again, from the frame's start, after damage: a failing call loses all it decoded


def _one_frame(mv: memoryview, pos: int, d, chunk: int, errors: tuple[type[Exception], ...]) -> tuple[list[bytes], int, Exception | None]:
  """Feed the frame starting at `pos` to the fresh decompressor `d` until its end -> (output, where its data ends, error).
  On an error the position is where the failing piece starts."""
  out: list[bytes] = []
  while not d.eof and pos < len(mv):
    piece = mv[pos:pos + chunk]
    try:
      out.append(d.decompress(piece))
    except errors as e:
      return out, pos, e
    pos += len(piece)
  return out, pos - len(d.unused_data) if d.eof else pos, None  # read past the frame's end: the rest is the next frame


def _decompress_frames(data: bytes, new_decompressor, errors: tuple[type[Exception], ...], magic: bytes, name: str) -> tuple[bytes, str | None]:
  """Concatenated compressed frames (what appending writers produce) -> (bytes, damage or None).

  Fed in chunks, so damage keeps what decompresses before it: a decompressor that fails throws away all it decoded in
  that call, and handed the whole file it would lose the readable part along with the damaged block."""
  out: list[bytes] = []
  pos = 0
  mv = memoryview(data)
  while pos < len(data):
    d = new_decompressor()
    got, end, err = _one_frame(mv, pos, d, CHUNK, errors)
    if err is not None:
      d = new_decompressor()
      got, end, err = _one_frame(mv, pos, d, FINE_CHUNK, errors)
      if err is not None:
        out += got
        return b"".join(out), (f"{name} stream corrupt ({err}; found at compressed byte {end} of {len(data)}) after {sum(map(len, out))} "
                               "good decompressed bytes")
    out += got
    if not d.eof:
      return b"".join(out), f"{name} stream truncated after {sum(map(len, out))} decompressed bytes"
    pos = end
    if pos < len(data) and not data.startswith(magic, pos):
      return b"".join(out), f"{len(data) - pos} bytes of non-{name} data after the stream"
  return b"".join(out), None


def decompress(path: Path, data: bytes) -> tuple[bytes, str | None]:
  """-> (decompressed bytes, damage description or None)."""
  kind = compression_of(path, data[:8])
  if kind == "zstd":
    return _decompress_frames(data, lambda: zstandard.ZstdDecompressor().decompressobj(), (zstandard.ZstdError,), ZSTD_MAGIC, "zstd")
  if kind == "bz2":
    return _decompress_frames(data, bz2.BZ2Decompressor, (OSError, ValueError), BZ2_MAGIC, "bz2")
  return data, None


def split_events(data: bytes | memoryview) -> tuple[list[memoryview], str | None]:
  """Split concatenated capnp messages at their segment tables -> (messages, damage or None)."""
  mv = memoryview(data)
  out: list[memoryview] = []
  pos, n = 0, len(mv)
  while pos < n:
    if n - pos < 8:
      return out, f"{n - pos} trailing bytes after event {len(out)} (truncated event)"
    nseg = struct.unpack_from("<I", mv, pos)[0] + 1
    if nseg > MAX_SEGMENTS:
      return out, f"garbage at byte {pos} after event {len(out)} (segment count {nseg})"
    head = (4 * (nseg + 1) + 7) // 8 * 8
    if n - pos < head:
      return out, f"event {len(out)} truncated in its segment table"
    words = sum(struct.unpack_from(f"<{nseg}I", mv, pos + 4))
    total = head + 8 * words
    if words == 0:
      return out, f"garbage at byte {pos} after event {len(out)} (empty message)"
    if n - pos < total:
      return out, f"event {len(out)} truncated ({n - pos} of {total} bytes present)"
    out.append(mv[pos:pos + total])
    pos += total
  return out, None


class LogReader:
  """Events of one rlog/qlog file, in file order.

  Iterating yields Event readers; members this schema does not know (newer openpilot) are skipped and counted in
  `unknown`, as openpilot's only_union_types does. After iteration, `damage` says why the file ended early (or None).
  """

  def __init__(self, path: str | os.PathLike):
    self.path = Path(path)
    if not self.path.is_file():
      raise UserError(f"log {self.path} not found; pass an rlog/qlog file (.zst, .bz2 or uncompressed) or a segment directory")
    raw = self.path.read_bytes()
    if not raw:
      raise UserError(f"{self.path}: empty file; the log was not written or the download failed")
    data, damage = decompress(self.path, raw)
    self._events, split_damage = split_events(data)
    self.damage: str | None = damage or split_damage
    if not self._events and self.damage:
      raise UserError(f"{self.path}: no readable events ({self.damage}); the file is not an openpilot log or is damaged from the start")
    self._stream_damage = damage
    if damage is not None:
      # how much of a damaged file is still there: the events split cleanly before the damage (parsing may stop earlier)
      kept = sum(len(mv) for mv in self._events)
      self.damage = f"{damage}; recovered {len(self._events)} events ({kept} bytes) before it, the rest of the file is lost"
    self.unknown = 0

  def _corrupt_event(self, i: int, e: Exception) -> str:
    also = f"; the {self._stream_damage}" if self._stream_damage else ""
    return f"event {i} of {len(self._events)} is corrupt ({str(e).splitlines()[0][:120]}); stopped there, {i} events read{also}"

  def raw_events(self) -> Iterator[bytes]:
    """Each Event's exact bytes, without parsing."""
    for mv in self._events:
      yield bytes(mv)

  def __len__(self) -> int:
    return len(self._events)

  def __iter__(self):
    for ev, _ in self.events_with_bytes():
      yield ev

  def events_with_bytes(self) -> Iterator[tuple[Any, bytes]]:
    """(Event reader, its exact bytes) pairs in file order; stops at the first corrupt event and records it in `damage`."""
    import capnp

    from selfdrive_glue.capnp_check import check_pointers
    from selfdrive_glue.messaging import BadMessage, log_from_bytes, member_of
    self.unknown = 0
    for i, mv in enumerate(self._events):
      b = bytes(mv)
      try:
        ev = log_from_bytes(b)
        check_pointers(b)  # every pointer in bounds: corrupt data fails here rather than in the caller (not total_size: it aborts)
      except (BadMessage, capnp.KjException, ValueError) as e:
        self.damage = self._corrupt_event(i, e)
        return
      try:
        ev.which()
      except (capnp.KjException, ValueError):
        self.unknown += 1  # a union member newer than our schema
        continue
      try:
        member_of(ev)
      except (capnp.KjException, ValueError) as e:   # a member pointer of the wrong kind
        self.damage = self._corrupt_event(i, e)
        return
      yield ev, b


def _encoded(event) -> bytes:
  return bytes(event) if isinstance(event, (bytes, bytearray, memoryview)) else event.to_bytes()


class LogWriter:
  """Appends Events to a log; compression from the suffix (.zst -> zstd, .bz2 -> bz2, else none).

  The file appears only on close() (temp file + os.replace), so a crash never leaves a half-written log behind.
  """

  def __init__(self, path: str | os.PathLike, compression: str | None = None, level: int = 10):
    self.path = Path(path)
    if compression is None:
      compression = {".zst": "zstd", ".bz2": "bz2"}.get(self.path.suffix, "none")
    if compression not in ("zstd", "bz2", "none"):
      raise UserError(f"unknown log compression '{compression}'; use zstd, bz2 or none")
    self.compression = compression
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
    self._f = open(self._tmp, "wb")
    self._z: Any
    if compression == "zstd":
      self._z = zstandard.ZstdCompressor(level=level).compressobj()
    elif compression == "bz2":
      self._z = bz2.BZ2Compressor(9)
    else:
      self._z = None
    self.count = 0

  def write(self, event) -> None:
    """event: serialized Event bytes or an Event builder."""
    b = _encoded(event)
    self._f.write(self._z.compress(b) if self._z is not None else b)
    self.count += 1

  def write_all(self, events: Iterable) -> None:
    for e in events:
      self.write(e)

  def close(self) -> None:
    if self._f.closed:
      return
    try:
      if self._z is not None:
        self._f.write(self._z.flush())
      self._f.flush()
      os.fsync(self._f.fileno())
      self._f.close()
    except OSError:
      self.abort()   # a full disk usually shows only here, at the last flush: no half-written temp file is left behind
      raise
    os.replace(self._tmp, self.path)

  def abort(self) -> None:
    if not self._f.closed:
      try:
        self._f.close()
      except OSError:
        pass   # closing flushes, and on a full disk that fails too; the temp file must go all the same
    self._tmp.unlink(missing_ok=True)

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, tb):
    if exc_type is None:
      self.close()
    else:
      self.abort()


def qlog_filter(events: Iterable[tuple[str, bytes]]) -> Iterator[bytes]:
  """(service, bytes) pairs of an rlog -> the qlog's events: per service, every decimation-th message from the first.

  Services without a qlog decimation (modelV2, ...) or not in the service table are left out."""
  counters: dict[str, int] = {}
  for service, b in events:
    svc = SERVICE_LIST.get(service)
    if svc is None or svc.decimation is None:
      continue
    n = counters.get(service, 0)
    counters[service] = n + 1
    if n % svc.decimation == 0:
      yield b


def write_qlog(rlog: str | os.PathLike, qlog: str | os.PathLike) -> int:
  """Derive a qlog file from an rlog file; returns the number of events kept."""
  reader = LogReader(rlog)
  with LogWriter(qlog) as w:
    w.write_all(qlog_filter((ev.which(), b) for ev, b in reader.events_with_bytes()))
    return w.count
