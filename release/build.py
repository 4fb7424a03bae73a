"""The release build: one artifact per camera size for a target, bundled and verified.

  python -m release.build --vision driving_vision.onnx --policy driving_policy.onnx --device QCOM -o artifacts/

writes artifacts/1928x1208/ and artifacts/1344x760/ (each a verified artifact; `--model driving_supercombo.onnx` in place of
--vision/--policy builds master's combined model instead, bundle.json "contract": "supercombo"), with --dmonitoring dmonitoring_model.onnx
also artifacts/dmonitoring/<camera>/ (the driver-monitoring artifacts), artifacts/smoke/[dmonitoring/]<camera>/ (the recorded
input and the outputs each artifact produced for it, for `modeld-msm smoke` on a device; release/smoke.py) and
artifacts/bundle.json (per camera: target, seconds, size, checks, smoke file hashes; and the build's provenance). The
bundle directory is what `modeld-msm serve --artifact` (and `python -m modeld_msm.modeld`, openpilot's process entry)
takes: the artifact is picked by the camera size camerad reports. The bundle is swapped in atomically.
Same as `modeld-msm release`: its options, progress lines and summary table are the ones below.
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

from artifact import kinds, signing
from artifact.format import MANIFEST, swap_in_dir, verify_artifact
from compile.build import compile_artifact
from compile.onnx_model import detect_contract, load_model_info
from compile.report import CompileReport
from release import provenance, smoke
from release.bundle import BUNDLE_FILE, SMOKE_DIR, human_size, sign_smoke, tree_size
from release.smoke import DM_SMOKE_FRAMES, SMOKE_FRAMES
from selfdrive_glue.argtypes import integer
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import Terminated, check_replaceable, stop_on_sigterm
from selfdrive_glue.nv12 import CAMERA_SIZES


def build_bundle(vision: Path | None, policy: Path | None, device: str, out: Path, cameras: list[str], log=print,
                 sign_key: Path | None = None, smoke_frames: int = SMOKE_FRAMES, dmonitoring: Path | None = None,
                 dm_smoke_frames: int = DM_SMOKE_FRAMES, model: Path | None = None) -> dict:
  """Compile, verify, smoke-record (and sign) every camera's artifacts, the driving model's (0.11's pair, or master's
  combined `model`: a bundle holds one contract, bundle.json "contract") and with `dmonitoring` the DM model's, into a
  bundle swapped in at `out`. -> bundle.json's content."""
  if (model is None) == (vision is None or policy is None):
    raise UserError("pass the driving model as --vision and --policy (openpilot 0.11) or as --model driving_supercombo.onnx (master), "
                    "not both")
  if sign_key is not None:
    signing.load_private(sign_key)  # a bad key is refused now, not after minutes of compiling
  out = Path(out)
  driving = (model,) if model is not None else (vision, policy)
  inputs = tuple(p for p in driving if p is not None) + ((dmonitoring,) if dmonitoring else ()) + ((sign_key,) if sign_key else ())
  check_replaceable(out, {BUNDLE_FILE: "artifacts"}, "release bundle of ours", inputs)
  # the bundle's driving kind (one per bundle, bundle.json "contract") and, with `dmonitoring`, the DM kind, each from its models
  driving_kind = (kinds.of_model(detect_contract(model) or "supercombo") or kinds.DEFAULT) if model is not None else kinds.DEFAULT
  if model is not None and driving_kind.process != "modeld":
    raise UserError(f"--model {model} is the {driving_kind.title}; pass it as --dmonitoring, beside the driving model")
  driving_models: dict[str, str | Path] = {driving_kind.models[0]: model} if model is not None else {"vision": vision, "policy": policy}  # type: ignore[dict-item]
  builds: list[tuple[kinds.Kind, dict[str, str | Path], int]] = [(driving_kind, driving_models, smoke_frames)]
  if dmonitoring is not None:
    builds.append((kinds.KINDS["dmonitoring"], {"dmonitoring": dmonitoring}, dm_smoke_frames))
  for kind, models, _ in builds:
    if len(kind.models) == 1:
      load_model_info(models[kind.models[0]], kind.models[0])   # a wrong file is refused now, not after minutes of compiling
  parent = out.resolve().parent
  parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
  jobs = [(kind, models, frames, c) for kind, models, frames in builds for c in cameras]
  try:
    tables: dict[str, dict[str, dict[str, Any]]] = {kind.bundle_dir: {} for kind, _, _ in builds}
    for n, (kind, models, frames, cam) in enumerate(jobs, 1):
      t = time.perf_counter()
      log(f"[release] {n}/{len(jobs)} {cam}{'' if kind.process == 'modeld' else ' driver monitoring'} on {device}")
      d = tmp / kind.bundle_dir / cam
      report: CompileReport = compile_artifact(kind, models, CAMERA_SIZES[cam], device, d, log=log)
      art = verify_artifact(d, device=device.split(":")[0], camera=CAMERA_SIZES[cam], pubkey="", process=kind.process)
      entry: dict[str, Any] = {"target": art.target, "checks": [c for c, r, _ in report.checks if r == "ok"], "size_bytes": tree_size(d)}
      if frames > 0:
        log(f"[release] {cam}: recording the {kind.name} smoke test ({frames} frames through the artifact just built)")
        def every_25(i: int, k: int, cam: str = cam) -> None:
          if i % 25 == 0 or i == k:
            log(f"[release] {cam}: smoke frame {i}/{k}")
        entry["smoke"] = smoke.record(d, tmp / SMOKE_DIR / kind.bundle_dir / cam, frames, progress=every_25)
        entry["checks"].append(f"smoke recorded ({frames} frames)")
      if sign_key is not None:
        entry["signed_by"] = signing.sign_artifact(d, sign_key, MANIFEST)
        if "smoke" in entry:   # the smoke verdict must rest on signed hashes too (bundle.json is not signed)
          sign_smoke(tmp / SMOKE_DIR / kind.bundle_dir / cam, d, entry["smoke"]["files"], sign_key)
      entry["seconds"] = round(time.perf_counter() - t, 1)
      entry["provenance"] = provenance.of_artifact(art.meta)
      tables[kind.bundle_dir][cam] = entry
    manifest = {"device": device.split(":")[0], "contract": driving_kind.name, "artifacts": tables[driving_kind.bundle_dir],
                "created_unix": int(time.time()), "build": provenance.of_build()}
    for kind, _, _ in builds[1:]:
      manifest[kind.bundle_dir] = tables[kind.bundle_dir]
    (tmp / BUNDLE_FILE).write_text(json.dumps(manifest, indent=1))
    swap_in_dir(tmp, out)
    return manifest
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--vision", type=Path, help="driving_vision.onnx (openpilot 0.11, with --policy)")
  p.add_argument("--policy", type=Path, help="driving_policy.onnx")
  p.add_argument("--model", type=Path, metavar="ONNX", help="driving_supercombo.onnx: openpilot master's combined driving model, in "
                                                             "place of --vision/--policy")
  p.add_argument("--dmonitoring", type=Path, metavar="ONNX",
                 help="dmonitoring_model.onnx: also build the driver-monitoring artifacts (dmonitoringmodeld) for the same cameras")
  p.add_argument("--device", default="QCOM", help="QCOM (the car, captured on the emulated render node) or CPU")
  p.add_argument("--camera", action="append", choices=list(CAMERA_SIZES), help="camera sizes (default: both)")
  p.add_argument("-o", "--out", type=Path, required=True, help="bundle directory to write (replaced atomically)")
  p.add_argument("--sign-key", type=Path, help="ed25519 private key (`modeld-msm keygen`): sign every artifact of the bundle")
  p.add_argument("--smoke-frames", type=integer(0), default=SMOKE_FRAMES,
                 help=f"frames of the recorded smoke test to run and store per camera (default {SMOKE_FRAMES}; 0: none). A QCOM build "
                      "runs them on the emulator executing the IR3 code: ~1.3 s a frame for the tiny models, far longer for full-size ones")


