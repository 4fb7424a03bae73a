"""What a release bundle was built from, recorded in bundle.json so a bundle found on a device can be traced back.

Per artifact (from its metadata.json, which the compile step writes and the manifest hashes): the model files and their
sha256, tinygrad/tinymesa versions, the capture flags, target, camera, precision and the checks that passed. Per build:
this package's version and git commit, Python, the host, and the tinygrad environment settings that change the compiled
code but are not capture flags (BEAM searches schedules, so a BEAM=2 bundle differs from a plain one).
"""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

# tinygrad settings read from the environment at compile time that change the generated kernels
TINYGRAD_ENV = ("BEAM", "BEAM_UOPS_MAX", "NOOPT", "OPT", "IMAGE", "FLOAT16", "NOLOCALS", "JIT_BATCH_SIZE", "DEVECTORIZE", "CPU_LLVM")


def of_artifact(meta: dict[str, Any]) -> dict[str, Any]:
  cam = meta["camera"]
  return {
    "models": {k: {"file": m["file"], "sha256": m["sha256"]} for k, m in meta["models"].items()},
    "versions": meta["versions"], "flags": meta.get("flags", {}), "target": meta["target"], "capture_target": meta.get("capture_target"),
    "camera": f"{cam['width']}x{cam['height']}", "precision": (meta.get("precision") or {}).get("compute"),
    "checks_passed": [c for c, r, _ in meta.get("validation", {}).get("checks", []) if r == "ok"],
  }


def of_build() -> dict[str, Any]:
  try:
    version: str | None = importlib_metadata.version("modeld-msm")
  except importlib_metadata.PackageNotFoundError:
    version = None
  return {"modeld_msm": version, "git": _git_commit(Path(__file__).resolve().parents[1]), "python": platform.python_version(),
          "host": f"{platform.system()} {platform.machine()}", "tinygrad_env": {k: os.environ[k] for k in TINYGRAD_ENV if k in os.environ}}


def _git_commit(root: Path) -> str | None:
  """HEAD of the source checkout, "+dirty" when tracked files differ from it; None outside a git checkout."""
  if not (root / ".git").exists():
    return None
  try:
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           timeout=10).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return None
  return (head + ("+dirty" if dirty else "")) or None
