"""Camera frames as dma-bufs: PRIME import on the (emulated) render node and through the MSM interface, in both address modes.

The kernel's rule (docs/msm-kernel-rules.md, "PRIME import"): PRIME_FD_TO_HANDLE takes a dma-buf and nothing else (a memfd
or shm file is EINVAL, a closed fd EBADF); importing the same dma-buf again gives the same object back.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os

import pytest

import backend
from backend import uapi as u
from backend.emu import RenderNode, dmabuf
from backend.msm import ImportRefused

backend.install()
from tinygrad import Context, Device  # noqa: E402

_ids = itertools.count(500 + os.getpid() % 1000 * 10)
MODES = {"bind": dict(EMU_VM_BIND="1", MODELD_MSM_VM="bind"), "kernel": dict(EMU_VM_BIND="0", MODELD_MSM_VM="auto")}


def fresh_device(mode: str):
  env = {**MODES[mode], "MSM_WAIT_TIMEOUT_MS": "2000"}
  old = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    with Context(DEV="EMU+QCOM:IR3"):
      return Device[f"QCOM:{next(_ids)}"]
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def prime(node: RenderNode, fd: int) -> int:
  node.ioctl(u.DRM_IOCTL_PRIME_FD_TO_HANDLE, p := u.drm_prime_handle(fd=fd))
  return p.handle


def test_node_imports_dmabufs_and_refuses_other_files():
  node = RenderNode()
  frame = dmabuf.export(5000, "cam")
  plain = os.memfd_create("visionbuf_road_0", os.MFD_CLOEXEC)
  os.ftruncate(plain, 8192)
  try:
    for fd, code in ((plain, errno.EINVAL), (9999, errno.EBADF)):
      with pytest.raises(OSError) as e:
        prime(node, fd)
      assert e.value.errno == code
    h = prime(node, frame)
    assert prime(node, frame) == h and node.gem(h).size == 0x2000   # one object per dma-buf, whole pages
    with mmap.mmap(frame, 0x2000) as m:
      m[0x1000:0x1004] = b"\x11\x22\x33\x44"
      assert ctypes.string_at(node.gem(h).host + 0x1000, 4) == b"\x11\x22\x33\x44"   # the node sees the exporter's pages
    used = node.mem_used
    node.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=h))
    assert node.mem_used == used and node.live_handles == 0   # the exporter's memory, never counted as the node's
    assert prime(node, frame) != h   # closed: a new import makes a new object
  finally:
    os.close(frame)
    os.close(plain)
    node.close()


@pytest.mark.parametrize("mode", ["bind", "kernel"])
def test_imported_frame_is_read_by_the_gpu_and_freed_without_leaks(mode):
  """A GPU job waits on a value the camera wrote into the dma-buf: it retires only if the frame's GPU address maps the
  exporter's pages. Freed after its fence: handle, mapping, VA range and our CPU view all go."""
  dev = fresh_device(mode)
  it = dev.iface
  assert it.vm_mode == mode
  frame = dmabuf.export(1 << 16, "road")
  try:
    base = (it.fd.live_handles, len(it.va.live) if it.va else 0, len(it.fd.user_vm))
    gem = it.import_dmabuf(frame)
    assert it.import_dmabuf(frame) is gem and it.stats["import"] == 1   # once per buffer
    with mmap.mmap(frame, 1 << 16) as m:
      m[0x8000:0x8008] = (5).to_bytes(8, "little")
    assert ctypes.c_uint64.from_address(gem.cpu + 0x8000).value == 5   # our read-only view
    from tinygrad.runtime.support.hcq import HCQBuffer
    sig = dev.signal_t(base_buf=HCQBuffer(gem.iova + 0x8000, 8, meta=gem, owner=dev), virt=True)   # only its GPU address is used
    dev.hw_compute_queue_t().wait(sig, 5).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    dev.synchronize()
    if mode == "kernel":
      job = it.fd.submits[-1]
      assert job.bo_flags[job.handles.index(gem.handle)] == u.MSM_SUBMIT_BO_READ   # listed read-only
    del sig
    it.free(gem)
    assert not gem.freed   # two holds (two imports of the same buffer), one let go
    it.free(gem)
    assert gem.closed and not it.imports
    assert (it.fd.live_handles, len(it.va.live) if it.va else 0, len(it.fd.user_vm)) == base
  finally:
    os.close(frame)


def test_a_plain_memfd_is_refused_with_the_reason():
  dev = fresh_device("bind")
  plain = os.memfd_create("visionbuf_road_0", os.MFD_CLOEXEC)
  os.ftruncate(plain, 8192)
  try:
    with pytest.raises(ImportRefused, match="PRIME_FD_TO_HANDLE refused the frame's fd: Invalid argument"):
      dev.iface.import_dmabuf(plain)
    assert not dev.iface.imports
  finally:
    os.close(plain)


def test_a_frame_imported_again_while_its_last_job_runs_is_the_same_buffer():
  """Freed while a job still reads it (kept until its fence), then imported again: the kernel would hand back the same
  object, so the interface takes the waiting buffer back instead of mapping the object a second time."""
  dev = fresh_device("kernel")
  it = dev.iface
  frame = dmabuf.export(1 << 14, "road")
  try:
    gem = it.import_dmabuf(frame)
    from tinygrad.runtime.support.hcq import HCQBuffer
    sig = dev.signal_t(base_buf=HCQBuffer(gem.iova, 8, meta=gem, owner=dev), virt=True)
    it.fd.delay_jobs(0.3)
    dev.hw_compute_queue_t().wait(sig, 0).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    it.free(gem)
    assert gem.freed and not gem.closed
    assert it.import_dmabuf(frame) is gem and not gem.freed and it.stats["import"] == 1
    dev.synchronize()
    assert not gem.closed
    del sig
    it.free(gem)
    assert gem.closed and not it.imports
  finally:
    os.close(frame)
