"""The release build: one artifact per camera size for a target, bundled and verified.

  python -m release.build --vision driving_vision.onnx --policy driving_policy.onnx --device QCOM -o artifacts/

writes artifacts/1928x1208/ and artifacts/1344x760/ (each a verified artifact), artifacts/smoke/<camera>/ (the recorded
input and the outputs each artifact produced for it, for `modeld-msm smoke` on a device; release/smoke.py) and
artifacts/bundle.json (per camera: target, seconds, size, checks, smoke file hashes; and the build's provenance). The
bundle directory is what `modeld-msm serve --artifact` (and `python -m modeld_msm.modeld`, openpilot's process entry)
takes: the artifact is picked by the camera size camerad reports. The bundle is swapped in atomically.
Same as `modeld-msm release` (options and summary table in modeld_msm/commands/release.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from release.bundle import BUNDLE_FILE, SMOKE_DIR, tree_size
from release.smoke import SMOKE_FRAMES
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import check_replaceable
from selfdrive_glue.nv12 import CAMERA_SIZES


def build_bundle(vision: Path, policy: Path, device: str, out: Path, cameras: list[str], log=print, sign_key: Path | None = None,
                 smoke_frames: int = SMOKE_FRAMES) -> dict:
  from compile import signing
  from compile.artifact import MANIFEST, swap_in_dir, verify_artifact
  from compile.build import compile_artifact
  from release import provenance, smoke
  if sign_key is not None:
    signing.load_private(sign_key)  # a bad key is refused now, not after minutes of compiling
  out = Path(out)
  check_replaceable(out, {BUNDLE_FILE: "artifacts"}, "release bundle of ours", (vision, policy) + ((sign_key,) if sign_key else ()))
  parent = out.resolve().parent
  parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
  try:
    entries: dict[str, dict[str, Any]] = {}
    for n, cam in enumerate(cameras, 1):
      t = time.perf_counter()
      log(f"[release] {n}/{len(cameras)} {cam} on {device}")
      report = compile_artifact(vision, policy, CAMERA_SIZES[cam], device, tmp / cam, log=log)
      art = verify_artifact(tmp / cam, device=device.split(":")[0], camera=CAMERA_SIZES[cam], pubkey="")
      entries[cam] = {"target": art.target, "checks": [c for c, r, _ in report.checks if r == "ok"], "size_bytes": tree_size(tmp / cam)}
      if smoke_frames > 0:
        log(f"[release] {cam}: recording the smoke test ({smoke_frames} frames through the artifact just built)")
        def every_25(i: int, k: int, cam: str = cam) -> None:
          if i % 25 == 0 or i == k:
            log(f"[release] {cam}: smoke frame {i}/{k}")
        entries[cam]["smoke"] = smoke.record(tmp / cam, tmp / SMOKE_DIR / cam, smoke_frames, progress=every_25)
        entries[cam]["checks"].append(f"smoke recorded ({smoke_frames} frames)")
      if sign_key is not None:
        entries[cam]["signed_by"] = signing.sign_artifact(tmp / cam, sign_key, MANIFEST)
      entries[cam]["seconds"] = round(time.perf_counter() - t, 1)
      entries[cam]["provenance"] = provenance.of_artifact(art.meta)
    manifest = {"device": device.split(":")[0], "artifacts": entries, "created_unix": int(time.time()), "build": provenance.of_build()}
    (tmp / BUNDLE_FILE).write_text(json.dumps(manifest, indent=1))
    swap_in_dir(tmp, out)
    return manifest
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def main(argv: list[str] | None = None) -> int:
  from modeld_msm.commands import release as command
  ap = argparse.ArgumentParser(prog="python -m release.build", description=__doc__.splitlines()[0])
  command.add_arguments(ap)
  a = ap.parse_args(argv)
  try:
    return command.run(a)
  except UserError as e:
    print(f"release.build: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
