"""Maintainers' tools that drive compiles: record, tune and re-key the shipped kernel search; record the QCOM register tiles."""

from __future__ import annotations

import sys
from collections.abc import Callable

from selfdrive_glue.errors import UserError


def run_tool(main: Callable[[], int]) -> None:
  """A tool's `python -m` entry: its exit status, or a UserError as one line and its exit code."""
  try:
    raise SystemExit(main())
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(e.exit_code) from None
