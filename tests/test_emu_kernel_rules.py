"""The emulated render node against the msm kernel's rules (docs/msm-kernel-rules.md), case by case.

Every test drives the node through its ioctl entry point with the backend/uapi.py structs, as backend/msm.py does, and
quotes the rule it mirrors with @rule (test_every_rule_is_quoted_from_the_doc checks each quote is in the doc). A
rule the emulator breaks is a rule a test passes here and the car refuses (or the other way round).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tinygrad.runtime.autogen import mesa
from tinygrad.runtime.ops_qcom import pkt7_hdr, qreg

from backend import msm
from backend import uapi as u
from backend.emu import RenderNode
from backend.emu.node import FENCE_ID_MAX

DOC = Path(__file__).resolve().parents[1] / "docs" / "msm-kernel-rules.md"
RW = u.MSM_SUBMIT_BO_READ | u.MSM_SUBMIT_BO_WRITE
RULES: dict[str, str] = {}


def rule(text: str) -> Callable:
  """Names the doc's rule a test mirrors (quoted word for word, markdown backticks and all)."""
  def deco(fn):
    RULES[fn.__name__] = text
    fn.__doc__ = f"Kernel rule: {text}"
    return fn
  return deco


# *** PM4 the node executes ***

def pkt(op: int, *vals: int) -> list[int]:
  return [pkt7_hdr(op, len(vals)), *vals]


def write_ts(addr: int, value: int) -> list[int]:
  """CACHE_FLUSH_TS: writes `value` to `addr` when the job gets there."""
  return pkt(mesa.CP_EVENT_WRITE, qreg.cp_event_write_0(event=mesa.CACHE_FLUSH_TS), addr & 0xffffffff, addr >> 32, value)


def wait_ge(addr: int, ref: int) -> list[int]:
  return pkt(mesa.CP_WAIT_REG_MEM, qreg.cp_wait_reg_mem_0(function=mesa.WRITE_GE, poll=mesa.POLL_MEMORY), addr & 0xffffffff, addr >> 32, ref,
             0xffffffff, 32)


def deadline(ms: float) -> u.drm_msm_timespec:
  return u.drm_msm_timespec(*divmod(time.clock_gettime_ns(time.CLOCK_MONOTONIC) + int(ms * 1e6), 1_000_000_000))


class Client:
  """One process's file on the node: the ioctls msm.py sends, with every field settable."""

  def __init__(self, **kw):
    self.n = RenderNode(**kw)
    self.cpu: dict[int, int] = {}
    self.iova: dict[int, int] = {}

  def call(self, req: int, arg) -> None:
    self.n.ioctl(req, arg)

  def errno_of(self, req: int, arg) -> int:
    with pytest.raises(OSError) as e:
      self.n.ioctl(req, arg)
    return e.value.errno

  def new(self, size: int = 0x1000, flags: int = u.MSM_BO_WC) -> int:
    self.call(u.DRM_IOCTL_MSM_GEM_NEW, g := u.drm_msm_gem_new(size=size, flags=flags))
    self.call(u.DRM_IOCTL_MSM_GEM_INFO, off := u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_GET_OFFSET))
    self.call(u.DRM_IOCTL_MSM_GEM_INFO, iova := u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_GET_IOVA))
    self.cpu[g.handle] = self.n.mmap(0, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, off.value)
    self.iova[g.handle] = iova.value
    return g.handle

  def u32(self, handle: int, off: int = 0) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(self.cpu[handle] + off)

  def put(self, handle: int, off: int, dwords: list[int]) -> None:
    (ctypes.c_uint32 * len(dwords)).from_address(self.cpu[handle] + off)[:] = dwords

  def submit_args(self, bos: list[tuple[int, int]], cmds: list[dict], flags: int = u.MSM_PIPE_3D0 | u.MSM_SUBMIT_NO_IMPLICIT, queue: int = 0,
                  pad: int = 0) -> tuple[u.drm_msm_gem_submit, tuple]:
    table = (u.drm_msm_gem_submit_bo * max(1, len(bos)))(*[u.drm_msm_gem_submit_bo(flags=f, handle=h) for f, h in bos])
    cmdv = (u.drm_msm_gem_submit_cmd * max(1, len(cmds)))(*[u.drm_msm_gem_submit_cmd(**{"type": u.MSM_SUBMIT_CMD_BUF, **c}) for c in cmds])
    s = u.drm_msm_gem_submit(flags=flags, queueid=queue, nr_bos=len(bos), bos=ctypes.addressof(table), nr_cmds=len(cmds),
                             cmds=ctypes.addressof(cmdv), pad=pad)
    return s, (table, cmdv)   # the arrays must outlive the ioctl

  def submit(self, bos: list[tuple[int, int]], cmds: list[dict], **kw) -> int:
    s, keep = self.submit_args(bos, cmds, **kw)
    self.call(u.DRM_IOCTL_MSM_GEM_SUBMIT, s)
    return s.fence

  def submit_errno(self, bos: list[tuple[int, int]], cmds: list[dict], **kw) -> int:
    s, keep = self.submit_args(bos, cmds, **kw)
    return self.errno_of(u.DRM_IOCTL_MSM_GEM_SUBMIT, s)

  def wait(self, fence: int, queue: int = 0, ms: float = 500, flags: int = 0) -> None:
    self.call(u.DRM_IOCTL_MSM_WAIT_FENCE, u.drm_msm_wait_fence(fence=fence, flags=flags, queueid=queue, timeout=deadline(ms)))

  def faults(self, queue: int = 0) -> int:
    n = ctypes.c_uint32()
    self.call(u.DRM_IOCTL_MSM_SUBMITQUEUE_QUERY, u.drm_msm_submitqueue_query(data=ctypes.addressof(n), id=queue, param=0, len=4))
    return n.value


