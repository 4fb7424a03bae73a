"""A bounds check of an unpacked capnp message's pointers, done in Python on the raw bytes.

Why not pycapnp's `total_size` or `as_builder()`: pycapnp 2.x declares them without C++ exception translation, so on a
corrupt pointer the kj exception reaches std::terminate and the whole process aborts (found by testing/fuzz.py: one
flipped bit in a liveDelay message killed the reader). Field getters do translate, so once every pointer is known to
land inside its segment, reads can only raise KjException (e.g. a list where a struct is expected), which callers catch.

The walk also bounds the work: a message whose pointers revisit the same data (amplification) or nest deeper than
capnp's default limit is refused instead of making the reader spin.
"""
from __future__ import annotations

import struct

NESTING_LIMIT = 64
_ELEM_BITS = (0, 1, 8, 16, 32, 64, 64, 0)   # list element sizes in bits; 6 = pointer, 7 = inline composite


class CorruptMessage(ValueError):
  pass


def check_pointers(dat: bytes) -> None:
  """Raise CorruptMessage unless every pointer reachable from the root lands inside its segment."""
  if len(dat) < 8 or len(dat) % 8:
    raise CorruptMessage(f"{len(dat)} bytes is not a capnp message")
  nseg = struct.unpack_from("<I", dat, 0)[0] + 1
  head = (4 * (nseg + 1) + 7) // 8 * 8
  if nseg > 512 or head > len(dat):
    raise CorruptMessage(f"segment table of {nseg} segments does not fit")
  sizes = struct.unpack_from(f"<{nseg}I", dat, 4)
  if head + 8 * sum(sizes) > len(dat):
    raise CorruptMessage(f"segments of {sum(sizes)} words do not fit in {len(dat)} bytes")
  words = memoryview(dat)[head:head + 8 * sum(sizes)].cast("Q")
  starts, pos = [], 0
  for s in sizes:
    starts.append(pos)
    pos += s
  if not sizes[0]:
    raise CorruptMessage("empty root segment")
  _Walk(words, starts, sizes).pointer(0, 0, 0)


class _Walk:
  # methods, not nested closures: closures calling each other form a reference cycle that holds `words` and with it the
  # whole message, and serve runs with gc disabled (like openpilot), so every received message stayed (~9.5 KB/frame)
  def __init__(self, words: memoryview, starts: list[int], sizes: tuple[int, ...]):
    self.words, self.starts, self.sizes, self.nseg = words, starts, sizes, len(sizes)
    self.budget = 8 * len(words) + 1024   # words a reader may visit: more than this is pointer amplification

  def visit(self, n: int) -> None:
    self.budget -= max(n, 1)
    if self.budget < 0:
      raise CorruptMessage("pointers revisit the same data (amplification)")

  def inside(self, seg: int, at: int, n: int) -> None:
    if at < 0 or n < 0 or at + n > self.sizes[seg]:
      raise CorruptMessage(f"pointer to words {at}..{at + n} outside segment {seg} of {self.sizes[seg]} words")

  def content(self, seg: int, target: int, ref: int, depth: int) -> None:
    """The struct or list `ref` describes, starting at word `target` of segment `seg`."""
    kind = ref & 3
    if kind == 0:
      dw, pc = (ref >> 32) & 0xFFFF, ref >> 48
      self.inside(seg, target, dw + pc)
      self.visit(dw + pc)
      for i in range(pc):
        self.pointer(seg, target + dw + i, depth + 1)
    elif kind == 1:
      es, count = (ref >> 32) & 7, ref >> 35
      if es == 7:
        self.inside(seg, target, count + 1)
        tag = self.words[self.starts[seg] + target]
        if tag & 3:
          raise CorruptMessage("inline composite list tag is not a struct")
        n, dw, pc = (tag >> 2) & 0x3FFFFFFF, (tag >> 32) & 0xFFFF, tag >> 48
        if n * (dw + pc) > count:
          raise CorruptMessage("inline composite list elements overrun the list")
        self.visit(count + n)
        for e in range(n if pc else 0):
          for i in range(pc):
            self.pointer(seg, target + 1 + e * (dw + pc) + dw + i, depth + 1)
      else:
        self.inside(seg, target, (count * _ELEM_BITS[es] + 63) // 64)
        self.visit(count if es == 6 else (count * _ELEM_BITS[es] + 63) // 64)
        if es == 6:
          for i in range(count):
            self.pointer(seg, target + i, depth + 1)
    else:
      raise CorruptMessage("far pointer landing pad names a far pointer")

  def pointer(self, seg: int, at: int, depth: int) -> None:
    if depth > NESTING_LIMIT:
      raise CorruptMessage(f"nesting deeper than {NESTING_LIMIT}")
    ref = self.words[self.starts[seg] + at]
    if ref == 0:
      return
    kind = ref & 3
    if kind == 3:
      # a capability, or no pointer at all: openpilot's schemas hold no interfaces, and copying one aborts pycapnp
      raise CorruptMessage("capability pointer in a data-only message")
    if kind == 2:
      double, pad, tseg = (ref >> 2) & 1, (ref >> 3) & 0x1FFFFFFF, ref >> 32
      if tseg >= self.nseg:
        raise CorruptMessage(f"far pointer to segment {tseg} of {self.nseg}")
      self.inside(tseg, pad, 2 if double else 1)
      self.visit(1)
      if not double:
        if self.words[self.starts[tseg] + pad] & 3 == 2:
          raise CorruptMessage("far pointer landing pad is another far pointer")
        return self.pointer(tseg, pad, depth)
      land, tag = self.words[self.starts[tseg] + pad], self.words[self.starts[tseg] + pad + 1]
      if land & 7 != 2:
        raise CorruptMessage("double-far landing pad is not a single far pointer")
      cseg = land >> 32
      if cseg >= self.nseg:
        raise CorruptMessage(f"far pointer to segment {cseg} of {self.nseg}")
      return self.content(cseg, (land >> 3) & 0x1FFFFFFF, tag, depth)
    off = (ref >> 2) & 0x3FFFFFFF
    off = off - (1 << 30) if off & (1 << 29) else off
    self.content(seg, at + 1 + off, ref, depth)

