"""Tables we record and ship beside the code that reads them, pinned by a sha256 kept in that code's source: a table edited
by hand (or cut short) is refused rather than used, and an artifact cache keyed by the compile's sources retires what was
compiled with the old table. Used by the CPU/CUDA kernel searches (compile/cpu/search.py) and the QCOM register tiles
(compile/tuning/qcom_tiles.py), whose table also carries the IR3 binaries calibrate-a630 runs on a device."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from selfdrive_glue.errors import UserError
from selfdrive_glue.files import write_atomic

VAR = "TABLE_SHA256"


def read(path: Path, shipped: Path, pin: str | None, src: Path, fix: str) -> bytes | None:
  """A table's bytes, None where there is no file; checked against the pin where it is the shipped table (a candidate
  table named by its reader's environment variable is not)."""
  if not path.is_file():
    return None
  data = path.read_bytes()
  if path == shipped:
    check(path, data, pin, src, fix)
  return data


def store(table_path: Path, data: bytes, shipped: Path, pin: str | None, src: Path) -> str | None:
  """Write a table; the shipped one with its sha256 pinned in src. Returns the pin in force afterwards."""
  if table_path == shipped:
    return write(table_path, data, src)
  write_atomic(table_path, data)
  return pin


def check(path: Path, data: bytes, pinned: str | None, src: Path, fix: str) -> None:
  """Raise a one-line UserError unless data hashes to the sha256 pinned in src."""
  if hashlib.sha256(data).hexdigest() != pinned:
    raise UserError(f"{path.name} does not match the sha256 recorded in {src.parent.name}/{src.name}; {fix}")


def write(table_path: Path, data: bytes, src: Path) -> str:
  """Write the table and pin its sha256 in src (the `TABLE_SHA256: str | None = "..."` line); returns the sha256."""
  sha = hashlib.sha256(data).hexdigest()
  text, n = re.subn(rf'^{VAR}: str \| None = .*$', f'{VAR}: str | None = "{sha}"', src.read_text(), count=1, flags=re.M)
  if n != 1:
    raise RuntimeError(f"{VAR} line not found in {src}")
  write_atomic(table_path, data)
  write_atomic(src, text)
  return sha