@pytest.fixture
def c():
  cl = Client()
  yield cl
  cl.n.close()


def test_every_rule_is_quoted_from_the_doc():
  """Each @rule quote is the doc's own words, so a test cannot cite a rule the kernel facts do not state."""
  doc = re.sub(r"\s+", " ", DOC.read_text())
  missing = {name: text for name, text in RULES.items() if re.sub(r"\s+", " ", text) not in doc}
  assert not missing and len(RULES) >= 20, missing


# *** GEM ***

@rule("GEM_NEW takes exactly one cache mode, one of WC, CACHED, CACHED_COHERENT or UNCACHED. Zero or two modes give EINVAL.")
def test_gem_new_needs_exactly_one_cache_mode(c):
  for mode in (u.MSM_BO_WC, u.MSM_BO_CACHED, u.MSM_BO_CACHED_COHERENT, u.MSM_BO_UNCACHED):
    c.call(u.DRM_IOCTL_MSM_GEM_NEW, ok := u.drm_msm_gem_new(size=0x1000, flags=mode | u.MSM_BO_GPU_READONLY))
    assert ok.handle > 0
  live = c.n.live_handles
  for bad in (0, u.MSM_BO_GPU_READONLY, u.MSM_BO_WC | u.MSM_BO_CACHED, u.MSM_BO_CACHED_COHERENT | u.MSM_BO_UNCACHED):
    assert c.errno_of(u.DRM_IOCTL_MSM_GEM_NEW, u.drm_msm_gem_new(size=0x1000, flags=bad)) == errno.EINVAL, hex(bad)
  assert c.n.live_handles == live   # nothing was created by a refused call


@rule("GEM_INFO with a non-zero `pad` gives EINVAL")
def test_gem_info_pad(c):
  h = c.new()
  for info in (u.MSM_INFO_GET_OFFSET, u.MSM_INFO_GET_IOVA, u.MSM_INFO_GET_FLAGS):
    assert c.errno_of(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=h, info=info, pad=1)) == errno.EINVAL


