"""Emulated dma-bufs for the emulated render node: memfds named so the node can tell them from plain memory.

The kernel's PRIME import (drm_gem_prime_fd_to_handle -> dma_buf_get) takes only a dma-buf file and refuses anything else
(a memfd, a shm file) with EINVAL. On a device camerad's frames are dma-bufs; on this box there is no exporter, so a
camera stand-in that wants its buffers importable makes them here. The mark is the memfd's name, which travels with the
fd to another process (SCM_RIGHTS), as being a dma-buf does.
"""
from __future__ import annotations

import os

PREFIX = "emu-dmabuf:"
PAGE = 0x1000


def export(size: int, name: str = "frame") -> int:
  """A new emulated dma-buf of `size` bytes (rounded up to whole pages, as dma-buf sizes are); the caller owns the fd."""
  fd = os.memfd_create(PREFIX + name, os.MFD_CLOEXEC)
  os.ftruncate(fd, (size + PAGE - 1) & ~(PAGE - 1))
  return fd


def is_dmabuf(fd: int) -> bool:
  try:
    target = os.readlink(f"/proc/self/fd/{fd}")
  except OSError:
    return False
  return target.startswith("/memfd:" + PREFIX)
