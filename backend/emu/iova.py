"""The emulated GPU VA window: reserved PROT_NONE in this process, so a GPU address used as a CPU pointer faults at once."""
from __future__ import annotations

import ctypes
import mmap

from tinygrad.runtime.autogen import libc

MAP_NORESERVE, MAP_FIXED_NOREPLACE = 0x4000, 0x100000
PAGE, PROT_NONE = 0x1000, 0
_FAILED = 0xffffffffffffffff


class IovaWindow:
  """A PROT_NONE reservation plus a first-fit allocator over it (freed ranges coalesce)."""

  def __init__(self, want_start: int = 0x1_0000_0000, size: int = 1 << 32, floor: int = 0):
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    addr = libc.mmap(want_start, size, PROT_NONE, flags | MAP_FIXED_NOREPLACE, -1, 0)
    if addr == _FAILED or addr != want_start:  # taken (another emulated node): let the kernel pick a free spot
      if addr != _FAILED:
        libc.munmap(addr, size)
      addr = libc.mmap(0, size, PROT_NONE, flags, -1, 0)
      if addr == _FAILED:
        raise OSError(ctypes.get_errno(), f"cannot reserve a {size:#x}-byte emulated VA window")
    self.start, self.size = addr, size
    self._free: list[tuple[int, int]] = [(addr, size)]
    # allocations start `floor` bytes in, so that a pointer's low dword is never a small integer (see the strict pointer scan)
    if 0 < floor < size:
      self.take(addr, floor)

  def alloc(self, size: int, align: int = PAGE) -> int:
    size = (size + PAGE - 1) & ~(PAGE - 1)
    for i, (s, n) in enumerate(self._free):
      a = (s + align - 1) & ~(align - 1)
      if a + size <= s + n:
        rest = [(s, a - s)] if a > s else []
        if a + size < s + n:
          rest.append((a + size, s + n - a - size))
        self._free[i:i + 1] = rest
        return a
    raise MemoryError(f"emulated VA window exhausted ({size:#x} bytes requested)")

  def take(self, addr: int, size: int) -> None:
    """Reserve exactly [addr, addr+size) (SET_IOVA); ValueError when any of it is in use or outside the window."""
    for i, (s, n) in enumerate(self._free):
      if s <= addr and addr + size <= s + n:
        self._free[i:i + 1] = [r for r in ((s, addr - s), (addr + size, s + n - addr - size)) if r[1] > 0]
        return
    raise ValueError(f"{addr:#x}+{size:#x} is not free in the VA window")

  def release(self, addr: int, size: int) -> None:
    size = (size + PAGE - 1) & ~(PAGE - 1)
    self._free.append((addr, size))
    self._free.sort()
    merged: list[tuple[int, int]] = []
    for s, n in self._free:
      if merged and merged[-1][0] + merged[-1][1] == s:
        merged[-1] = (merged[-1][0], merged[-1][1] + n)
      else:
        merged.append((s, n))
    self._free = merged

  def close(self) -> None:
    if self.size:
      libc.munmap(self.start, self.size)
    self.size = 0
