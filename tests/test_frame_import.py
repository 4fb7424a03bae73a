"""modeld's camera frames on QCOM: a VisionIPC buffer backed by a dma-buf is imported once and used in place (no copy); one
the kernel refuses is copied, with the reason logged once. On the emulated node, in both GPU address modes."""
from __future__ import annotations

import logging
import mmap
import os

import numpy as np
import pytest
from test_backend_dmabuf import fresh_device

from backend.emu import dmabuf
from modeld_msm.frame_tensors import FrameTensors
from selfdrive_glue import visionipc
from selfdrive_glue.nv12 import nv12_info

INFO = nv12_info(64, 32)


def camera_buffer(fd: int) -> tuple[mmap.mmap, np.ndarray]:
  m = mmap.mmap(fd, INFO.size + 8)
  return m, np.frombuffer(m, dtype=np.uint8, count=INFO.size)


@pytest.mark.parametrize("mode", ["bind", "kernel"])
def test_dmabuf_frames_are_imported_once_and_never_copied(mode, caplog):
  dev = fresh_device(mode)
  ft = FrameTensors(dev.device, INFO)
  fd = dmabuf.export(INFO.size + 8, "road0")
  m, data = camera_buffer(fd)
  visionipc.register_dmabuf(data, fd)
  try:
    t = ft.get("road", data, upload=True)
    gem = t.uop.buffer._buf.meta
    assert gem.imported is not None and dev.iface.stats["import"] == 1 and dev.iface.gem_at(t.uop.buffer._buf.va_addr) is gem
    copies = dev.iface.stats["submits"]
    assert ft.get("road", data, upload=True) is t and dev.iface.stats["import"] == 1   # the same buffer next time: no work at all
    assert dev.iface.stats["submits"] == copies and not caplog.records
    del t
    ft._tensors.clear()
    dev.synchronize()
    assert gem.closed   # the tensor gone: the import is released (after its last fence)
  finally:
    visionipc._DMABUF_FDS.pop(data.ctypes.data, None)
    del data
    m.close()
    os.close(fd)


def test_a_refused_import_falls_back_to_copies_and_says_why_once(caplog):
  dev = fresh_device("bind")
  ft = FrameTensors(dev.device, INFO)
  fd = os.memfd_create("visionbuf_road_0", os.MFD_CLOEXEC)   # what the PC camera server hands out: not a dma-buf
  os.ftruncate(fd, INFO.size + 8)
  m, data = camera_buffer(fd)
  visionipc.register_dmabuf(data, fd)
  try:
    with caplog.at_level(logging.INFO, logger="modeld"):
      data[:] = 7
      t = ft.get("road", data, upload=True)
      assert t.uop.buffer._buf.meta.imported is None and int(t[:4].numpy().sum()) == 28   # a device copy of the frame
      data[:] = 9
      ft.get("road", data, upload=True)
      assert int(t[:4].numpy().sum()) == 36   # refreshed by the copy each step
    warn = [r.getMessage() for r in caplog.records if "copied into GPU memory" in r.getMessage()]
    assert len(warn) == 1 and "PRIME_FD_TO_HANDLE refused the frame's fd: Invalid argument" in warn[0]
    assert ft.import_refused and not dev.iface.imports
  finally:
    visionipc._DMABUF_FDS.pop(data.ctypes.data, None)
    del data, t, m   # (numpy views of the mapping may outlive this test; the mapping goes with the last)
    os.close(fd)


def test_a_buffer_that_is_no_dma_buf_is_copied_and_says_so_once(caplog):
  dev = fresh_device("kernel")
  ft = FrameTensors(dev.device, INFO)
  frame = np.full(INFO.size, 3, np.uint8)   # not from VisionIPC at all (replay, a test): nothing to import
  with caplog.at_level(logging.INFO, logger="modeld"):
    t = ft.get("road", frame, upload=True)
    ft.get("road", frame, upload=True)
  assert int(t[:2].numpy().sum()) == 6 and not dev.iface.imports
  warn = [r.getMessage() for r in caplog.records if "copied into GPU memory" in r.getMessage()]
  assert len(warn) == 1 and "not a dma-buf" in warn[0]
  # such a buffer first (modeld's warm-up runs the warp on zeros) does not stop a camera dma-buf after it from being imported
  fd = dmabuf.export(INFO.size + 8, "road1")
  m, data = camera_buffer(fd)
  visionipc.register_dmabuf(data, fd)
  try:
    t2 = ft.get("road", data, upload=True)
    assert t2.uop.buffer._buf.meta.imported is not None and ft.import_refused is None
  finally:
    visionipc._DMABUF_FDS.pop(data.ctypes.data, None)
    del data, t2, m
    os.close(fd)
