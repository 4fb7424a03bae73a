"""Files written so that readers see the old one or the whole new one, never a half (and a failure leaves nothing behind)."""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike, suffix: str = ".tmp", mode: int = 0o644) -> Iterator[Path]:
  """A temp path beside `path` (same folder, so the rename is atomic) for the block to write; renamed over `path` when the
  block ends, removed if it fails. The name starts with '.' + path's name, so leftovers of a killed writer can be found."""
  path = Path(path)
  fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
  os.close(fd)
  tmp = Path(name)
  try:
    yield tmp
    os.chmod(tmp, mode)
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o644) -> None:
  """`data` into `path` atomically, flushed to disk before the rename."""
  with replacing(path, mode=mode) as tmp, open(tmp, "wb") as f:
    f.write(data.encode() if isinstance(data, str) else data)
    f.flush()
    os.fsync(f.fileno())
