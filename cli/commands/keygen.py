"""`modeld-msm keygen -o DIR`: an ed25519 key pair for signing release bundles."""
from __future__ import annotations

from pathlib import Path

from artifact.signing import generate_keypair, key_id, load_public


def add_arguments(p) -> None:
  p.add_argument("-o", "--out", type=Path, required=True, help="directory for NAME.key (private, 0600) and NAME.pub")
  p.add_argument("--name", default="modeld-msm", help="file name stem (default: modeld-msm)")


def run(args) -> int:
  priv, pub = generate_keypair(args.out, args.name)
  print(f"private key {priv} (keep it with the release build)")
  print(f"public key  {pub} (key id {key_id(load_public(pub))}); on the car: MODELD_PUBKEY={pub.name} or `verify --pubkey`")
  return 0
