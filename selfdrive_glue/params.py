"""openpilot's Params store, read/write of raw bytes: one file per key under <root>/d/.

Root: $PARAMS_ROOT if set (openpilot's own override; its value is the folder that holds d/ ... or d/ itself, both
accepted), else /data/params on a device, else ~/.comma<OPENPILOT_PREFIX>/params. Values are opaque bytes (CarParams is
a raw car.CarParams message, not an Event)."""
from __future__ import annotations

import os
import re
from pathlib import Path

from selfdrive_glue.files import write_atomic

_KEY = re.compile(r"^[A-Za-z0-9_]+$")


def default_params_dir() -> Path:
  root = os.environ.get("PARAMS_ROOT")
  if root:
    p = Path(root)
    return p if p.name == "d" else p / "d"
  if Path("/data/params/d").is_dir():
    return Path("/data/params/d")
  return Path.home() / f".comma{os.environ.get('OPENPILOT_PREFIX', '')}" / "params" / "d"


class Params:
  def __init__(self, path: str | os.PathLike | None = None):
    self.dir = Path(path) if path is not None else default_params_dir()

  def _file(self, key: str) -> Path:
    if not _KEY.match(key or ""):
      from selfdrive_glue.errors import UserError
      raise UserError(f"bad params key {key!r}: use letters, digits and '_' only")
    return self.dir / key

  def get(self, key: str) -> bytes | None:
    try:
      return self._file(key).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
      return None

  def get_bool(self, key: str) -> bool:
    return self.get(key) == b"1"

  def put(self, key: str, value: bytes | str) -> None:
    """Atomic: readers see the old value or the new one, never a partial file."""
    data = value.encode() if isinstance(value, str) else bytes(value)
    dest = self._file(key)
    self.dir.mkdir(parents=True, exist_ok=True)
    write_atomic(dest, data)

  def put_bool(self, key: str, value: bool) -> None:
    self.put(key, b"1" if value else b"0")

  def remove(self, key: str) -> None:
    self._file(key).unlink(missing_ok=True)
