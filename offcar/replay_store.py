"""Replay outputs keyed by what shaped them, so a rerun skips finished segments and `regress --report` finds the frames.

Every output log `<out>` gets a sidecar `<out>.json`, written after the log (both atomically). It records:
- `key`: sha256 over the segment's files (rlog + camera files), the files of the segments whose model state it carried on
  from or warmed up on, the artifact's manifest (which lists the sha256 of every artifact file), the replay code and the
  mode/options;
- `output_sha256`, the segment's path, and the ReplayResult.

An output counts as done only when its sidecar has the key this run would compute and the log still hashes to what was
recorded. Anything else is replayed again: no sidecar (the worker died between the log and the sidecar), another
artifact, code, mode or input, or a log changed since. The key is content, not names or mtimes, so a segment copied or
renamed elsewhere still matches, and a re-encoded one does not.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, fields
from pathlib import Path

from offcar.frame_map import require_rlog
from offcar.replay import ReplayResult
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import sha256_file, write_atomic
from selfdrive_glue.route import ROAD_CAMERA, WIDE_CAMERA, Segment

KEY_VERSION = 1
# modules of modeld_msm that cannot change an output's bytes (tooling around replay): editing them keeps finished outputs
_NOT_OUTPUT_CODE = {"cli.py", "demo.py", "demo_camera.py", "modeld.py", "regress.py", "report.py", "replay_ray.py", "replay_store.py"}


_SEGMENT_DIGESTS: dict[tuple[str, int, int], str] = {}  # (file, size, mtime_ns) -> digest: a warm-up hashes its previous segment again


def _cached_digest(path: Path) -> str:
  st = path.stat()
  k = (str(path.resolve()), st.st_size, st.st_mtime_ns)
  if k not in _SEGMENT_DIGESTS:
    _SEGMENT_DIGESTS[k] = sha256_file(path)
  return _SEGMENT_DIGESTS[k]


def segment_digest(seg: Segment) -> str:
  """sha256 over the files replay reads: the rlog and the road/wide camera files (the qlog and qcamera do not matter)."""
  rlog = require_rlog(seg)
  h = hashlib.sha256()
  for name, p in (("rlog", rlog), (ROAD_CAMERA, seg.camera(ROAD_CAMERA)), (WIDE_CAMERA, seg.camera(WIDE_CAMERA))):
    if p is not None:
      h.update(f"{name}={_cached_digest(p)}\n".encode())
  return h.hexdigest()


@functools.cache
def artifact_digest(artifact: str) -> str:
  """sha256 of the artifact's manifest (or of every manifest of a bundle): it names the sha256 of each file, and loading
  refuses files that do not match it."""
  p = Path(artifact)
  manifests = [p / "manifest.json"] if (p / "manifest.json").is_file() else sorted(p.glob("*/manifest.json"))
  if not manifests:
    raise UserError(f"artifact {p} has no manifest.json; pass an artifact directory (modeld-msm compile -o DIR) or a release bundle")
  h = hashlib.sha256()
  for m in manifests:
    h.update(f"{m.relative_to(p).as_posix()}={sha256_file(m)}\n".encode())
  return h.hexdigest()


@functools.cache
def code_digest() -> str:
  """sha256 of the code that shapes an output (modeld_msm's per-frame modules, selfdrive_glue incl. the schema): after an
  edit there, finished outputs are replayed again rather than trusted."""
  root = Path(__file__).resolve().parents[1]
  files = [p for p in sorted((root / "modeld_msm").glob("*.py")) if p.name not in _NOT_OUTPUT_CODE]
  files += sorted(p for p in (root / "selfdrive_glue").rglob("*") if p.suffix in (".py", ".capnp"))
  h = hashlib.sha256()
  for p in files:
    h.update(f"{p.relative_to(root).as_posix()}={sha256_file(p)}\n".encode())
  return h.hexdigest()


def output_key(chain: list[Segment], artifact: str | os.PathLike, mode: str, warmup_steps: int) -> str:
  """The key of the output of chain[-1]; chain[:-1] are the segments whose state it starts from (warm-up or carried on)."""
  doc = {"v": KEY_VERSION, "segments": [segment_digest(s) for s in chain], "artifact": artifact_digest(str(artifact)), "code": code_digest(),
         "mode": mode, "warmup_steps": warmup_steps if mode == "warmup" else None}
  return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def task_keys(task: list[tuple[Segment, Path, Segment | None]], artifact: str | os.PathLike, mode: str, warmup_steps: int) -> list[str]:
  """Keys of a task's outputs (replay.plan_tasks): warmup chains the previous segment, route the run of carried segments."""
  keys: list[str] = []
  run: list[Segment] = []
  for seg, _, prev in task:
    if mode == "route":
      run = run + [seg] if prev is not None and run and run[-1] == prev else [seg]
      chain = run
    elif mode == "warmup" and prev is not None and warmup_steps > 0:
      chain = [prev, seg]
    else:
      chain = [seg]
    keys.append(output_key(chain, artifact, mode, warmup_steps))
  return keys


def meta_path(out: Path) -> Path:
  return out.with_name(out.name + ".json")


def write_meta(out: Path, key: str, seg: Segment, result, mode: str, artifact: str | os.PathLike) -> None:
  res = asdict(result)
  res["out"] = str(result.out)
  doc = {"key": key, "output_sha256": sha256_file(out), "segment": str(Path(seg.path).resolve()), "mode": mode,
         "artifact": str(Path(artifact).resolve()), "result": res}
  write_atomic(meta_path(out), json.dumps(doc, indent=1).encode())


def read_meta(out: Path) -> dict | None:
  try:
    doc = json.loads(meta_path(out).read_text())
  except (OSError, ValueError):
    return None
  return doc if isinstance(doc, dict) else None


def done_result(out: Path, key: str):
  """The recorded ReplayResult when `out` is finished for `key` and unchanged since; else None."""
  doc = read_meta(out)
  if doc is None or doc.get("key") != key or not out.is_file():
    return None
  try:
    if sha256_file(out) != doc.get("output_sha256"):
      return None
    known = {f.name for f in fields(ReplayResult)}
    res = ReplayResult(**{k: v for k, v in doc["result"].items() if k in known})
  except (OSError, TypeError, KeyError):
    return None
  res.out = out
  return res