@rule("GEM_INFO with a non-zero `len` on a value query gives EINVAL")
def test_gem_info_len_on_value_queries(c):
  h = c.new()
  for info in (u.MSM_INFO_GET_OFFSET, u.MSM_INFO_GET_IOVA, u.MSM_INFO_GET_FLAGS):
    assert c.errno_of(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=h, info=info, len=8)) == errno.EINVAL
  c.call(u.DRM_IOCTL_MSM_GEM_INFO, f := u.drm_msm_gem_info(handle=h, info=u.MSM_INFO_GET_FLAGS))
  assert f.value == u.MSM_BO_WC


@rule("GEM_INFO on an unknown handle gives ENOENT")
def test_gem_info_bad_handle_is_enoent(c):
  h = c.new()
  assert c.errno_of(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=h + 100, info=u.MSM_INFO_GET_IOVA)) == errno.ENOENT
  c.call(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=h))
  assert c.errno_of(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=h, info=u.MSM_INFO_GET_OFFSET)) == errno.ENOENT
  # the argument checks come before the lookup: pad on a bad handle is still EINVAL
  assert c.errno_of(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=h, info=u.MSM_INFO_GET_OFFSET, pad=1)) == errno.EINVAL


@rule("CPU_PREP gives EINVAL for unknown `op` bits and ENOENT for an unknown handle")
def test_cpu_prep_op_bits_and_bad_handle(c):
  h = c.new()
  for op in (u.MSM_PREP_READ, u.MSM_PREP_WRITE | u.MSM_PREP_BOOST, u.MSM_PREP_READ | u.MSM_PREP_NOSYNC):
    c.call(u.DRM_IOCTL_MSM_GEM_CPU_PREP, u.drm_msm_gem_cpu_prep(handle=h, op=op, timeout=deadline(100)))
  for op in (0x10, u.MSM_PREP_READ | 0x80000000):
    assert c.errno_of(u.DRM_IOCTL_MSM_GEM_CPU_PREP, u.drm_msm_gem_cpu_prep(handle=h, op=op, timeout=deadline(100))) == errno.EINVAL
  assert c.errno_of(u.DRM_IOCTL_MSM_GEM_CPU_PREP, u.drm_msm_gem_cpu_prep(handle=h + 7, op=u.MSM_PREP_READ, timeout=deadline(100))) == errno.ENOENT


@rule("SET_IOVA needs per-process page tables; without them it gives EOPNOTSUPP")
def test_set_iova_without_per_process_pagetables():
  legacy = Client(per_process_pgtables=False)
  try:
    legacy.call(u.DRM_IOCTL_MSM_GEM_NEW, g := u.drm_msm_gem_new(size=0x1000, flags=u.MSM_BO_WC))
    info = u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_SET_IOVA, value=0x1_8000_0000)
    assert legacy.errno_of(u.DRM_IOCTL_MSM_GEM_INFO, info) == errno.EOPNOTSUPP
  finally:
    legacy.n.close()


def _range_taken(start: int, size: int) -> bool:
  """Whether this process already maps something in [start, start + size) (another emulated node's window)."""
  for line in open("/proc/self/maps"):
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    if lo < start + size and start < hi:
      return True
  return False


@rule("The VA_START/VA_SIZE params exist from about 5.19 and give EINVAL without per-process page tables. On a630 they read 0x1_0000_0000 and 4 GiB")
def test_va_params(c):
  got = []
  for p in (u.MSM_PARAM_VA_START, u.MSM_PARAM_VA_SIZE):
    c.call(u.DRM_IOCTL_MSM_GET_PARAM, a := u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=p))
    got.append(a.value)
  # the emulator reserves the kernel's range; if another emulated node of this process holds it, its window moves (and says so)
  assert got == [c.n.window.start, 4 << 30] and (got[0] == 0x1_0000_0000 or _range_taken(0x1_0000_0000, 4 << 30))
  legacy = Client(per_process_pgtables=False)
  try:
    for p in (u.MSM_PARAM_VA_START, u.MSM_PARAM_VA_SIZE):
      assert legacy.errno_of(u.DRM_IOCTL_MSM_GET_PARAM, u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=p)) == errno.EINVAL
    # and the MSM interface takes that as "the kernel does not say", not as a failure to open
    it = _iface(legacy.n)
    assert it.va_range is None
  finally:
    legacy.n.close()


