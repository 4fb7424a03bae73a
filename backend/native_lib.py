"""C helpers built with the system's clang (tinygrad's CPU device already needs it) and loaded with ctypes.

A library is built once per source text into the user's cache directory, named by the source's sha256, so an edited
source never loads a stale build and processes that build it at once write the same bytes (the rename is atomic).
Callers keep a Python path for when this raises: no clang, or a platform the source does not build on.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modeld-msm"


def build(name: str, source: str, flags: tuple[str, ...] = ("-O2",), cache: Path | None = None) -> ctypes.CDLL:
  """`source` (C) as a shared library, built on first use and loaded. Raises OSError or subprocess.CalledProcessError
  when it cannot be built or loaded here."""
  cache = cache or cache_dir()
  key = hashlib.sha256("\0".join((source, *flags)).encode()).hexdigest()[:16]
  lib = cache / f"{name}_{key}.so"
  if not lib.is_file():
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as td:
      tmp = Path(td) / f"{name}.so"
      subprocess.run([os.environ.get("CC", "clang"), "-x", "c", *flags, "-fPIC", "-shared", "-o", str(tmp), "-"], input=source.encode(),
                     check=True, capture_output=True)
      os.replace(tmp, lib)
  return ctypes.CDLL(str(lib))
