"""argparse types for numbers with a range: a NaN, an infinity or a count below its minimum is refused as argparse refuses
a word where a number goes (usage, one error line, exit 2), before the command starts."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
  def parse(s: str) -> int:
    try:
      v = int(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{s!r} is not a whole number") from None
    _check(v, s, lo, hi)
    return v
  parse.__name__ = "whole number"
  return parse


def real(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
  def parse(s: str) -> float:
    try:
      v = float(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(v):
      raise argparse.ArgumentTypeError(f"{s!r} is not a finite number")
    if lo_open and lo is not None and v <= lo:
      raise argparse.ArgumentTypeError(f"must be more than {lo:g}, not {s}")
    _check(v, s, None if lo_open else lo, hi)
    return v
  parse.__name__ = "number"
  return parse


def _check(v: float, s: str, lo: float | None, hi: float | None) -> None:
  if lo is not None and v < lo:
    raise argparse.ArgumentTypeError(f"must be at least {lo:g}, not {s}")
  if hi is not None and v > hi:
    raise argparse.ArgumentTypeError(f"must be at most {hi:g}, not {s}")