# *** GET_PARAM ***

@rule("GPU_ID reads 630. CHIP_ID reads 0x06030001 or 0x06030002, so compare it shifted right by 8")
def test_get_param_pad_len_and_ids(c):
  c.call(u.DRM_IOCTL_MSM_GET_PARAM, gpu := u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_GPU_ID))
  c.call(u.DRM_IOCTL_MSM_GET_PARAM, chip := u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_CHIP_ID))
  assert gpu.value == 630 and chip.value >> 8 == 0x060300
  for bad in (u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_GPU_ID, pad=1),
              u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_GPU_ID, len=8)):
    assert c.errno_of(u.DRM_IOCTL_MSM_GET_PARAM, bad) == errno.EINVAL
  other = RenderNode(chip_id=0x06030002)   # the other a630 revision: the MSM interface takes it too
  try:
    assert _iface(other).gpu_id == (6, 3, 0)
  finally:
    other.close()


@rule("PRIORITIES is rings × 3. a630 has one ring, so it reads 3")
def test_priorities(c):
  c.call(u.DRM_IOCTL_MSM_GET_PARAM, p := u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_PRIORITIES))
  assert p.value == 3


# *** submitqueues ***

@rule("A prio of PRIORITIES or more gives EINVAL")
def test_submitqueue_prio_range(c):
  for prio in (0, 1, 2):
    c.call(u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, q := u.drm_msm_submitqueue(prio=prio))
    assert q.id > 0
  for prio in (3, 0xffffffff):
    assert c.errno_of(u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, u.drm_msm_submitqueue(prio=prio)) == errno.EINVAL


@rule("a630 cannot preempt: `MSM_SUBMITQUEUE_ALLOW_PREEMPT` gives EINVAL")
def test_submitqueue_no_preemption(c):
  assert c.errno_of(u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, u.drm_msm_submitqueue(prio=2, flags=u.MSM_SUBMITQUEUE_ALLOW_PREEMPT)) == errno.EINVAL


@rule("An unknown queue id gives ENOENT, in SUBMIT, WAIT_FENCE, QUERY and CLOSE alike")
def test_bad_queue_id_is_enoent(c):
  cmd = c.new()
  c.put(cmd, 0, pkt(mesa.CP_WAIT_FOR_IDLE))
  assert c.submit([(RW, cmd)], [dict(submit_idx=0, size=4)], queue=0) == 1   # queue 0 exists from open
  n = ctypes.c_uint32()
  assert c.submit_errno([(RW, cmd)], [dict(submit_idx=0, size=4)], queue=42) == errno.ENOENT
  assert c.errno_of(u.DRM_IOCTL_MSM_WAIT_FENCE, u.drm_msm_wait_fence(fence=1, queueid=42, timeout=deadline(10))) == errno.ENOENT
  assert c.errno_of(u.DRM_IOCTL_MSM_SUBMITQUEUE_QUERY, u.drm_msm_submitqueue_query(data=ctypes.addressof(n), id=42, len=4)) == errno.ENOENT
  assert c.errno_of(u.DRM_IOCTL_MSM_SUBMITQUEUE_CLOSE, ctypes.c_uint32(42)) == errno.ENOENT


@rule("SUBMITQUEUE_QUERY is a write-direction ioctl, so `len` is never copied back to userspace")
def test_submitqueue_query_does_not_copy_len_back(c):
  buf = (ctypes.c_uint32 * 2)(0xaaaaaaaa, 0xbbbbbbbb)
  c.call(u.DRM_IOCTL_MSM_SUBMITQUEUE_QUERY, q := u.drm_msm_submitqueue_query(data=ctypes.addressof(buf), id=0, len=8))
  assert q.len == 8 and list(buf) == [0, 0xbbbbbbbb]   # 4 bytes of faults written, len left as the caller set it
  c.call(u.DRM_IOCTL_MSM_SUBMITQUEUE_QUERY, q0 := u.drm_msm_submitqueue_query(data=ctypes.addressof(buf), id=0, len=0))
  assert q0.len == 0


