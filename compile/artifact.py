"""The compiled artifact: a directory of pickled TinyJits + metadata.json + manifest.json (sha256 of every file).

A pickle is code, so nothing is unpickled until the manifest, the versions and the device have all been checked.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from compile.onnx_model import sha256_file
from modeld_msm.errors import UserError

FORMAT = 1
MANIFEST, METADATA = "manifest.json", "metadata.json"
POLICY_PKL, WARP_PKL = "driving_policy.pkl", "driving_warp.pkl"
REBUILD_HINT = "rebuild it with `modeld-msm compile` on this version (or `./dev demo`, which rebuilds its cache)"


class ArtifactError(UserError):
  pass


def installed_versions() -> dict[str, str | None]:
  out: dict[str, str | None] = {}
  for pkg in ("tinygrad", "tinymesa"):
    try:
      out[pkg] = importlib_metadata.version(pkg)
    except importlib_metadata.PackageNotFoundError:
      out[pkg] = None
  return out


def write_artifact(out_dir: Path, files: dict[str, bytes], meta: dict[str, Any]) -> Path:
  """Write files + metadata + manifest into a temp dir beside out_dir, then swap it in (never half-written)."""
  out_dir = Path(out_dir)
  parent = out_dir.resolve().parent
  try:
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
  except OSError as e:
    raise UserError(f"cannot write the artifact into {parent}: {e.strerror}; choose a writable output directory") from None
  try:
    all_files = dict(files)
    all_files[METADATA] = json.dumps(meta, indent=1, sort_keys=True).encode()
    for name, data in all_files.items():
      (tmp / name).write_bytes(data)
    manifest = {"format": FORMAT, "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(all_files.items())}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    swap_in_dir(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def swap_in_dir(tmp: Path, out_dir: Path) -> None:
  """Replace out_dir by the finished tmp dir (same parent): readers see the old tree or the new one, never a mix."""
  os.chmod(tmp, 0o755)
  old = None
  if out_dir.exists():
    old = out_dir.resolve().parent / f".{out_dir.name}.old-{os.getpid()}"
    os.replace(out_dir, old)
  os.replace(tmp, out_dir)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


@dataclass
class VerifiedArtifact:
  path: Path
  meta: dict[str, Any]
  digests: dict[str, str]

  @property
  def camera(self) -> tuple[int, int]:
    return int(self.meta["camera"]["width"]), int(self.meta["camera"]["height"])

  @property
  def device(self) -> str:
    return str(self.meta["device"])

  @property
  def target(self) -> str:
    return str(self.meta["target"])

  def output_slices(self, kind: str) -> dict[str, slice]:
    return {k: slice(a, b) for k, (a, b) in self.meta["models"][kind]["output_slices"].items()}


def verify_artifact(path: str | Path, device: str | None = None, camera: tuple[int, int] | None = None) -> VerifiedArtifact:
  """Check integrity, versions, device and camera. Reads JSON and hashes only; never unpickles."""
  path = Path(path)
  if not path.is_dir():
    raise ArtifactError(f"artifact {path} does not exist or is not a directory; {REBUILD_HINT}")
  try:
    manifest = json.loads((path / MANIFEST).read_text())
    listed = manifest["files"]
    assert isinstance(listed, dict) and manifest.get("format") == FORMAT
  except FileNotFoundError:
    raise ArtifactError(f"artifact {path} has no {MANIFEST}; {REBUILD_HINT}") from None
  except Exception:
    raise ArtifactError(f"artifact {path}: {MANIFEST} is corrupt or of another format; {REBUILD_HINT}") from None
  present = {p.name for p in path.iterdir() if p.name != MANIFEST}
  if extra := present - set(listed):
    raise ArtifactError(f"artifact {path} has files not in its manifest: {', '.join(sorted(extra))}; {REBUILD_HINT}")
  for name, digest in listed.items():
    f = path / name
    if not f.is_file():
      raise ArtifactError(f"artifact {path} is missing {name}; {REBUILD_HINT}")
    if sha256_file(f) != digest:
      raise ArtifactError(f"artifact {path}: {name} does not match its manifest checksum (modified or corrupt); {REBUILD_HINT}")
  try:
    meta = json.loads((path / METADATA).read_text())
  except Exception:
    raise ArtifactError(f"artifact {path}: {METADATA} is unreadable; {REBUILD_HINT}") from None
  for pkg, have in installed_versions().items():
    want = meta.get("versions", {}).get(pkg)
    if want != have:
      raise ArtifactError(f"artifact {path} was built with {pkg} {want}, this install has {have}; {REBUILD_HINT}")
  if device is not None and meta.get("device") != device:
    raise ArtifactError(f"artifact {path} is for device {meta.get('device')} ({meta.get('target')}), not {device}; "
                        f"compile one with `modeld-msm compile --device {device}`")
  art = VerifiedArtifact(path, meta, dict(listed))
  if camera is not None and art.camera != tuple(camera):
    raise ArtifactError(f"artifact {path} is for camera {art.camera[0]}x{art.camera[1]}, the stream is {camera[0]}x{camera[1]}; "
                        f"compile one with `--camera {camera[0]}x{camera[1]}`")
  for prog in (POLICY_PKL, WARP_PKL):
    if prog not in listed:
      raise ArtifactError(f"artifact {path} lacks {prog}; {REBUILD_HINT}")
  return art


def resolve_artifact(path: str | Path, camera: tuple[int, int]) -> Path:
  """An artifact dir, or a release bundle holding one artifact per camera size (`<bundle>/<w>x<h>/`)."""
  path = Path(path)
  if (path / MANIFEST).exists():
    return path
  sub = path / f"{camera[0]}x{camera[1]}"
  if (sub / MANIFEST).exists():
    return sub
  have = sorted(p.name for p in path.iterdir() if (p / MANIFEST).exists()) if path.is_dir() else []
  raise ArtifactError(f"no artifact for camera {camera[0]}x{camera[1]} in {path} (found: {', '.join(have) or 'none'}); "
                      f"compile one with `modeld-msm compile --camera {camera[0]}x{camera[1]}`")


def activate_target(art: VerifiedArtifact) -> None:
  """Point tinygrad at the artifact's device/renderer before anything is unpickled (pickles open their device)."""
  from tinygrad.helpers import DEV
  target = os.environ.get("MODELD_DEV") or art.meta["load_target"]
  if art.device == "QCOM":
    import backend
    backend.install()
  DEV.value = target
  from tinygrad import Device
  try:
    Device[Device.DEFAULT]
  except Exception as e:
    raise ArtifactError(f"artifact {art.path} is for {art.device} ({target}), which cannot be opened here ({_why(e)}); "
                        f"use an artifact compiled for this machine (e.g. `modeld-msm compile --device CPU`)") from None