class Progress:
  """Log lines prefixed with the time since the build started, flushed at once (a build runs for minutes)."""

  def __init__(self, out=None):
    self.t0, self.out = time.perf_counter(), out or sys.stdout

  def __call__(self, line: str) -> None:
    print(f"[{time.perf_counter() - self.t0:7.1f} s] {line}", file=self.out, flush=True)


def summary_table(manifest: dict) -> str:
  rows = [("camera", "target", "seconds", "size", "checks")]
  for kind, table in (("", manifest["artifacts"]), ("dmonitoring ", manifest.get("dmonitoring") or {})):
    for cam, e in table.items():
      size = human_size(e["size_bytes"]) + (f" + smoke {human_size(e['smoke']['bytes'])}" if e.get("smoke") else "")
      rows.append((kind + cam, e["target"], f"{e['seconds']:.1f}", size, f"{len(e['checks'])} passed: {', '.join(e['checks'])}"))
  w = [max(len(r[i]) for r in rows) for i in range(4)]
  lines = ["  ".join(f"{c:<{w[i]}}" for i, c in enumerate(r[:4])) + "  " + r[4] for r in rows]
  lines.insert(1, "-" * (sum(w) + 8 + len(rows[0][4])))
  return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
  if args.smoke_frames < 0:
    raise UserError(f"--smoke-frames must be 0 or more, not {args.smoke_frames}")
  progress = Progress()
  m = build_bundle(args.vision, args.policy, args.device, args.out, args.camera or list(CAMERA_SIZES), log=progress,
                   sign_key=args.sign_key, smoke_frames=args.smoke_frames, dmonitoring=args.dmonitoring,
                   dm_smoke_frames=min(args.smoke_frames, DM_SMOKE_FRAMES), model=args.model)
  print()
  print(summary_table(m))
  signed = {e.get("signed_by") for t in (m["artifacts"], m.get("dmonitoring") or {}) for e in t.values()} - {None}
  print(f"\nbundle written to {args.out} ({m['device']}, {human_size(tree_size(Path(args.out)))} in all"
        + (f", signed by key {', '.join(sorted(signed))}" if signed else ", unsigned") + ")")
  return 0


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m release.build", description=__doc__.splitlines()[0])
  add_arguments(ap)
  a = ap.parse_args(argv)
  stop_on_sigterm()
  try:
    return run(a)
  except UserError as e:
    print(f"release.build: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:   # the build's temp folder is gone by now
    return 143 if isinstance(e, Terminated) else 130


if __name__ == "__main__":
  sys.exit(main())