# *** GEM_SUBMIT ***

def _one(c: Client) -> tuple[int, int]:
  """A command BO holding one valid packet, and a signal BO."""
  cmd, sig = c.new(), c.new()
  c.put(cmd, 0, write_ts(c.iova[sig], 7))
  return cmd, sig


@rule("Any non-zero pad gives EINVAL")
def test_submit_pad(c):
  cmd, sig = _one(c)
  assert c.submit_errno([(RW, cmd), (RW, sig)], [dict(submit_idx=0, size=20)], pad=1) == errno.EINVAL
  assert c.n.stats.submits == 0


@rule("`MSM_SUBMIT_SUDO` without CAP_SYS_RAWIO gives EINVAL")
def test_submit_sudo(c):
  cmd, sig = _one(c)
  flags = u.MSM_PIPE_3D0 | u.MSM_SUBMIT_SUDO
  assert c.submit_errno([(RW, cmd), (RW, sig)], [dict(submit_idx=0, size=20)], flags=flags) == errno.EINVAL
  assert c.n.stats.submits == 0


@rule("Unknown flag bits give EINVAL.")
def test_submit_unknown_flags(c):
  cmd, sig = _one(c)
  for flags in (u.MSM_PIPE_3D0 | 0x01000000, u.MSM_PIPE_3D0 | 0x00100000):
    assert c.submit_errno([(RW, cmd), (RW, sig)], [dict(submit_idx=0, size=20)], flags=flags) == errno.EINVAL
  assert c.submit([(RW, cmd), (RW, sig)], [dict(submit_idx=0, size=20)], flags=u.MSM_PIPE_3D0) == 1   # implicit sync is a valid choice


@rule("Every BO entry needs READ, WRITE or both. Flags 0, or DUMP with nothing else, give EINVAL.")
def test_bo_entry_needs_read_or_write(c):
  cmd, sig = _one(c)
  for bad in (0, u.MSM_SUBMIT_BO_DUMP, u.MSM_SUBMIT_BO_NO_IMPLICIT, u.MSM_SUBMIT_BO_DUMP | u.MSM_SUBMIT_BO_NO_IMPLICIT):
    assert c.submit_errno([(RW, cmd), (bad, sig)], [dict(submit_idx=0, size=20)]) == errno.EINVAL, hex(bad)
    assert c.submit_errno([(bad, cmd), (RW, sig)], [dict(submit_idx=0, size=20)]) == errno.EINVAL, hex(bad)
  assert c.n.stats.submits == 0
  good = (u.MSM_SUBMIT_BO_READ, u.MSM_SUBMIT_BO_WRITE, RW, u.MSM_SUBMIT_BO_READ | u.MSM_SUBMIT_BO_DUMP, RW | u.MSM_SUBMIT_BO_NO_IMPLICIT)
  for i, ok in enumerate(good):
    c.wait(c.submit([(u.MSM_SUBMIT_BO_READ, cmd), (ok, sig)], [dict(submit_idx=0, size=20)]))
    assert c.faults() == 0, (i, c.n.stats.faults)
  assert c.u32(sig).value == 7


@rule("A BO listed twice fails with EALREADY from the locking code, not with EINVAL.")
def test_duplicate_bo_is_ealready(c):
  cmd, sig = _one(c)
  assert c.submit_errno([(RW, cmd), (RW, sig), (u.MSM_SUBMIT_BO_READ, sig)], [dict(submit_idx=0, size=20)]) == errno.EALREADY
  assert c.submit_errno([(RW, cmd), (RW, cmd)], [dict(submit_idx=0, size=20)]) == errno.EALREADY
  # the table's own checks come first: a bad entry behind a duplicate is still EINVAL
  assert c.submit_errno([(RW, cmd), (RW, cmd), (0, sig)], [dict(submit_idx=0, size=20)]) == errno.EINVAL
  assert c.n.stats.submits == 0


