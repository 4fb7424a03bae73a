"""`modeld-msm install OPENPILOT_DIR --bundle DIR`: openpilot's manager runs this modeld on the bundle, and this dmonitoringmodeld
when the bundle has driver-monitoring artifacts (release/install.py)."""
from __future__ import annotations

import argparse

from release.install import install


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("openpilot", help="the openpilot checkout (e.g. /data/openpilot)")
  p.add_argument("--bundle", required=True, help="bundle directory written by `modeld-msm release` (copied into the checkout)")
  p.add_argument("--dry-run", action="store_true", help="print what would change (launchers, a diff of the process table) and change nothing")
  p.add_argument("--allow-cpu", action="store_true", help="accept a CPU bundle (openpilot on a PC); the car needs a QCOM one")
  keys = p.add_mutually_exclusive_group()
  keys.add_argument("--pubkey", help="require every artifact to be signed by this public key, now and each time modeld starts "
                    "(default: keep the key an earlier install put there, if any)")
  keys.add_argument("--drop-pubkey", action="store_true", help="remove the installed public key: modeld accepts unsigned artifacts again")
  p.add_argument("--python", help="interpreter the launcher runs modeld in (default: this one, which has modeld-msm and its tinygrad)")


def run(args: argparse.Namespace) -> int:
  install(args.openpilot, args.bundle, python=args.python, allow_cpu=args.allow_cpu, pubkey=args.pubkey, dry_run=args.dry_run,
          drop_pubkey=args.drop_pubkey)
  return 0