def _why(e: BaseException) -> str:
  """tinygrad tries each kernel interface and raises a group of failures: name each one, briefly."""
  if isinstance(e, BaseExceptionGroup):
    return "; ".join(_why(x) for x in e.exceptions)
  return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def load_programs(art: VerifiedArtifact) -> tuple[Any, Any]:
  """Unpickle the (policy, warp) TinyJits of an already verified artifact."""
  activate_target(art)
  return unpickle_programs(_read_checked(art, POLICY_PKL), _read_checked(art, WARP_PKL))


def _read_checked(art: VerifiedArtifact, name: str) -> bytes:
  # hash the exact bytes we unpickle, so a file swapped after verify_artifact is still refused
  data = (art.path / name).read_bytes()
  if hashlib.sha256(data).hexdigest() != art.digests[name]:
    raise ArtifactError(f"artifact {art.path}: {name} changed after verification; {REBUILD_HINT}")
  return data


def unpickle_programs(*blobs: bytes) -> tuple[Any, ...]:
  """Unpickle JITs pickled by one compile process, giving their buffers fresh identities in this process.

  tinygrad names a device buffer by a per-process counter (BUFFER uop `ParamArg.slot`) and deduplicates uops by value,
  so an unpickled buffer named like a live one *is* that one (tinygrad issue #15682): a JIT loaded after other tensors
  exist, or tensors made after loading, silently share memory with the JIT's queues and weights. Every buffer slot is
  renamed to a new counter value; one table serves all blobs so the queues shared by the policy and warp JITs stay shared.
  """
  fresh: dict[tuple, int] = {}
  return tuple(_FreshBufferUnpickler(io.BytesIO(b), fresh).load() for b in blobs)


class _FreshBufferUnpickler(pickle.Unpickler):
  def __init__(self, f, fresh: dict[tuple, int]):
    super().__init__(f)
    self.fresh = fresh

  def find_class(self, module: str, name: str) -> Any:
    cls = super().find_class(module, name)
    from tinygrad.uop.ops import UOp
    if cls is not UOp:
      return cls
    from dataclasses import replace

    from tinygrad.uop.ops import Ops

    def make_uop(op, dtype=None, src=(), arg=None, tag=None, metadata=None, _buffer=None):
      if op is Ops.BUFFER and arg is not None and hasattr(arg, "slot") and getattr(arg, "device", None) is not None:
        key = (arg.slot, arg.device, arg.dtype)
        if key not in self.fresh:
          self.fresh[key] = next(UOp.unique_num)
        arg = replace(arg, slot=self.fresh[key])
      return UOp(op, dtype, src, arg, tag, metadata, _buffer)
    return make_uop