@rule("An unaligned `submit_offset` is rounded down to a dword, not refused")
def test_unaligned_offset_is_truncated(c):
  cmd, sig = c.new(), c.new()
  c.put(cmd, 0x100, write_ts(c.iova[sig], 0x5a))
  for off in (0x101, 0x102, 0x103):
    c.u32(sig).value = 0
    c.wait(c.submit([(RW, cmd), (RW, sig)], [dict(submit_idx=0, submit_offset=off, size=20)]))
    assert c.u32(sig).value == 0x5a and c.faults() == 0, off   # ran from 0x100
  assert c.n.submits[-1].cmds == ((cmd, 0x103, 20),)


@rule("A command that runs past its BO gives EINVAL, as do size 0 and relocs (a6xx)")
def test_command_range_size_and_relocs(c):
  cmd, sig = c.new(), c.new()
  c.put(cmd, 0x1000 - 20, write_ts(c.iova[sig], 3))
  bos = [(RW, cmd), (RW, sig)]
  for bad in (dict(submit_offset=0x1000 - 16, size=20), dict(submit_offset=0x1000, size=4), dict(submit_offset=0, size=0x1004),
              dict(submit_offset=0, size=0), dict(submit_offset=0x1000 - 20, size=20, nr_relocs=1), dict(submit_idx=2, size=20)):
    assert c.submit_errno(bos, [{"submit_idx": 0, **bad}]) == errno.EINVAL, bad
  assert c.n.stats.submits == 0
  c.wait(c.submit(bos, [dict(submit_idx=0, submit_offset=0x1000 - 20, size=20)]))   # ending exactly at the BO's end is inside it
  assert c.u32(sig).value == 3


@rule("CMD_BUF, IB_TARGET_BUF and CTX_RESTORE_BUF are all accepted")
def test_command_types(c):
  cmd, sig = c.new(), c.new()
  c.put(cmd, 0x000, write_ts(c.iova[sig] + 0, 1))    # CTX_RESTORE_BUF
  c.put(cmd, 0x100, write_ts(c.iova[sig] + 4, 2))    # IB_TARGET_BUF
  c.put(cmd, 0x200, write_ts(c.iova[sig] + 8, 3))    # CMD_BUF
  cmds = [dict(type=u.MSM_SUBMIT_CMD_CTX_RESTORE_BUF, submit_idx=0, submit_offset=0, size=20),
          dict(type=u.MSM_SUBMIT_CMD_IB_TARGET_BUF, submit_idx=0, submit_offset=0x100, size=20),
          dict(type=u.MSM_SUBMIT_CMD_BUF, submit_idx=0, submit_offset=0x200, size=20)]
  c.wait(c.submit([(RW, cmd), (RW, sig)], cmds))
  # how a6xx emits them: an IB_TARGET_BUF is only reached through another IB, never run from the ring; a CTX_RESTORE_BUF runs
  # when the ring switches to this file's context, i.e. on its first submit here (one file, so only then)
  assert [c.u32(sig, o).value for o in (0, 4, 8)] == [1, 0, 3] and c.faults() == 0
  c.u32(sig).value = 0
  c.wait(c.submit([(RW, cmd), (RW, sig)], cmds))
  assert c.u32(sig).value == 0 and c.u32(sig, 4).value == 0 and c.faults() == 0
  for bad in (0, 4, 0x10001):
    assert c.submit_errno([(RW, cmd), (RW, sig)], [dict(type=bad, submit_idx=0, submit_offset=0x200, size=20)]) == errno.EINVAL


@rule("The hardware IB size is a 20-bit dword count, and the kernel does not check it, so an oversized IB is the caller's bug.")
def test_ib_over_20_bits_is_accepted_and_runs_short(c):
  size = 4 << 20   # exactly 2**20 dwords: the CP keeps 20 bits of the count, i.e. 0
  cmd, sig = c.new(size + 0x1000), c.new()
  c.put(cmd, 0, write_ts(c.iova[sig], 9))
  f = c.submit([(RW, cmd), (RW, sig)], [dict(submit_idx=0, size=size)])
  c.wait(f)
  assert c.u32(sig).value == 0 and c.faults() == 0   # accepted and retired, but the packet at its head never ran


# *** fences ***

