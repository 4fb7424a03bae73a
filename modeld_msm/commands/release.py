"""`modeld-msm release` (also `python -m release.build`): compile, verify and bundle one artifact per camera size.

Shows progress as it goes (each step with the time since the start; compiling a full-size QCOM artifact takes minutes)
and ends with a summary table: camera, target, seconds, size, checks.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from modeld_msm.commands.argtypes import integer

HELP = "release build: compile + verify + bundle one artifact per camera size, with a recorded smoke test"


def add_arguments(p: argparse.ArgumentParser) -> None:
  from release.smoke import SMOKE_FRAMES
  from selfdrive_glue.nv12 import CAMERA_SIZES
  p.add_argument("--vision", type=Path, required=True, help="driving_vision.onnx")
  p.add_argument("--policy", type=Path, required=True, help="driving_policy.onnx")
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
  from release.bundle import human_size
  rows = [("camera", "target", "seconds", "size", "checks")]
  for cam, e in manifest["artifacts"].items():
    size = human_size(e["size_bytes"]) + (f" + smoke {human_size(e['smoke']['bytes'])}" if e.get("smoke") else "")
    rows.append((cam, e["target"], f"{e['seconds']:.1f}", size, f"{len(e['checks'])} passed: {', '.join(e['checks'])}"))
  w = [max(len(r[i]) for r in rows) for i in range(4)]
  lines = ["  ".join(f"{c:<{w[i]}}" for i, c in enumerate(r[:4])) + "  " + r[4] for r in rows]
  lines.insert(1, "-" * (sum(w) + 8 + len(rows[0][4])))
  return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
  from release.build import build_bundle
  from release.bundle import human_size, tree_size
  from selfdrive_glue.errors import UserError
  from selfdrive_glue.nv12 import CAMERA_SIZES
  if args.smoke_frames < 0:
    raise UserError(f"--smoke-frames must be 0 or more, not {args.smoke_frames}")
  progress = Progress()
  m = build_bundle(args.vision, args.policy, args.device, args.out, args.camera or list(CAMERA_SIZES), log=progress,
                   sign_key=args.sign_key, smoke_frames=args.smoke_frames)
  print()
  print(summary_table(m))
  signed = {e.get("signed_by") for e in m["artifacts"].values()} - {None}
  print(f"\nbundle written to {args.out} ({m['device']}, {human_size(tree_size(Path(args.out)))} in all"
        + (f", signed by key {', '.join(sorted(signed))}" if signed else ", unsigned") + ")")
  return 0
