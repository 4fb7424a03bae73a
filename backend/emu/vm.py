"""A userspace-managed GPU VM (VM_BIND mode) as the emulated node keeps it: page-granular mappings of BO ranges.

A MAP over addresses already mapped replaces them and an UNMAP of part of a mapping splits it, as drm_gpuvm's
split/merge steps do (docs/msm-kernel-rules.md, "VM_BIND"). Each mapping piece holds a reference on its BO, so a BO whose
handle was closed stays alive while any piece still maps it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.intervals import IntervalIndex


@dataclass(eq=False)
class Mapping:
  gem: Any            # node.GemObject
  obj_offset: int     # byte offset into the BO of the mapping's first page


class UserVM:
  def __init__(self) -> None:
    self.maps: IntervalIndex[Mapping] = IntervalIndex()

  def __len__(self) -> int:
    return len(self.maps)

  def find(self, iova: int) -> tuple[int, int, Mapping] | None:
    return self.maps.find(iova)

  def unmap(self, start: int, size: int) -> list[Any]:
    """Removes [start, start+size) from every mapping it touches (splitting those it cuts); returns the BO of each piece
    removed or cut, once per piece reference dropped, so the caller can release BOs nothing maps any more."""
    end, dropped = start + size, []
    for s, n, m in self.maps.items():
      if s + n <= start or s >= end:
        continue
      self.maps.remove(s)
      m.gem.maps -= 1
      dropped.append(m.gem)
      if s < start:   # the part before the hole stays mapped
        self._insert(s, start - s, m.gem, m.obj_offset)
      if s + n > end:   # and the part after it, at the matching offset into the BO
        self._insert(end, s + n - end, m.gem, m.obj_offset + (end - s))
    return dropped

  def map(self, start: int, size: int, gem: Any, obj_offset: int) -> list[Any]:
    dropped = self.unmap(start, size)
    self._insert(start, size, gem, obj_offset)
    return dropped

  def _insert(self, start: int, size: int, gem: Any, obj_offset: int) -> None:
    self.maps.add(start, size, Mapping(gem, obj_offset))
    gem.maps += 1

  def clear(self) -> list[Any]:
    dropped = [m.gem for _, _, m in self.maps.items()]
    for s, _, m in self.maps.items():
      self.maps.remove(s)
      m.gem.maps -= 1
    return dropped