@rule("Fence ids are per queue and come from a cyclic allocator over 1..INT_MAX, so compare them wrap-aware")
def test_fence_ids_wrap_after_int_max():
  cl = Client(first_fence=FENCE_ID_MAX - 1)
  try:
    cmd, sig = _one(cl)
    fences = [cl.submit([(RW, cmd), (RW, sig)], [dict(submit_idx=0, size=20)]) for _ in range(3)]
    assert fences == [0x7ffffffe, 0x7fffffff, 1]
    cl.call(u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, q := u.drm_msm_submitqueue(prio=2))
    assert cl.submit([(RW, cmd), (RW, sig)], [dict(submit_idx=0, size=20)], queue=q.id) == FENCE_ID_MAX - 1   # per queue
    cl.wait(1)
    cl.wait(0x7ffffffe)   # older than the newest across the wrap: retired, so 0 at once
    assert cl.errno_of(u.DRM_IOCTL_MSM_WAIT_FENCE, u.drm_msm_wait_fence(fence=2, timeout=deadline(10))) == errno.EINVAL
  finally:
    cl.n.close()


@rule("WAIT_FENCE takes an absolute CLOCK_MONOTONIC deadline, and a deadline in the past just polls. A retired id returns 0 immediately. "
      "An id beyond the last submitted one gives EINVAL, and so do unknown flags")
def test_wait_fence_rules(c):
  cmd, sig = c.new(), c.new()
  c.put(cmd, 0, wait_ge(c.iova[sig] + 8, 1) + write_ts(c.iova[sig], 1))
  parked = c.submit([(RW, cmd), (RW, sig)], [dict(submit_idx=0, size=len(wait_ge(0, 0) + write_ts(0, 0)) * 4)])
  t = time.monotonic()
  assert c.errno_of(u.DRM_IOCTL_MSM_WAIT_FENCE, u.drm_msm_wait_fence(fence=parked, timeout=u.drm_msm_timespec(0, 0))) == errno.ETIMEDOUT
  assert time.monotonic() - t < 0.1   # a past deadline polls
  assert c.errno_of(u.DRM_IOCTL_MSM_WAIT_FENCE, u.drm_msm_wait_fence(fence=parked + 1, timeout=deadline(10))) == errno.EINVAL
  for flags in (2, 0x80000000):
    assert c.errno_of(u.DRM_IOCTL_MSM_WAIT_FENCE, u.drm_msm_wait_fence(fence=parked, flags=flags, timeout=deadline(10))) == errno.EINVAL
  c.u32(sig, 8).value = 1
  c.wait(parked, flags=u.MSM_WAIT_FENCE_BOOST)
  assert c.u32(sig).value == 1
  c.call(u.DRM_IOCTL_MSM_WAIT_FENCE, u.drm_msm_wait_fence(fence=parked, timeout=u.drm_msm_timespec(0, 0)))   # retired: 0 even past the deadline


# *** the MSM interface's side of the same rules ***

def _iface(node: RenderNode) -> msm.MSMIface:
  class Iface(msm.MSMIface):
    def _open(self):
      return node, node.path
  return Iface(None)


@rule("EINTR (from an interruptible lock) comes back before anything is queued. Retry it; no job was lost")
def test_msm_retries_a_submit_interrupted_before_queueing(monkeypatch):
  node = RenderNode()
  try:
    it = _iface(node)
    cmd, sig = it.alloc(0x1000), it.alloc(0x1000)
    (ctypes.c_uint32 * 5).from_address(cmd.cpu)[:] = write_ts(sig.iova, 4)
    node.inject("GEM_SUBMIT", errno.EINTR, count=2)
    it.enqueue(job := it.job(cmd, 0, 20, [sig]))
    node.inject("GEM_SUBMIT", errno.EAGAIN, count=1)
    it.enqueue(job2 := it.job(cmd, 0, 20, [sig]))
    it.wait_job(job2)
    assert (job.fence, job2.fence) == (1, 2) and node.stats.submits == 2 and it.stats["submit_retries"] == 3 and not it.stats["submit_errors"]
    assert ctypes.c_uint32.from_address(sig.cpu).value == 4
    node.inject("GEM_SUBMIT", errno.EINVAL, count=1)   # a real refusal is not retried
    with pytest.raises(msm.MSMFault):
      it.enqueue(it.job(cmd, 0, 20, [sig]))
    assert node.stats.submits == 2 and it.stats["submit_errors"] == 1
  finally:
    node.close()


