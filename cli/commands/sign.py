"""`modeld-msm sign PATH --key KEY`: sign an artifact, or every artifact of a release bundle."""
from __future__ import annotations

from pathlib import Path

from release.bundle import sign_bundle


def add_arguments(p) -> None:
  p.add_argument("path", type=Path, help="artifact directory, or a bundle holding one per camera size")
  p.add_argument("--key", type=Path, required=True, help="private key from `modeld-msm keygen`")


def run(args) -> int:
  for art, kid in sign_bundle(args.path, args.key):
    print(f"{art}: signed by key {kid}")
  return 0
