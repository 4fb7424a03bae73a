"""VM_BIND (msm 1.13, Linux 6.17+) as the kernel defines it, one test per rule of docs/msm-kernel-rules.md "VM_BIND".

Each test drives a render node through its ioctls with backend/uapi.py structs and quotes its rule with @rule (checked word
for word against our doc). Here the node is the emulated one with VM_BIND support; with DEV=MSM+QCOM on a vamOS device the
same tests open the real msm render node (each test its own file, so a test that poisons its VM harms no other), and
the few checks only the emulator can make (its fault log, its BO bookkeeping) are skipped there.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import mmap
import os
import re
import select
from collections.abc import Callable
from pathlib import Path

import pytest
from test_emu_kernel_rules import deadline, wait_ge, write_ts
from tinygrad.runtime.support.hcq import FileIOInterface

from backend import uapi as u
from backend.emu import RenderNode

pytestmark = pytest.mark.device
DOC = Path(__file__).resolve().parents[1] / "docs" / "msm-kernel-rules.md"
ON_DEVICE = os.environ.get("DEV", "").upper().startswith("MSM")
PAGE = 0x1000
RULES: dict[str, str] = {}
emu_only = pytest.mark.skipif(ON_DEVICE, reason="reads the emulated node's own bookkeeping")


def rule(text: str) -> Callable:
  def deco(fn):
    RULES[fn.__name__] = text
    fn.__doc__ = f"Kernel rule: {text}"
    return fn
  return deco


def open_node(**kw):
  """A fresh file on the node, with nothing asked of it yet (no GET_PARAM: that would make its VM)."""
  if not ON_DEVICE:
    return RenderNode(**{"vm_bind_supported": True, **kw})
  from backend.msm import drm_version
  for path in sorted(glob.glob("/dev/dri/renderD*")):
    fd = FileIOInterface(path, os.O_RDWR | os.O_CLOEXEC)
    if drm_version(fd)[0] == "msm":
      return fd
  pytest.skip("no msm render node")


class Client:
  def __init__(self, enable: bool = True, **kw):
    self.n = open_node(**kw)
    self.cpu: dict[int, int] = {}
    self.size: dict[int, int] = {}
    if enable:
      self.set_param(u.MSM_PARAM_EN_VM_BIND, 1)
    self.va_start, self.va_size = self.param(u.MSM_PARAM_VA_START), self.param(u.MSM_PARAM_VA_SIZE)
    self.next_va = self.va_start + (self.va_size // 2)
    self.bq = self.queue(u.MSM_SUBMITQUEUE_VM_BIND) if enable else 0

  def call(self, req: int, arg) -> None:
    self.n.ioctl(req, arg)

  def errno_of(self, req: int, arg) -> int:
    with pytest.raises(OSError) as e:
      self.n.ioctl(req, arg)
    return e.value.errno

  def param(self, p: int) -> int:
    self.call(u.DRM_IOCTL_MSM_GET_PARAM, a := u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=p))
    return a.value

  def set_param(self, p: int, value: int) -> None:
    self.call(u.DRM_IOCTL_MSM_SET_PARAM, u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=p, value=value))

  def queue(self, flags: int = 0, prio: int = 0) -> int:
    self.call(u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, q := u.drm_msm_submitqueue(flags=flags, prio=prio))
    return q.id

  def new(self, size: int = PAGE) -> int:
    self.call(u.DRM_IOCTL_MSM_GEM_NEW, g := u.drm_msm_gem_new(size=size, flags=u.MSM_BO_WC))
    self.call(u.DRM_IOCTL_MSM_GEM_INFO, off := u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_GET_OFFSET))
    self.cpu[g.handle] = self.n.mmap(0, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, off.value)
    self.size[g.handle] = size
    return g.handle

  def va(self, size: int = PAGE) -> int:
    a, self.next_va = self.next_va, self.next_va + size + PAGE
    return a

  def op(self, op: int, iova: int, rng: int, handle: int = 0, obj_offset: int = 0, flags: int = 0) -> u.drm_msm_vm_bind_op:
    return u.drm_msm_vm_bind_op(op=op, handle=handle, obj_offset=obj_offset, iova=iova, range=rng, flags=flags)

  def bind_args(self, ops: list[u.drm_msm_vm_bind_op], queue: int | None = None, flags: int = 0) -> tuple[u.drm_msm_vm_bind, object]:
    a = u.drm_msm_vm_bind(flags=flags, nr_ops=len(ops), queue_id=self.bq if queue is None else queue, fence_fd=-1,
                          op_stride=ctypes.sizeof(u.drm_msm_vm_bind_op))
    arr = (u.drm_msm_vm_bind_op * max(1, len(ops)))(*ops)
    if len(ops) == 1:
      a.op = ops[0]
    else:
      a.ops = ctypes.addressof(arr)
    return a, arr

  def bind(self, *ops: u.drm_msm_vm_bind_op, **kw) -> u.drm_msm_vm_bind:
    a, keep = self.bind_args(list(ops), **kw)
    self.call(u.DRM_IOCTL_MSM_VM_BIND, a)
    return a

  def bind_errno(self, *ops: u.drm_msm_vm_bind_op, **kw) -> int:
    a, keep = self.bind_args(list(ops), **kw)
    return self.errno_of(u.DRM_IOCTL_MSM_VM_BIND, a)

  def map(self, handle: int, iova: int | None = None, rng: int | None = None, obj_offset: int = 0) -> int:
    iova = self.va(rng or self.size[handle]) if iova is None else iova
    self.bind(self.op(u.MSM_VM_BIND_OP_MAP, iova, rng or self.size[handle], handle, obj_offset))
    return iova

  def u32(self, handle: int, off: int = 0) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(self.cpu[handle] + off)

  def submit_args(self, cmds: list[dict], queue: int = 0) -> tuple[u.drm_msm_gem_submit, object]:
    cmdv = (u.drm_msm_gem_submit_cmd * max(1, len(cmds)))()
    for i, c in enumerate(cmds):
      cmdv[i].type = c.get("type", u.MSM_SUBMIT_CMD_BUF)
      cmdv[i].submit_idx, cmdv[i].submit_offset = c.get("submit_idx", 0), c.get("submit_offset", 0)
      cmdv[i].size, cmdv[i].nr_relocs = c["size"], c.get("nr_relocs", 0)
      cmdv[i].iova = c["iova"]
    table = (u.drm_msm_gem_submit_bo * 1)()
    s = u.drm_msm_gem_submit(flags=u.MSM_PIPE_3D0 | u.MSM_SUBMIT_NO_IMPLICIT, queueid=queue, nr_bos=0, bos=ctypes.addressof(table),
                             nr_cmds=len(cmds), cmds=ctypes.addressof(cmdv))
    return s, (cmdv, table)

  def run(self, dwords: list[int], queue: int = 0) -> int:
    """Puts the PM4 in a fresh mapped command BO and submits it by address; returns the fence."""
    cmd = self.new()
    (ctypes.c_uint32 * len(dwords)).from_address(self.cpu[cmd])[:] = dwords
    s, keep = self.submit_args([dict(iova=self.map(cmd), size=len(dwords) * 4)], queue)
    self.call(u.DRM_IOCTL_MSM_GEM_SUBMIT, s)
    return s.fence

  def wait(self, fence: int, queue: int = 0, ms: float = 2000) -> None:
    self.call(u.DRM_IOCTL_MSM_WAIT_FENCE, u.drm_msm_wait_fence(fence=fence, queueid=queue, timeout=deadline(ms)))

  def faults(self, queue: int = 0) -> int:
    n = ctypes.c_uint32()
    self.call(u.DRM_IOCTL_MSM_SUBMITQUEUE_QUERY, u.drm_msm_submitqueue_query(data=ctypes.addressof(n), id=queue, param=0, len=4))
    return n.value

  def close(self) -> None:
    if isinstance(self.n, RenderNode):
      self.n.close()
    else:
      os.close(self.n.fd)


@pytest.fixture
def c():
  cl = Client()
  yield cl
  cl.close()


def test_every_rule_is_quoted_from_the_doc():
  doc = re.sub(r"\s+", " ", DOC.read_text())
  missing = {name: text for name, text in RULES.items() if re.sub(r"\s+", " ", text) not in doc}
  assert not missing and len(RULES) >= 18, missing


# *** enabling it ***

@rule("SET_PARAM(EN_VM_BIND) is accepted only before the file's VM exists; after that it is EBUSY.")
def test_en_vm_bind_only_before_the_vm_exists():
  late = Client(enable=False)   # its GET_PARAMs (VA_START/VA_SIZE) made the VM
  try:
    assert late.errno_of(u.DRM_IOCTL_MSM_SET_PARAM, u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_EN_VM_BIND, value=1)) == errno.EBUSY
    # "Any GET_PARAM makes the file's VM, so EN_VM_BIND has to come before the first GET_PARAM (even GPU_ID)."
    first = Client.__new__(Client)
    first.n = open_node()
    first.param(u.MSM_PARAM_GPU_ID)
    assert first.errno_of(u.DRM_IOCTL_MSM_SET_PARAM, u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_EN_VM_BIND, value=1)) == errno.EBUSY
    first.close()
  finally:
    late.close()
  ok = Client()   # the same call as the first ioctl of a file is accepted
  assert ok.param(u.MSM_PARAM_GPU_ID) == 630
  ok.close()


RULES["test_en_vm_bind_only_before_the_vm_exists_getparam"] = ("Any GET_PARAM makes the file's VM, so EN_VM_BIND has to come before the first "
                                                               "GET_PARAM (even GPU_ID).")


@emu_only
@rule("Without per-process page tables, or on a kernel before VM_BIND (unknown param), EN_VM_BIND is EINVAL.")
def test_en_vm_bind_refused_by_older_kernels():
  for kw in (dict(vm_bind_supported=False), dict(per_process_pgtables=False)):
    n = RenderNode(**kw)
    with pytest.raises(OSError) as e:
      n.ioctl(u.DRM_IOCTL_MSM_SET_PARAM, u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_EN_VM_BIND, value=1))
    assert e.value.errno == errno.EINVAL
    n.close()


@rule("With VM_BIND on, GET_IOVA and SET_IOVA are EINVAL.")
def test_get_and_set_iova_refused_with_vm_bind(c):
  h = c.new()
  for info, value in ((u.MSM_INFO_GET_IOVA, 0), (u.MSM_INFO_SET_IOVA, c.va())):
    assert c.errno_of(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=h, info=info, value=value)) == errno.EINVAL


# *** queues ***

@rule("A VM_BIND queue needs a VM_BIND context and prio 0; anything else is EINVAL.")
def test_vm_bind_queue_kind(c):
  assert c.errno_of(u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, u.drm_msm_submitqueue(flags=u.MSM_SUBMITQUEUE_VM_BIND, prio=1)) == errno.EINVAL
  plain = Client(enable=False)
  assert plain.errno_of(u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, u.drm_msm_submitqueue(flags=u.MSM_SUBMITQUEUE_VM_BIND, prio=0)) == errno.EINVAL
  plain.close()
  # "VM_BIND on a queue that is not a VM_BIND queue is EINVAL, and so is GEM_SUBMIT on a VM_BIND queue; an unknown queue is ENOENT."
  h = c.new()
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, c.va(), PAGE, h), queue=0) == errno.EINVAL
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, c.va(), PAGE, h), queue=9999) == errno.ENOENT
  iova = c.map(h)
  s, keep = c.submit_args([dict(iova=iova, size=16)], queue=c.bq)
  assert c.errno_of(u.DRM_IOCTL_MSM_GEM_SUBMIT, s) == errno.EINVAL


RULES["test_vm_bind_queue_kind_2"] = ("VM_BIND on a queue that is not a VM_BIND queue is EINVAL, and so is GEM_SUBMIT on a VM_BIND queue; "
                                      "an unknown queue is ENOENT.")


@rule("VM_BIND from a context that did not enable it is EINVAL.")
def test_vm_bind_needs_a_vm_bind_context():
  plain = Client(enable=False)
  h = plain.new()
  a, keep = plain.bind_args([plain.op(u.MSM_VM_BIND_OP_MAP, plain.va(), PAGE, h)], queue=0)
  assert plain.errno_of(u.DRM_IOCTL_MSM_VM_BIND, a) == errno.EINVAL
  plain.close()


# *** ops ***

@rule("Each op's iova, obj_offset and range must be page aligned (EINVAL).")
def test_op_alignment(c):
  h = c.new(2 * PAGE)
  base = c.va(2 * PAGE)
  for iova, off, rng in ((base + 0x800, 0, PAGE), (base, 0x10, PAGE), (base, 0, PAGE + 4)):
    assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, iova, rng, h, off)) == errno.EINVAL
  c.map(h, base, PAGE, PAGE)   # aligned: accepted


@rule("Each op's range must lie inside the VM (VA_START .. VA_START + VA_SIZE) without overflow (EINVAL).")
def test_op_range_inside_the_vm(c):
  h = c.new()
  end = c.va_start + c.va_size
  for iova in (c.va_start - PAGE, end, (1 << 64) - PAGE):
    assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, iova, PAGE, h)) == errno.EINVAL
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_UNMAP, end - PAGE, 2 * PAGE)) == errno.EINVAL
  c.map(h, end - PAGE)   # the last page is inside
  c.map(h, c.va_start)   # and so is the first


@rule("MAP needs a handle, UNMAP and MAP_NULL must pass 0; an unknown op, unknown op flags or a handle the file does not have are EINVAL.")
def test_op_handles_ops_and_flags(c):
  h, iova = c.new(), c.va()
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, iova, PAGE, 0)) == errno.EINVAL
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_UNMAP, iova, PAGE, h)) == errno.EINVAL
  assert c.bind_errno(c.op(7, iova, PAGE)) == errno.EINVAL
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, iova, PAGE, h, flags=0x100)) == errno.EINVAL
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, iova, PAGE, h + 1000)) == errno.EINVAL
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, iova, PAGE, h), flags=0x80) == errno.EINVAL   # unknown ioctl flags
  c.bind(c.op(u.MSM_VM_BIND_OP_MAP, iova, PAGE, h, flags=u.MSM_VM_BIND_OP_DUMP))
  c.bind(c.op(u.MSM_VM_BIND_OP_UNMAP, iova, PAGE))


@rule("A MAP past the end of its object (obj_offset + range > size) is EINVAL (the later mainline check; 6.17 itself only warned).")
def test_op_object_bounds(c):
  h = c.new(2 * PAGE)
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, c.va(3 * PAGE), 3 * PAGE, h)) == errno.EINVAL
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, c.va(2 * PAGE), 2 * PAGE, h, PAGE)) == errno.EINVAL
  c.map(h, c.va(PAGE), PAGE, PAGE)


@rule("MAP_NULL needs PRR in the SMMU, which a630 lacks: EINVAL (the later mainline check).")
def test_map_null_needs_prr(c):
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP_NULL, c.va(), PAGE)) == errno.EINVAL


@rule("Every op is validated before the VM changes, so a refused VM_BIND changes nothing.")
def test_a_refused_bind_changes_nothing(c):
  sig = c.new()
  good = c.va()
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_MAP, good, PAGE, sig), c.op(u.MSM_VM_BIND_OP_MAP, good + 0x10, PAGE, sig)) == errno.EINVAL
  f = c.run(write_ts(good, 5))   # had the first op landed, this write would reach sig
  c.wait(f)
  assert c.u32(sig).value == 0
  if isinstance(c.n, RenderNode):
    assert c.n.stats.page_faults >= 1


@rule("A MAP over mapped addresses replaces what was there, and an UNMAP of part of a mapping keeps the rest mapped at its offsets.")
def test_map_replaces_and_unmap_splits(c):
  a, b = c.new(3 * PAGE), c.new()
  base = c.map(a)                      # a's three pages at base
  c.map(b, base + PAGE)                # b replaces the middle page
  c.wait(c.run(write_ts(base, 1) + write_ts(base + PAGE, 2) + write_ts(base + 2 * PAGE, 3)))
  assert (c.u32(a).value, c.u32(a, PAGE).value, c.u32(a, 2 * PAGE).value, c.u32(b).value) == (1, 0, 3, 2)
  c.bind(c.op(u.MSM_VM_BIND_OP_UNMAP, base, PAGE))   # cut the first page off: the third stays, still at a's offset 2 pages
  c.wait(c.run(write_ts(base, 7) + write_ts(base + 2 * PAGE + 4, 8)))
  assert c.u32(a).value == 1 and c.u32(a, 2 * PAGE + 4).value == 8


# *** submits ***

@rule("With VM_BIND, a command names its range by `cmd.iova`: `submit_idx` and `submit_offset` must be 0 and relocs are EINVAL.")
def test_submit_commands_by_iova(c):
  cmd, sig = c.new(), c.new()
  ci, si = c.map(cmd), c.map(sig)
  prog = write_ts(si, 4)
  (ctypes.c_uint32 * len(prog)).from_address(c.cpu[cmd] + 0x100)[:] = prog
  for bad in (dict(submit_idx=1), dict(submit_offset=0x100), dict(nr_relocs=1)):
    s, keep = c.submit_args([dict(iova=ci + 0x100, size=len(prog) * 4, **bad)])
    assert c.errno_of(u.DRM_IOCTL_MSM_GEM_SUBMIT, s) == errno.EINVAL
  s, keep = c.submit_args([dict(iova=ci + 0x100, size=len(prog) * 4)])
  c.call(u.DRM_IOCTL_MSM_GEM_SUBMIT, s)
  c.wait(s.fence)
  assert c.u32(sig).value == 4


@rule("A submit needs no BO table: the kernel validates the whole VM, so a job reaches every mapped page and nothing else; a job "
      "touching an unmapped address page-faults.")
def test_job_touching_an_unmapped_address_faults(c):
  sig = c.new()
  si = c.map(sig)
  hole = c.va()
  c.wait(c.run(write_ts(si, 1) + write_ts(hole, 2) + write_ts(si + 4, 3)))
  # the kernel's policy for a fault without a hang: the access is dropped, the job runs on, FAULTS does not move
  assert (c.u32(sig).value, c.u32(sig, 4).value, c.faults()) == (1, 3, 0)
  if isinstance(c.n, RenderNode):
    assert c.n.stats.page_faults == 1 and "no VM_BIND mapping" in c.n.stats.faults[-1]


@rule("A VM_BIND job waits only for the in-fences it is given, not for earlier GEM_SUBMITs: an UNMAP of a range a pending job uses "
      "takes effect at once and that job faults.")
def test_unmap_under_a_pending_job_faults_it(c):
  flag, victim = c.new(), c.new()
  fi, vi = c.map(flag), c.map(victim)
  f = c.run(wait_ge(fi, 1) + write_ts(vi, 0x77))   # parked on the flag: pending, and it will write into victim
  c.bind(c.op(u.MSM_VM_BIND_OP_UNMAP, vi, PAGE))    # accepted at once, nothing waits for the job
  c.u32(flag).value = 1
  c.wait(f)
  assert c.u32(victim).value == 0 and c.faults() == 0   # the write hit an unmapped page and was dropped
  if isinstance(c.n, RenderNode):
    assert c.n.stats.page_faults == 1


@rule("A mapping holds a reference on its object: closing the handle of a mapped BO keeps its pages (and the mapping) alive until "
      "the UNMAP.")
def test_closed_handle_stays_mapped_until_unmap(c):
  sig = c.new()
  si = c.map(sig)
  c.call(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=sig))
  c.wait(c.run(write_ts(si, 9)))
  assert c.u32(sig).value == 9   # (our CPU mapping aliases the same pages)
  if isinstance(c.n, RenderNode):
    used = c.n.mem_used
    c.bind(c.op(u.MSM_VM_BIND_OP_UNMAP, si, PAGE))
    assert c.n.mem_used == used - PAGE   # the last reference went with the UNMAP


@emu_only
@rule("After a GPU hang the kernel marks a VM_BIND VM unusable: every later GEM_SUBMIT and VM_BIND is EPIPE.")
def test_hang_makes_the_vm_unusable(c):
  sig = c.new()
  si = c.map(sig)
  c.n.inject_gpu_fault("planted hang")
  c.wait(c.run(write_ts(si, 1)))
  assert c.faults() == 1 and c.u32(sig).value == 0
  assert c.bind_errno(c.op(u.MSM_VM_BIND_OP_UNMAP, si, PAGE)) == errno.EPIPE
  s, keep = c.submit_args([dict(iova=si, size=16)])
  assert c.errno_of(u.DRM_IOCTL_MSM_GEM_SUBMIT, s) == errno.EPIPE


@rule("VM_BIND with MSM_VM_BIND_FENCE_FD_OUT returns a sync_file fd that signals when the bind job ran; the caller closes it.")
def test_fence_fd_out_signals(c):
  h = c.new()
  a = c.bind(c.op(u.MSM_VM_BIND_OP_MAP, c.va(), PAGE, h), flags=u.MSM_VM_BIND_FENCE_FD_OUT)
  assert a.fence_fd >= 0
  p = select.poll()
  p.register(a.fence_fd, select.POLLIN)
  assert p.poll(2000)
  os.close(a.fence_fd)


@emu_only
def test_closing_the_node_releases_bos_only_mappings_kept():
  """Emulator bookkeeping (not a kernel rule): a BO whose handle was closed while mapped is freed with the file."""
  cl = Client()
  h = cl.new()
  cl.map(h)
  cl.call(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=h))
  gem_fd = next(iter(cl.n._by_offset.values())).memfd
  cl.close()
  with pytest.raises(OSError):
    os.fstat(gem_fd)   # its memfd closed
