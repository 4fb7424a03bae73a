"""GPU virtual addresses chosen in userspace (VM_BIND mode) over the kernel's [VA_START, VA_START + VA_SIZE).

Ranges are page aligned (the kernel refuses anything else with EINVAL) and each is followed by one unmapped guard page,
so a kernel that runs past the end of its buffer faults instead of reading or writing the next one. Allocation is top
down: the low end of the window (0x1_0000_0000 on a630) is what a pair of small integers in a constant buffer looks like
as a 64-bit pointer, and keeping real buffers away from it keeps such a pair from ever naming live memory.
"""
from __future__ import annotations

PAGE = 0x1000


def round_page(n: int) -> int:
  return (n + PAGE - 1) & ~(PAGE - 1)


class VaAllocator:
  def __init__(self, start: int, size: int, guard: int = PAGE):
    if start % PAGE or size % PAGE or size <= 0:
      raise ValueError(f"VA window {start:#x}+{size:#x} is not whole pages")
    self.start, self.size, self.guard = start, size, guard
    self._free: list[tuple[int, int]] = [(start, size)]   # sorted by address, coalesced
    self.live: dict[int, int] = {}                          # start -> bytes reserved (guard included)

  def alloc(self, size: int, align: int = PAGE) -> int:
    need = round_page(size) + self.guard
    for i in range(len(self._free) - 1, -1, -1):   # highest block first
      s, n = self._free[i]
      a = (s + n - need) & ~(align - 1)
      if a >= s:
        rest = [r for r in ((s, a - s), (a + need, s + n - a - need)) if r[1] > 0]
        self._free[i:i + 1] = rest
        self.live[a] = need
        return a
    raise MemoryError(f"GPU VA window [{self.start:#x}, {self.start + self.size:#x}) has no free {need:#x}-byte range "
                      f"({len(self.live)} ranges live)")

  def free(self, addr: int) -> None:
    if (need := self.live.pop(addr, None)) is None:
      raise KeyError(f"GPU VA {addr:#x} was not allocated here")
    self._free.append((addr, need))
    self._free.sort()
    merged: list[tuple[int, int]] = []
    for s, n in self._free:
      if merged and merged[-1][0] + merged[-1][1] == s:
        merged[-1] = (merged[-1][0], merged[-1][1] + n)
      else:
        merged.append((s, n))
    self._free = merged

  @property
  def bytes_live(self) -> int:
    return sum(self.live.values())
