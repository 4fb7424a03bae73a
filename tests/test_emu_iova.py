"""The emulated GPU VA window (backend/emu/iova.py) on its own: where it is reserved, how it is protected, and its
first-fit allocator's edges (page rounding, alignment gaps, an exact fit, exact SET_IOVA ranges, coalescing on release).

The render node's tests allocate a few pages from the bottom of a 4 GiB window and never reach an edge; here windows are
small, so every boundary is one page away."""
from __future__ import annotations

import pytest

from backend.emu import iova
from backend.emu.iova import PAGE, IovaWindow

# far from the default window (0x1_0000_0000) and from where the kernel puts mappings of its own choice
BASE = 0x5a_0000_0000


def _maps_line(addr: int) -> str | None:
  with open("/proc/self/maps") as f:
    for line in f:
      lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
      if lo <= addr < hi:
        return line
  return None


@pytest.fixture
def win():
  w = IovaWindow(BASE, 16 * PAGE)
  yield w
  w.close()


def test_window_is_reserved_where_asked_with_no_access(win):
  assert (win.start, win.size) == (BASE, 16 * PAGE)
  line = _maps_line(BASE)
  assert line is not None and line.split()[1] == "---p", line   # a GPU address used as a CPU pointer faults
  assert _maps_line(BASE + 16 * PAGE - 1) is not None


def test_the_default_window_is_4_gib_at_4_gib():
  if _maps_line(0x1_0000_0000) is not None or _maps_line(0x1_ffff_ffff) is not None:
    pytest.skip("this process already holds the default window (a render node left open)")
  w = IovaWindow()
  try:
    assert (w.start, w.size) == (0x1_0000_0000, 1 << 32)
  finally:
    w.close()


def test_a_taken_start_moves_the_window_elsewhere(win):
  other = IovaWindow(BASE, 16 * PAGE)
  try:
    assert other.start != BASE and other.size == 16 * PAGE
    assert other.start + other.size <= BASE or other.start >= BASE + 16 * PAGE   # no overlap with the first
  finally:
    other.close()


def test_a_kernel_that_ignores_the_hint_is_unmapped_and_asked_again(monkeypatch):
  """Kernels before 4.17 ignore MAP_FIXED_NOREPLACE and may map elsewhere: that mapping is given back, then a free spot asked."""
  real, calls = iova.libc, []

  class OldKernel:
    def mmap(self, addr, size, prot, flags, fd, off):
      calls.append(("mmap", addr, flags & iova.MAP_FIXED_NOREPLACE))
      if flags & iova.MAP_FIXED_NOREPLACE:   # the hint ignored: somewhere else
        return real.mmap(0, size, prot, flags & ~iova.MAP_FIXED_NOREPLACE, fd, off)
      return real.mmap(addr, size, prot, flags, fd, off)

    def munmap(self, addr, size):
      calls.append(("munmap", addr, size))
      return real.munmap(addr, size)

  monkeypatch.setattr(iova, "libc", OldKernel())
  w = IovaWindow(BASE, 4 * PAGE)
  try:
    (_, _, fixed), (op, stray, n), (op2, hint, fixed2) = calls
    assert fixed and (op, n) == ("munmap", 4 * PAGE) and stray != BASE and (op2, hint, fixed2) == ("mmap", 0, 0)
    assert w.start != BASE and _maps_line(w.start) is not None
  finally:
    w.close()


def test_a_window_that_cannot_be_reserved_is_an_oserror():
  with pytest.raises(OSError, match="cannot reserve a 0x4000000000000000-byte emulated VA window"):
    IovaWindow(BASE, 1 << 62)


def test_close_unmaps_once():
  w = IovaWindow(BASE, 4 * PAGE)
  w.close()
  assert _maps_line(BASE) is None and w.size == 0
  w.close()   # again: nothing to unmap


def test_sizes_round_up_to_pages_and_allocation_is_first_fit(win):
  a = win.alloc(1)
  b = win.alloc(PAGE)
  c = win.alloc(PAGE + 1)
  d = win.alloc(PAGE)
  assert (a, b, c, d) == (BASE, BASE + PAGE, BASE + 2 * PAGE, BASE + 4 * PAGE)
  win.release(b, 1)                       # a partial page frees the whole page
  assert win.alloc(PAGE) == b             # the first hole that fits, not the end
  win.release(c, PAGE + 1)
  assert win.alloc(2 * PAGE) == c         # both pages of c came back


