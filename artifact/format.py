"""The compiled artifact: a directory of pickled TinyJits + metadata.json + manifest.json (sha256 of every file), and
optionally manifest.sig (an ed25519 signature over the manifest, artifact/signing.py).

Nothing is unpickled until the manifest, the signature (when a public key is configured), the versions and the device
have all been checked, and then only through artifact/jit_pickle.py, which constructs the classes a JIT needs and nothing else.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from artifact import kinds, signing
from artifact.cpu_info import cpu_info
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import sha256_file
from selfdrive_glue.nv12 import nv12_info

FORMAT = 1
MANIFEST, METADATA = "manifest.json", "metadata.json"
# what an artifact's metadata may name as its device (compile/build.py TARGETS, less the renderer after the colon)
DEVICES = ("CPU", "QCOM", "CUDA", "NV", "AMD")
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


# errnos of a write that ran out of room: a full disk, a quota, a file size limit (RLIMIT_FSIZE, with SIGXFSZ ignored)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full_error(e: BaseException, what: str, out_dir: str | os.PathLike) -> UserError | None:
  """A clear UserError for a write that ran out of room while `what`, or None when e is something else. sqlite (tinygrad's
  kernel cache, ~/.cache/tinygrad/cache.db) reports the same failure as an OperationalError, not an OSError."""
  if isinstance(e, OSError) and e.errno in DISK_FULL:
    why = f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
  elif type(e).__name__ == "OperationalError" and type(e).__module__ == "sqlite3" and ("disk" in str(e) or "full" in str(e)):
    why = f"tinygrad's kernel cache could not be written ({e}; CACHELEVEL=0 turns that cache off)"
  else:
    return None
  return UserError(f"out of disk space {what} ({why}); nothing was written to {out_dir} (an artifact already there is unchanged): "
                   "free some space and run it again")


def write_artifact(out_dir: Path, files: dict[str, bytes], meta: dict[str, Any]) -> Path:
  """Write files + metadata + manifest into a temp dir beside out_dir, then swap it in (never half-written: a failure, a full
  disk included, removes the temp dir and any parent folders made for it, and leaves an existing out_dir as it was)."""
  out_dir = Path(out_dir)
  parent = out_dir.resolve().parent
  made = [p for p in (parent, *parent.parents) if not p.exists()]   # deepest first: what a failure must remove again
  try:
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
  except OSError as e:
    _remove_empty(made)
    if (full := disk_full_error(e, "creating the artifact's folder", out_dir)) is not None:
      raise full from None
    raise UserError(f"cannot write the artifact into {parent}: {e.strerror}; choose a writable output directory") from None
  try:
    all_files = dict(files)
    all_files[METADATA] = json.dumps(meta, indent=1, sort_keys=True).encode()
    for name, data in all_files.items():
      _write_synced(tmp / name, data)
    manifest = {"format": FORMAT, "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(all_files.items())}}
    _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    swap_in_dir(tmp, out_dir)
  except BaseException as e:
    shutil.rmtree(tmp, ignore_errors=True)
    _remove_empty(made)
    if isinstance(e, Exception) and (full := disk_full_error(e, "writing the artifact", out_dir)) is not None:
      raise full from None
    raise
  return out_dir


def _write_synced(path: Path, data: bytes) -> None:
  # flushed to disk before the swap: a full disk is an error here (all of it, write and flush), not a file truncated after a crash
  with open(path, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def _remove_empty(dirs: list[Path]) -> None:
  for d in dirs:
    try:
      d.rmdir()
    except OSError:
      break   # not empty (someone else wrote there meanwhile) or already gone: leave it and its parents


def swap_in_dir(tmp: Path, out_dir: Path) -> None:
  """Replace out_dir by the finished tmp dir (same parent): readers see the old tree or the new one, never a mix.
  Writers racing for one out_dir each move away what is there and put theirs in; the last one in wins, none fails on
  a tree the other moved first."""
  os.chmod(tmp, 0o755)
  olds: list[Path] = []
  try:
    for attempt in range(10):
      if out_dir.exists() or out_dir.is_symlink():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{attempt}"
        try:
          os.replace(out_dir, old)
          olds.append(old)
        except FileNotFoundError:
          pass   # another writer moved it away between the look and the move
      try:
        os.replace(tmp, out_dir)
        break
      except OSError as e:
        # another writer's tree landed in between: move that away too (ENOTEMPTY/EEXIST: rename onto a non-empty folder)
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == 9:
          raise
  except BaseException:
    if olds and not out_dir.exists():
      os.replace(olds.pop(0), out_dir)   # the old tree back where it was: a failed swap must not lose the artifact being replaced
    raise
  for old in olds:
    if old.is_symlink():
      old.unlink()
    else:
      shutil.rmtree(old, ignore_errors=True)


@dataclass
class VerifiedArtifact:
  path: Path
  meta: dict[str, Any]
  digests: dict[str, str]
  signed_by: str | None = None  # key id, when a configured public key checked the signature

  @property
  def camera(self) -> tuple[int, int]:
    return int(self.meta["camera"]["width"]), int(self.meta["camera"]["height"])

  @property
  def device(self) -> str:
    return str(self.meta["device"])

  @property
  def target(self) -> str:
    return str(self.meta["target"])

  @property
  def kind(self) -> str:
    return str(self.meta.get("kind", kinds.LEGACY_KIND))

  @property
  def spec(self) -> kinds.Kind:
    return kinds.KINDS[self.kind]

  @property
  def programs(self) -> dict[str, dict[str, Any]]:
    """{pickle: {"role", "inputs", "outputs"}} in the order the programs' arguments take: as compiled (metadata "programs"),
    or, for an artifact written before it recorded them, its kind's."""
    return self.meta.get("programs") or self.spec.specs(self.camera)

  def program(self, role: str) -> tuple[str, dict[str, Any]]:
    """(pickle, spec) of the program with this role ("step", "warp")."""
    return next((f, p) for f, p in self.programs.items() if p["role"] == role)

  def output_slices(self, kind: str) -> dict[str, slice]:
    return {k: slice(a, b) for k, (a, b) in self.meta["models"][kind]["output_slices"].items()}


