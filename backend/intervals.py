"""Address -> object lookup over disjoint [start, start+size) ranges, by bisection instead of a linear scan."""
from __future__ import annotations

import bisect
from typing import Generic, TypeVar

T = TypeVar("T")


class IntervalIndex(Generic[T]):
  def __init__(self) -> None:
    self._starts: list[int] = []
    self._items: list[tuple[int, int, T]] = []

  def __len__(self) -> int:
    return len(self._starts)

  def add(self, start: int, size: int, item: T) -> None:
    i = bisect.bisect_right(self._starts, start)
    if (i > 0 and self._items[i - 1][0] + self._items[i - 1][1] > start) or (i < len(self._starts) and start + size > self._starts[i]):
      raise ValueError(f"range {start:#x}+{size:#x} overlaps an existing range")
    self._starts.insert(i, start)
    self._items.insert(i, (start, size, item))

  def remove(self, start: int) -> T:
    i = bisect.bisect_left(self._starts, start)
    if i == len(self._starts) or self._starts[i] != start:
      raise KeyError(f"no range starts at {start:#x}")
    del self._starts[i]
    return self._items.pop(i)[2]

  def find(self, addr: int) -> tuple[int, int, T] | None:
    """The (start, size, item) whose range holds addr, or None."""
    i = bisect.bisect_right(self._starts, addr) - 1
    if i >= 0 and addr < (e := self._items[i])[0] + e[1]:
      return e
    return None

  def items(self) -> list[tuple[int, int, T]]:
    return list(self._items)