def test_alignment_leaves_the_gap_before_it_free(win):
  win.alloc(PAGE)
  big = win.alloc(PAGE, align=4 * PAGE)
  assert big == BASE + 4 * PAGE
  assert [win.alloc(PAGE) for _ in range(3)] == [BASE + PAGE, BASE + 2 * PAGE, BASE + 3 * PAGE]   # the gap, in order
  assert win.alloc(PAGE) == BASE + 5 * PAGE


def test_an_exact_fit_takes_the_window_and_one_more_page_is_refused(win):
  assert win.alloc(16 * PAGE) == BASE
  with pytest.raises(MemoryError, match=r"exhausted \(0x1000 bytes requested\)"):
    win.alloc(1)
  win.release(BASE, 16 * PAGE)
  with pytest.raises(MemoryError):
    win.alloc(17 * PAGE)
  assert win.alloc(15 * PAGE) == BASE and win.alloc(PAGE) == BASE + 15 * PAGE


def test_an_aligned_block_must_fit_after_its_alignment(win):
  win.alloc(PAGE)
  win.take(BASE + 8 * PAGE, 8 * PAGE)               # free: pages 1..7
  with pytest.raises(MemoryError):
    win.alloc(PAGE, align=8 * PAGE)                 # the next 8-page boundary is past the free block
  assert win.alloc(4 * PAGE, align=4 * PAGE) == BASE + 4 * PAGE   # ends exactly at the free block's end
  assert win.alloc(3 * PAGE) == BASE + PAGE       # and the pages below its alignment are still one block


def test_take_reserves_exactly_its_range(win):
  win.take(BASE + 4 * PAGE, 2 * PAGE)
  assert [win.alloc(PAGE) for _ in range(5)] == [BASE, BASE + PAGE, BASE + 2 * PAGE, BASE + 3 * PAGE, BASE + 6 * PAGE]
  win.take(BASE + 15 * PAGE, PAGE)          # ends at the window's end
  win.take(BASE + 7 * PAGE, PAGE)           # starts where a free block starts
  assert win.alloc(7 * PAGE) == BASE + 8 * PAGE
  with pytest.raises(MemoryError):
    win.alloc(PAGE)


@pytest.mark.parametrize("addr,size", [
  (BASE + 2 * PAGE, PAGE),            # in use
  (BASE + 2 * PAGE, 2 * PAGE),        # half in use
  (BASE + 15 * PAGE, 2 * PAGE),       # runs past the window
  (BASE - PAGE, 2 * PAGE),            # starts before it
  (BASE + 16 * PAGE, PAGE),           # just after it
])
def test_take_refuses_a_range_not_wholly_free(win, addr, size):
  win.alloc(3 * PAGE)
  with pytest.raises(ValueError, match="is not free in the VA window"):
    win.take(addr, size)
  win.take(BASE + 3 * PAGE, 12 * PAGE)      # the refusal took nothing
  assert win.alloc(PAGE) == BASE + 15 * PAGE


def test_released_neighbours_coalesce_in_any_order(win):
  blocks = [win.alloc(4 * PAGE) for _ in range(4)]
  for i in (2, 0, 3, 1):                    # middle, first, last, the one joining them all
    win.release(blocks[i], 4 * PAGE)
  assert win.alloc(16 * PAGE) == BASE       # one block again


def test_a_floor_keeps_the_bottom_of_the_window_unused():
  w = IovaWindow(BASE, 16 * PAGE, floor=3 * PAGE)
  try:
    assert w.alloc(PAGE) == BASE + 3 * PAGE
    with pytest.raises(MemoryError):
      w.alloc(13 * PAGE)
  finally:
    w.close()
  w = IovaWindow(BASE, 16 * PAGE, floor=1)   # less than a page still keeps the first page's start off
  try:
    assert w.alloc(PAGE) == BASE + PAGE
  finally:
    w.close()