def verify_artifact(path: str | Path, device: str | None = None, camera: tuple[int, int] | None = None,
                    pubkey: str | os.PathLike | None = None, process: str | None = None) -> VerifiedArtifact:
  """Check integrity, signature (pubkey, else $MODELD_PUBKEY, if set), versions, device, camera, kind (one `process`
  serves, when given) and the programs' named inputs and outputs against the kind's. Reads JSON and hashes only; never
  unpickles."""
  path = Path(path)
  if not path.is_dir():
    raise ArtifactError(f"artifact {path} does not exist or is not a directory; {REBUILD_HINT}")
  try:
    manifest_bytes = (path / MANIFEST).read_bytes()
  except FileNotFoundError:
    raise ArtifactError(f"artifact {path} has no {MANIFEST}; {REBUILD_HINT}") from None
  try:
    manifest = json.loads(manifest_bytes)
    listed = manifest["files"]
  except Exception:
    listed = None
  if not isinstance(listed, dict) or manifest.get("format") != FORMAT:
    raise ArtifactError(f"artifact {path}: {MANIFEST} is corrupt or of another format; {REBUILD_HINT}")
  signed_by = None
  if (key := signing.configured_pubkey(pubkey)) is not None:
    signed_by = signing.check_signature(path, manifest_bytes, key)
  present = {p.name for p in path.iterdir() if p.name not in (MANIFEST, signing.SIGNATURE)}
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
    # the compiler need not be where the artifact runs (the car has none: tinymesa is x86_64 only); where it is, it must
    # be the one the artifact was built with
    if want != have and not (pkg == "tinymesa" and have is None):
      raise ArtifactError(f"artifact {path} was built with {pkg} {want}, this install has {have}; {REBUILD_HINT}")
  built_on, here = meta.get("host"), platform.machine()
  if str(meta.get("device", "")).startswith("CPU") and built_on and built_on != here:
    # a CPU artifact is the build machine's own code: run elsewhere it is an illegal instruction, not an error message
    raise ArtifactError(f"artifact {path} holds {built_on} machine code (a CPU artifact compiled on {built_on}); this machine is {here}: "
                        "compile one here with `modeld-msm compile --device CPU`, or on the car use the QCOM bundle")
  # -march=native code may use every extension of the build CPU; an explicit target (x86_64,haswell) only its own
  native = str(meta.get("arch", "")).split(",")[-1] == "native"
  if str(meta.get("device", "")).startswith("CPU") and native and isinstance(built_cpu := meta.get("build_cpu"), dict):
    this = cpu_info()
    if missing := sorted(set(built_cpu.get("flags", ())) - this.flags):
      raise ArtifactError(f"artifact {path} was compiled for {built_cpu.get('model')} and its code may use {', '.join(missing)}, which "
                          f"this CPU ({this.model}) lacks: it would stop at an illegal instruction; compile one here with "
                          "`modeld-msm compile --device CPU`")
  if device is not None and meta.get("device") != device:
    raise ArtifactError(f"artifact {path} is for device {meta.get('device')} ({meta.get('target')}), not {device}; "
                        f"compile one with `modeld-msm compile --device {device}`")
  _check_camera_geometry(path, meta)
  art = VerifiedArtifact(path, meta, dict(listed), signed_by)
  if camera is not None:
    require_camera(art, camera)
  if art.kind not in kinds.KINDS:
    raise ArtifactError(f"artifact {path} is of kind {art.kind!r}, which this modeld-msm does not know ({', '.join(kinds.KINDS)}); {REBUILD_HINT}")
  if process is not None and art.spec.process != process:
    want = kinds.served_by(process)
    raise ArtifactError(f"artifact {path} holds the {art.spec.title}, not the {' or '.join(k.title for k in want)}; pass the artifact compiled "
                        f"for it (`modeld-msm compile {want[0].compile_flags}`), or a bundle")
  if (why := kinds.mismatch(art.programs, art.spec, art.camera)) is not None:
    raise ArtifactError(f"artifact {path}: {why}; {REBUILD_HINT}")
  for prog in art.programs:
    if prog not in listed:
      raise ArtifactError(f"artifact {path} lacks {prog}; {REBUILD_HINT}")
  return art


