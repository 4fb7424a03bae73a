"""A release bundle on disk: `bundle.json` (the index), one verified artifact per camera size, and `smoke/<camera>/`
(the recorded input and expected outputs `modeld-msm smoke` checks a device against); with the driver-monitoring model,
also `dmonitoring/<camera>/` and `smoke/dmonitoring/<camera>/`, indexed under bundle.json's "dmonitoring".

`verify_bundle` is what install and smoke both trust: every listed artifact passes `verify_artifact` (manifest, signature
when a public key is configured, versions, device, camera) and every smoke file matches the hash bundle.json recorded.
It reads JSON and hashes only; nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifact import kinds, signing
from artifact.format import MANIFEST, sign_tree, verify_artifact
from artifact.signing import SIGNATURE
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import sha256_file, write_atomic
from selfdrive_glue.nv12 import parse_camera

BUNDLE_FILE = "bundle.json"
SMOKE_DIR = "smoke"
# the files of one smoke test (release/smoke.py writes them): the only names bundle.json may list under a camera's "smoke"
SMOKE_FILES = ("frames.nv12.zst", "inputs.npz", "expected.npz", "smoke.json")
# beside them in a signed bundle: the signer's signature of smoke_statement, so the verdict rests on nothing unsigned
SMOKE_SIGNATURE = "smoke.sig"
RELEASE_HINT = "rebuild it with `modeld-msm release` (or `python -m release.build`)"


@dataclass
class Bundle:
  path: Path
  index: dict[str, Any]
  artifacts: dict[str, Any] = field(default_factory=dict)      # camera -> VerifiedArtifact (driving)
  dm_artifacts: dict[str, Any] = field(default_factory=dict)   # camera -> VerifiedArtifact (driver monitoring)

  @property
  def device(self) -> str:
    return str(self.index.get("device"))

  @property
  def cameras(self) -> list[str]:
    return list(self.index.get("artifacts", {}))

  def entries(self, kind: str) -> dict[str, Any]:
    folder = kinds.KINDS[kind].bundle_dir   # the driving kinds' table is "artifacts", at the root; another kind's is named as its folder
    return self.index["artifacts"] if not folder else self.index.get(folder) or {}

  @property
  def dm_cameras(self) -> list[str]:
    return list(self.entries("dmonitoring"))

  def artifact_dir(self, camera: str, kind: str = "driving") -> Path:
    return self.path / kinds.KINDS[kind].bundle_dir / camera

  def smoke_dir(self, camera: str, kind: str = "driving") -> Path:
    return self.path / SMOKE_DIR / kinds.KINDS[kind].bundle_dir / camera


def sha256_bytes(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def read_index(path: str | os.PathLike) -> dict[str, Any]:
  path = Path(path)
  if not path.is_dir():
    raise UserError(f"bundle {path} does not exist or is not a directory; pass the directory `modeld-msm release` wrote")
  try:
    index = json.loads((path / BUNDLE_FILE).read_text())
  except FileNotFoundError:
    what = "a single artifact" if (path / "manifest.json").exists() else "not a release bundle"
    raise UserError(f"{path} has no {BUNDLE_FILE} ({what}); pass the directory `modeld-msm release` wrote") from None
  except (OSError, ValueError) as e:
    raise UserError(f"bundle {path}: {BUNDLE_FILE} is unreadable ({e}); {RELEASE_HINT}") from None
  if not isinstance(index, dict) or not isinstance(index.get("artifacts"), dict) or not index["artifacts"]:
    raise UserError(f"bundle {path}: {BUNDLE_FILE} lists no artifacts; {RELEASE_HINT}")
  if not isinstance(index.get("dmonitoring") or {}, dict):
    raise UserError(f"bundle {path}: {BUNDLE_FILE}'s \"dmonitoring\" is not a table of camera -> artifact; {RELEASE_HINT}")
  if not isinstance(index.get("device"), str):
    raise UserError(f"bundle {path}: {BUNDLE_FILE} names no device; {RELEASE_HINT}")
  for table in ("artifacts", "dmonitoring"):
    for cam, entry in (index.get(table) or {}).items():
      smoke = entry.get("smoke") if isinstance(entry, dict) else None
      if (not isinstance(entry, dict) or not isinstance(smoke or {}, dict) or not isinstance(entry.get("signed_by") or "", str)
          or (smoke and not isinstance(smoke.get("files") or {}, dict))):
        raise UserError(f"bundle {path}: {BUNDLE_FILE}'s entry {table}/{printable(cam)} is not of the shape the release build writes; "
                        f"{RELEASE_HINT}")
  return index


def verify_bundle(path: str | os.PathLike, device: str | None = None, cameras: list[str] | None = None,
                  pubkey: str | os.PathLike | None = None, smoke: bool | None = True) -> Bundle:
  """The bundle's index, its artifacts verified (all listed cameras, or `cameras`), and its smoke files checked
  (smoke=True: required, None: checked where the build recorded them, False: not looked at)."""
  path = Path(path)
  b = Bundle(path, read_index(path))
  if device is not None and b.device != device:
    raise UserError(f"bundle {path} is for device {b.device}, not {device}; build one with `modeld-msm release --device {device}`")
  for cam in cameras or b.cameras:
    parse_camera(cam)   # a size no camera makes is a typo, not a bundle to rebuild
    if cam not in b.index["artifacts"]:
      raise UserError(f"bundle {path} has no artifact for camera {cam} (it has {', '.join(b.cameras)}); {RELEASE_HINT} with --camera {cam}")
    b.artifacts[cam] = verify_artifact(path / cam, device=b.device, camera=parse_camera(cam), pubkey=pubkey, process="modeld")
    if smoke or (smoke is None and b.index["artifacts"][cam].get("smoke")):
      check_smoke_files(b, cam, pubkey=pubkey)
  # the driver-monitoring artifacts of the same cameras, where the bundle has them
  for cam in [c for c in b.dm_cameras if c in (cameras or b.dm_cameras)]:
    parse_camera(cam)
    b.dm_artifacts[cam] = verify_artifact(b.artifact_dir(cam, "dmonitoring"), device=b.device, camera=parse_camera(cam), pubkey=pubkey,
                                          process="dmonitoringmodeld")
    if smoke or (smoke is None and b.entries("dmonitoring")[cam].get("smoke")):
      check_smoke_files(b, cam, "dmonitoring", pubkey=pubkey)
  return b


def sign_bundle(path: str | os.PathLike, key: Path) -> list[tuple[Path, str]]:
  """Sign an artifact or every artifact of a bundle (artifact.format.sign_tree), and record the signer in the bundle.json
  that lists them (the bundle's own, or the one above a single artifact of a bundle): release and install read who signed
  from there, so a re-signed bundle must not keep naming the old key. -> (artifact, key id) for each one signed."""
  path = Path(path)
  # the bundle.json listing what is signed: the bundle's own, or the one above a single artifact (a driver-monitoring
  # artifact sits one folder deeper, in dmonitoring/<camera>/)
  above = [path.parent, path.parent.parent] if (path / MANIFEST).exists() else []
  index_dir = path if (path / BUNDLE_FILE).exists() else next((d for d in above if (d / BUNDLE_FILE).exists()), None)
  index = read_index(index_dir) if index_dir is not None else None   # an unreadable index is refused before anything is signed
  signed = sign_tree(path, key)
  if index is not None and index_dir is not None:
    recorded = False
    for art, kid in signed:
      dm_dir = index_dir / kinds.KINDS["dmonitoring"].bundle_dir
      tables = {index_dir.resolve(): index["artifacts"], dm_dir.resolve(): index.get("dmonitoring") or {}}
      entry = tables.get(art.resolve().parent, {}).get(art.name)
      if isinstance(entry, dict):
        entry["signed_by"] = kid
        recorded = True
        in_sub = art.resolve().parent == dm_dir.resolve()   # a kind of its own folder: its smoke data under smoke/<folder>/
        if isinstance(entry.get("smoke"), dict) and isinstance(files := entry["smoke"].get("files"), dict):
          sign_smoke(index_dir / SMOKE_DIR / (dm_dir.name if in_sub else "") / art.name, art, files, key)
    if recorded:
      write_atomic(index_dir / BUNDLE_FILE, json.dumps(index, indent=1))
  return signed


def smoke_statement(artifact_dir: Path, files: dict[str, str]) -> bytes:
  """What a bundle's signer vouches for about one smoke test: its files' hashes and the artifact they were recorded from."""
  return json.dumps({"format": 1, "artifact_manifest_sha256": sha256_file(artifact_dir / MANIFEST), "files": files},
                    sort_keys=True).encode()


def sign_smoke(smoke_dir: Path, artifact_dir: Path, files: dict[str, str], key: Path) -> str:
  """Sign one smoke test (smoke_statement) into smoke_dir/smoke.sig; -> the key id. Files that do not match the hashes
  are refused: a signature vouches for what is there."""
  for name, digest in files.items():
    if name not in SMOKE_FILES or sha256_file(smoke_dir / name) != digest:
      raise UserError(f"{smoke_dir}: smoke file {printable(str(name))} does not match the hash in {BUNDLE_FILE}; {RELEASE_HINT}, then sign")
  return signing.sign_bytes(smoke_dir, smoke_statement(artifact_dir, files), key, SMOKE_SIGNATURE)


def check_smoke_files(b: Bundle, camera: str, kind: str = "driving", pubkey: str | os.PathLike | None = None) -> dict[str, str]:
  """The smoke files of one camera (and artifact kind), each matching the sha256 the release build recorded in bundle.json;
  with a public key configured, those hashes must also be what the key signed (bundle.json itself is not signed)."""
  listed = b.entries(kind)[camera].get("smoke", {}).get("files")
  what = f"{kind} {camera}" if kinds.KINDS[kind].bundle_dir else camera
  if not listed:
    raise UserError(f"bundle {b.path} carries no smoke data for {what} (built before `modeld-msm smoke` existed?); {RELEASE_HINT}")
  d = b.smoke_dir(camera, kind)
  rel = d.relative_to(b.path).as_posix()
  if not isinstance(listed, dict) or set(listed) != set(SMOKE_FILES) or not all(isinstance(v, str) for v in listed.values()):
    # a name from the index is never a path to follow: ../../etc/passwd would be read and hashed
    shown = sorted(printable(str(n)) for n in listed) if isinstance(listed, dict) else type(listed).__name__
    raise UserError(f"bundle {b.path}: {BUNDLE_FILE} lists smoke files {shown} for {what}, not {', '.join(SMOKE_FILES)}; {RELEASE_HINT}")
  for name, digest in listed.items():
    f = d / name
    if f.is_symlink() or not f.is_file():
      raise UserError(f"bundle {b.path}: smoke file {rel}/{name} is missing; {RELEASE_HINT}")
    if sha256_file(f) != digest:
      raise UserError(f"bundle {b.path}: smoke file {rel}/{name} does not match the hash in {BUNDLE_FILE} "
                      f"(modified or corrupt); {RELEASE_HINT}")
  if (key := signing.configured_pubkey(pubkey)) is not None:
    signing.check_signature(d, smoke_statement(b.artifact_dir(camera, kind), listed), key, SMOKE_SIGNATURE)
  return dict(listed)


def tree_files(path: Path) -> list[Path]:
  return sorted(p for p in path.rglob("*") if p.is_file())


def tree_digest(path: Path) -> str:
  """sha256 over every file's relative path and content: equal digests mean byte-identical trees."""
  return files_digest(path, [p.relative_to(path).as_posix() for p in tree_files(path)])


def files_digest(root: Path, rels: list[str]) -> str:
  """tree_digest over these files of root only (equal to it when they are all of root's files)."""
  h = hashlib.sha256()
  for rel in sorted(rels, key=lambda r: Path(r).parts):
    h.update(f"{rel}\0{sha256_file(root / rel)}\n".encode())
  return h.hexdigest()


def printable(text: str, limit: int = 80) -> str:
  """text from a file for one line of output: control characters (newlines, terminal escapes) shown escaped, cut at limit."""
  out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
  return out if len(out) <= limit else out[:limit] + "..."


def bundle_files(b: Bundle) -> list[str]:
  """Every file of a verified bundle (verify_bundle filled b.artifacts and b.dm_artifacts), as paths relative to it:
  bundle.json, each listed artifact's manifest, signature and the files its manifest lists, and each listed camera's
  smoke files. What install copies; nothing else in the folder is part of the bundle."""
  files = [BUNDLE_FILE]
  for kind, arts in (("driving", b.artifacts), ("dmonitoring", b.dm_artifacts)):
    for cam, art in arts.items():
      d = b.artifact_dir(cam, kind).relative_to(b.path)
      files += [(d / n).as_posix() for n in (MANIFEST, *art.digests) if n != BUNDLE_FILE]
      if (b.path / d / SIGNATURE).exists():
        files.append((d / SIGNATURE).as_posix())
      if b.entries(kind)[cam].get("smoke"):
        sd = b.smoke_dir(cam, kind).relative_to(b.path)
        files += [(sd / n).as_posix() for n in SMOKE_FILES]
        if (b.path / sd / SMOKE_SIGNATURE).exists():
          files.append((sd / SMOKE_SIGNATURE).as_posix())
  return list(dict.fromkeys(files))


def check_no_links(root: Path, rels: list[str]) -> None:
  """Refuse a bundle whose files are reached through a symlink, or are not plain files: install copies what the bundle
  holds, never what a link points at (NOTES.txt -> /etc/shadow)."""
  for rel in rels:
    p = root
    for part in Path(rel).parts:
      if part in ("", ".", "..") or os.sep in part:
        raise UserError(f"bundle {root}: {printable(rel)} leaves the bundle; {RELEASE_HINT}")
      p = p / part
      if p.is_symlink():
        raise UserError(f"bundle {root}: {p.relative_to(root).as_posix()} is a symbolic link; a bundle holds its own files, copy "
                        f"them in (`cp -rL`) or {RELEASE_HINT}")
    if not p.is_file():
      raise UserError(f"bundle {root}: {printable(rel)} is not a regular file; {RELEASE_HINT}")


def tree_size(path: Path) -> int:
  return sum(p.stat().st_size for p in tree_files(path))


def human_size(n: float) -> str:
  for unit in ("B", "kB", "MB", "GB"):
    if n < 1000 or unit == "GB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1000
  return f"{n:.1f} GB"
