"""`modeld-msm smoke --bundle DIR`: is this device's GPU computing what the release build expected?

doctor first (versions, render node, a submit/fence round trip), then for each camera size of the bundle (or --camera):
verify the artifact, load it as `serve` does, replay the recorded input shipped in the bundle (100 frames, dropped
frames included) and compare every output with the expectation stored at build time. Exit 0 on PASS, 1 on a mismatch
or a failed doctor (the first diverging output is named), 2 on a bundle that cannot be used.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from cli.commands import doctor
from release import smoke
from release.bundle import read_index, verify_bundle
from selfdrive_glue.argtypes import integer
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import parse_camera


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--bundle", required=True, help="bundle directory written by `modeld-msm release` (or an installed copy)")
  p.add_argument("--camera", action="append", help="check only this camera size, e.g. 1928x1208 (default: every size in the bundle)")
  p.add_argument("--frames", type=integer(1), help="replay only the first N recorded frames (default: all, 100)")
  p.add_argument("--emu", action="store_true",
                 help="off the car: run a QCOM bundle on the emulated render node, executing its IR3 code (EMU_EXEC=1)")
  p.add_argument("--pubkey", help="require each artifact to be signed by this public key (default: $MODELD_PUBKEY, if set)")
  p.add_argument("--skip-doctor", action="store_true", help="do not run doctor first")


class _Progress:
  """One status line per camera, rewritten in place on a terminal and printed every 25 frames elsewhere."""

  def __init__(self, camera: str):
    self.camera, self.t0, self.tty = camera, time.perf_counter(), sys.stderr.isatty()

  def __call__(self, done: int, total: int) -> None:
    if self.tty:
      print(f"\r[smoke] {self.camera}: frame {done}/{total} ({time.perf_counter() - self.t0:.0f} s)", end="", file=sys.stderr, flush=True)
      if done == total:
        print(file=sys.stderr)
    elif done % 25 == 0 or done == total:
      print(f"[smoke] {self.camera}: frame {done}/{total} ({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
  for cam in args.camera or []:
    parse_camera(cam)
  device = read_index(args.bundle).get("device")
  if args.emu:
    if device != "QCOM":
      raise UserError(f"--emu runs a QCOM bundle on the emulated a630; {args.bundle} is a {device} bundle, run it without --emu")
    os.environ["MODELD_DEV"], os.environ["EMU_EXEC"] = "EMU+QCOM:IR3", "1"   # read when the device opens
  b = verify_bundle(args.bundle, cameras=args.camera, pubkey=args.pubkey)
  print(f"[smoke] bundle {b.path}: {b.device}, cameras {', '.join(b.artifacts)}"
        + (f"; driver monitoring {', '.join(b.dm_artifacts)}" if b.dm_artifacts else ""))
  if not args.skip_doctor and not _doctor(b.device, args.emu):
    print("verdict: FAIL (doctor found a problem above; fix it before trusting this device's outputs)")
    return 1
  results = []
  jobs = [("driving", cam, art) for cam, art in b.artifacts.items()] + [("dmonitoring", cam, art) for cam, art in b.dm_artifacts.items()]
  for kind, cam, art in jobs:
    label = cam if kind == "driving" else f"dmonitoring {cam}"
    res = smoke.check(art, b.smoke_dir(cam, kind), frames=args.frames, progress=_Progress(label))
    res.camera = label
    print(f"[smoke] {res.line()}")
    results.append(res)
  failed = [r.camera for r in results if not r.ok]
  print(f"verdict: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}: "
        f"{len(results) - len(failed)} of {len(results)} artifact(s) match the outputs recorded at build time")
  return 1 if failed else 0


def _doctor(device: str, emu: bool) -> bool:
  print("[smoke] doctor")
  if device != "QCOM":   # a CPU bundle needs no render node: the versions are what matter
    return doctor._versions()
  return doctor.run(argparse.Namespace(emu=emu, rounds=5)) == 0
