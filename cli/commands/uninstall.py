"""`modeld-msm uninstall OPENPILOT_DIR`: undo `install` (release/install.py), byte for byte."""
from __future__ import annotations

import argparse

from release.install import uninstall


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("openpilot", help="the openpilot checkout modeld-msm was installed into")
  p.add_argument("--dry-run", action="store_true", help="print what would change (a unified diff of the process table) and change nothing")


def run(args: argparse.Namespace) -> int:
  uninstall(args.openpilot, dry_run=args.dry_run)
  return 0
