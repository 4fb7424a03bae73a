"""backend/va.py, the VM_BIND address allocator: page-aligned ranges, a guard page after each, top down, reuse after free."""
import pytest

from backend.va import PAGE, VaAllocator

START, SIZE = 0x1_0000_0000, 64 * PAGE


def test_ranges_are_page_aligned_top_down_and_guarded():
  va = VaAllocator(START, SIZE)
  a = va.alloc(100)
  b = va.alloc(PAGE + 1)
  assert a == START + SIZE - 2 * PAGE            # one page of data, one of guard, at the top
  assert b == a - 3 * PAGE                        # two pages + guard, right below
  assert a % PAGE == 0 and b % PAGE == 0 and b + 2 * PAGE < a   # a gap (the guard) between b's end and a
  assert va.bytes_live == 5 * PAGE


def test_freed_ranges_coalesce_and_are_reused():
  va = VaAllocator(START, SIZE)
  xs = [va.alloc(PAGE) for _ in range(4)]
  for x in xs:
    va.free(x)
  assert not va.live and va.alloc(SIZE - PAGE) == START   # the whole window again, in one piece
  with pytest.raises(KeyError):
    va.free(xs[1])


def test_exhaustion_and_bad_windows_are_clear():
  va = VaAllocator(START, 4 * PAGE)
  va.alloc(PAGE)
  with pytest.raises(MemoryError, match="no free 0x3000-byte range"):
    va.alloc(2 * PAGE)
  with pytest.raises(ValueError, match="not whole pages"):
    VaAllocator(START + 1, SIZE)
