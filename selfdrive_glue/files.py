"""Files written so that readers see the old one or the whole new one, never a half (and a failure leaves nothing behind)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from selfdrive_glue.errors import UserError


class Terminated(KeyboardInterrupt):
  """SIGTERM (systemd, `timeout`, `docker stop`), raised where the process is, as SIGINT raises KeyboardInterrupt."""


def _terminated(*_a) -> None:
  raise Terminated()


def stop_on_sigterm() -> None:
  """SIGTERM becomes an exception like SIGINT's, so every writer's cleanup (`except BaseException`: temp files and folders
  removed, a half-copied install rolled back) runs as it does for Ctrl-C; SIGTERM's default would kill the process where
  it stands and leave them behind. For the main thread of a command; a service installs its own handlers."""
  if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
    signal.signal(signal.SIGTERM, _terminated)


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


def check_replaceable(path: str | os.PathLike, markers: dict[str, str], what: str, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
  """Refuse, before any work, to replace `path` whole unless it is absent, an empty folder, or a folder of ours: one holding a
  marker file (name -> a key its JSON must have) that the tool wrote. A user's folder of models and notes is never ours to
  delete, and neither is a folder that holds one of the inputs."""
  path = Path(path)
  out = path.resolve()
  for src in inputs:
    s = Path(src).resolve()
    if s == out or out in s.parents:
      raise UserError(f"the input {src} lies inside the output folder {path}, which is replaced whole; write to another -o")
  if path.is_symlink():
    # replacing the folder whole would replace the link, not the folder it points to
    raise UserError(f"output path {path} is a symbolic link (to {os.readlink(path)}), not a folder; pass the folder itself as -o, or another path")
  if not path.exists():
    return
  if not path.is_dir():
    raise UserError(f"output path {path} exists and is not a folder; choose another -o")
  if not any(path.iterdir()):
    return
  for name, key in markers.items():
    try:
      doc = json.loads((path / name).read_text())
    except (OSError, ValueError, TypeError):
      continue
    if isinstance(doc, dict) and key in doc:
      _check_only_ours(path, name, doc, what)
      return
  raise UserError(f"output folder {path} is not empty and holds no {what} ({' or '.join(markers)}): it would be replaced whole; "
                  "choose an empty or new folder for -o")


def _check_only_ours(path: Path, marker: str, doc: dict, what: str) -> None:
  """A folder of ours is replaced whole only when it holds nothing else: the user's notes, data folders or release notes
  dropped into it are not ours to delete. What is ours: the marker, the names its table lists (an artifact manifest's
  files, a bundle index's cameras), a signature, and a bundle's smoke/ and dmonitoring/ folders."""
  listed = next((v for v in (doc.get("files"), doc.get("artifacts")) if isinstance(v, dict)), {})
  allowed = {marker, "manifest.sig", "smoke", "dmonitoring"} | set(listed)
  if extra := sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir() if p.name not in allowed):
    shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
    raise UserError(f"output folder {path} is one of ours ({what}) but also holds {shown}, which replacing it would delete; move them away or "
                    "choose another -o")


def refuse_overwrite(paths: list[Path], force: bool) -> None:
  """Refuse before any work to overwrite files a user may have put there (openpilot's own model names) unless --force."""
  if not force and (there := [str(p) for p in paths if p.exists() or p.is_symlink()]):
    raise UserError(f"{', '.join(there)} exist(s) already; pass --force to overwrite, or choose another -o")


def sha256_file(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()
