"""The release build: one artifact per camera size for a target, bundled and verified.

  python -m release.build --vision driving_vision.onnx --policy driving_policy.onnx --device QCOM -o artifacts/

writes artifacts/1928x1208/ and artifacts/1344x760/ (each a verified artifact) and artifacts/bundle.json. The bundle
directory is what `modeld-msm serve --artifact` (and `python -m modeld_msm.modeld`, openpilot's process entry) takes:
the artifact is picked by the camera size camerad reports. The bundle is swapped in atomically.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from modeld_msm.errors import UserError
from selfdrive_glue.nv12 import CAMERA_SIZES

BUNDLE_FILE = "bundle.json"


def build_bundle(vision: Path, policy: Path, device: str, out: Path, cameras: list[str], log=print, sign_key: Path | None = None) -> dict:
  from compile import signing
  from compile.artifact import MANIFEST, swap_in_dir, verify_artifact
  from compile.build import compile_artifact
  if sign_key is not None:
    signing.load_private(sign_key)  # a bad key is refused now, not after minutes of compiling
  out = Path(out)
  parent = out.resolve().parent
  parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
  try:
    entries = {}
    for cam in cameras:
      t = time.perf_counter()
      log(f"[release] {cam} on {device}")
      report = compile_artifact(vision, policy, CAMERA_SIZES[cam], device, tmp / cam, log=log)
      art = verify_artifact(tmp / cam, device=device.split(":")[0], camera=CAMERA_SIZES[cam], pubkey="")
      entries[cam] = {"target": art.target, "seconds": round(time.perf_counter() - t, 1),
                      "checks": [c for c, r, _ in report.checks if r == "ok"]}
      if sign_key is not None:
        entries[cam]["signed_by"] = signing.sign_artifact(tmp / cam, sign_key, MANIFEST)
    manifest = {"device": device.split(":")[0], "artifacts": entries, "created_unix": int(time.time())}
    (tmp / BUNDLE_FILE).write_text(json.dumps(manifest, indent=1))
    swap_in_dir(tmp, out)
    return manifest
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m release.build", description=__doc__.splitlines()[0])
  ap.add_argument("--vision", type=Path, required=True)
  ap.add_argument("--policy", type=Path, required=True)
  ap.add_argument("--device", default="QCOM", help="QCOM (the car, captured on the emulated render node) or CPU")
  ap.add_argument("--camera", action="append", choices=list(CAMERA_SIZES), help="camera sizes (default: both)")
  ap.add_argument("-o", "--out", type=Path, required=True)
  ap.add_argument("--sign-key", type=Path, help="ed25519 private key (`modeld-msm keygen`): sign every artifact of the bundle")
  a = ap.parse_args(argv)
  try:
    m = build_bundle(a.vision, a.policy, a.device, a.out, a.camera or list(CAMERA_SIZES), sign_key=a.sign_key)
  except UserError as e:
    print(f"release.build: error: {e}", file=sys.stderr)
    return 2
  for cam, entry in m["artifacts"].items():
    print(f"{cam}: {entry['target']}  {entry['seconds']}s  checks: {', '.join(entry['checks'])}")
  print(f"bundle written to {a.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