@rule("The hardware IB size is a 20-bit dword count, and the kernel does not check it, so an oversized IB is the caller's bug.")
def test_msm_refuses_an_ib_over_20_bits_before_the_kernel():
  node = RenderNode()
  try:
    it = _iface(node)
    cmd = it.alloc(u.MSM_IB_MAX_BYTES + 0x2000)
    for size in (u.MSM_IB_MAX_BYTES + 4, 4 << 20):
      with pytest.raises(ValueError, match="does not fit one IB"):
        it.enqueue(it.job(cmd, 0, size, []))
    assert node.stats.submits == 0 and not it.pending and not it.inflight
    it.pump = lambda: None   # the largest IB the field holds passes the check (not run: a million dwords of PM4 is slow here)
    it.enqueue(job := it.job(cmd, 0, u.MSM_IB_MAX_BYTES, []))
    assert list(it.pending) == [job]
    it.pending.clear()
  finally:
    node.close()


@rule("Fence ids are per queue and come from a cyclic allocator over 1..INT_MAX, so compare them wrap-aware")
def test_msm_fence_compare_is_wrap_aware(monkeypatch):
  # across INT_MAX -> 1 the newer job must not be taken as retired: a plain or 32-bit compare would read its results early
  monkeypatch.setenv("MSM_INFLIGHT", "2")
  node = RenderNode(first_fence=FENCE_ID_MAX)
  try:
    it = _iface(node)
    cmd, sig = it.alloc(0x1000), it.alloc(0x1000)
    a = write_ts(sig.iova, 1)
    b = wait_ge(sig.iova + 8, 1) + write_ts(sig.iova + 4, 2)
    (ctypes.c_uint32 * len(a)).from_address(cmd.cpu)[:] = a
    (ctypes.c_uint32 * len(b)).from_address(cmd.cpu + 0x100)[:] = b
    it.enqueue(ja := it.job(cmd, 0, len(a) * 4, [sig]))
    it.enqueue(jb := it.job(cmd, 0x100, len(b) * 4, [sig]))
    assert (ja.fence, jb.fence) == (FENCE_ID_MAX, 1) and len(it.inflight) == 2
    it.wait_fence(ja.fence)
    assert it.retired == FENCE_ID_MAX and not it.is_retired(jb.fence) and list(it.inflight) == [jb]
    with pytest.raises(msm.MSMTimeout):
      it.wait_fence(jb.fence, timeout_ms=30)
    sig_free = it.alloc(0x1000)
    it.free(sig_free)   # never submitted (fence 0): closes at once whatever the queue's position
    assert sig_free.closed
    ctypes.c_uint32.from_address(sig.cpu + 8).value = 1
    it.wait_fence(jb.fence)
    assert it.retired == 1 and it.is_retired(ja.fence) and it.is_retired(jb.fence) and not it.inflight
    assert ctypes.c_uint32.from_address(sig.cpu + 4).value == 2
    it.free(sig)
    assert sig.closed   # listed last by fence 1, which retired after the wrap
  finally:
    node.close()


def test_fence_after():
  assert msm.fence_after(2, 1) and not msm.fence_after(1, 2) and not msm.fence_after(5, 5)
  assert msm.fence_after(1, 0x7fffffff) and not msm.fence_after(0x7fffffff, 1)   # across the allocator's wrap
  assert msm.fence_after(3, 0x7ffffff0) and msm.fence_after(1 + (1 << 30) - 1, 1) and not msm.fence_after(1 + (1 << 30), 1)   # half a cycle
  assert msm.fence_after(1, 0) and not msm.fence_after(0, 1) and not msm.fence_after(0, 0)   # 0: never submitted