def require_camera(art: VerifiedArtifact, camera: tuple[int, int]) -> None:
  if art.camera != tuple(camera):
    raise ArtifactError(f"artifact {art.path} is for camera {art.camera[0]}x{art.camera[1]}, the stream is {camera[0]}x{camera[1]}; "
                        f"compile one with `--camera {camera[0]}x{camera[1]}`")


def resolve_artifact(path: str | Path, camera: tuple[int, int], process: str = "modeld") -> Path:
  """An artifact dir, or a release bundle holding one artifact per camera size under the folder of each kind (Kind.bundle_dir)."""
  path = Path(path)
  if (path / MANIFEST).exists():
    return path
  served = kinds.served_by(process)
  folders = tuple(dict.fromkeys(k.bundle_dir for k in served))
  for folder in folders:
    sub = path / folder / f"{camera[0]}x{camera[1]}"
    if (sub / MANIFEST).exists():
      return sub
  have = [p.name for f in folders for p in _bundle_artifacts(path / f)]
  if folders != ("",):
    raise ArtifactError(f"no {served[0].title} artifact for camera {camera[0]}x{camera[1]} in {path} (found: {', '.join(have) or 'none'} "
                        f"under {'/, '.join(folders)}/); build the bundle with `modeld-msm release {served[0].compile_flags} ...`")
  raise ArtifactError(f"no artifact for camera {camera[0]}x{camera[1]} in {path} (found: {', '.join(have) or 'none'}); "
                      f"compile one with `modeld-msm compile --camera {camera[0]}x{camera[1]}`")


def _bundle_artifacts(path: Path) -> list[Path]:
  """The artifact directories of a release bundle (one per camera size), sorted; none when path is no directory."""
  return sorted(p for p in path.iterdir() if (p / MANIFEST).exists()) if path.is_dir() else []


def artifact_dirs(path: str | Path) -> list[Path]:
  """[path] for an artifact; each artifact of a release bundle (the driving ones at its root, then each kind's folder)."""
  path = Path(path)
  arts = [path] if (path / MANIFEST).exists() else [a for d in kinds.bundle_dirs() for a in _bundle_artifacts(path / d)]
  if not arts:
    raise ArtifactError(f"{path} is neither an artifact nor a bundle of artifacts; pass what `modeld-msm compile` or the release build wrote")
  return arts


def sign_tree(path: str | Path, key: Path) -> list[tuple[Path, str]]:
  """Sign an artifact, or each artifact of a bundle, after verifying it (a tampered artifact is never signed)."""
  arts = artifact_dirs(path)
  for a in arts:
    verify_artifact(a, pubkey="")  # integrity and versions; "" ignores $MODELD_PUBKEY, since the old signature is about to go
  return [(a, signing.sign_artifact(a, key, MANIFEST)) for a in arts]


def _check_camera_geometry(path: Path, meta: dict[str, Any]) -> None:
  """The NV12 layout in the metadata is the one its width and height give (selfdrive_glue/nv12.py): an edited size is
  refused here, before a stream of the other camera is paired with programs whose kernels index the old layout."""
  cam: Any = meta.get("camera")
  try:
    nv = nv12_info(int(cam["width"]), int(cam["height"]))
    want = {"width": nv.width, "height": nv.height, "stride": nv.stride, "y_height": nv.y_height, "uv_height": nv.uv_height,
            "uv_offset": nv.uv_offset, "size": nv.size}
    bad = [k for k, v in want.items() if k in cam and cam[k] != v]   # a field the writer left out was not edited
  except (TypeError, KeyError, ValueError, AttributeError):
    raise ArtifactError(f"artifact {path}: {METADATA} has no readable camera size; {REBUILD_HINT}") from None
  if bad:
    raise ArtifactError(f"artifact {path}: {METADATA}'s camera {cam['width']}x{cam['height']} disagrees with its own NV12 layout "
                        f"({', '.join(f'{k} {cam.get(k)}, not {want[k]}' for k in bad)}): it was edited; {REBUILD_HINT}")
