"""The emulated render node on its own: GEM/mmap/IOVA, kernel-like submit checks, PM4 execution, fences, faults, strict mode."""
import ctypes
import errno
import mmap
import os
import subprocess
import sys
import textwrap
import time

import pytest
from tinygrad.runtime.autogen import mesa
from tinygrad.runtime.ops_qcom import pkt4_hdr, pkt7_hdr, qreg

from backend import uapi as u
from backend.emu import RenderNode


def pkt(op, *vals):
  return [pkt7_hdr(op, len(vals)), *vals]
def lohi(a):
  return [a & 0xffffffff, a >> 32]


class Node:
  """A RenderNode plus the few calls a test needs."""

  def __init__(self, **kw):
    self.n = RenderNode(**kw)
    self.maps = {}

  def new(self, size=0x1000):
    self.n.ioctl(u.DRM_IOCTL_MSM_GEM_NEW, g := u.drm_msm_gem_new(size=size, flags=u.MSM_BO_WC))
    self.n.ioctl(u.DRM_IOCTL_MSM_GEM_INFO, off := u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_GET_OFFSET))
    self.n.ioctl(u.DRM_IOCTL_MSM_GEM_INFO, iova := u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_GET_IOVA))
    cpu = self.n.mmap(0, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, off.value)
    self.maps[g.handle] = (cpu, iova.value, off.value)
    return g.handle, cpu, iova.value

  def u32(self, handle, off=0):
    return ctypes.c_uint32.from_address(self.maps[handle][0] + off)

  def submit(self, cmd_handle, dwords, handles, queue=0, flags=u.MSM_PIPE_3D0, bo_flags=u.MSM_SUBMIT_BO_READ | u.MSM_SUBMIT_BO_WRITE, offset=0,
             size=None):
    cpu = self.maps[cmd_handle][0]
    (ctypes.c_uint32 * len(dwords)).from_address(cpu + offset)[:] = dwords
    bos = (u.drm_msm_gem_submit_bo * len(handles))(*[u.drm_msm_gem_submit_bo(flags=bo_flags, handle=h) for h in handles])
    idx = handles.index(cmd_handle) if cmd_handle in handles else 0
    cmd = u.drm_msm_gem_submit_cmd(type=u.MSM_SUBMIT_CMD_BUF, submit_idx=idx, submit_offset=offset, size=len(dwords) * 4 if size is None else size)
    s = u.drm_msm_gem_submit(flags=flags, queueid=queue, nr_bos=len(handles), bos=ctypes.addressof(bos), nr_cmds=1, cmds=ctypes.addressof(cmd))
    self.n.ioctl(u.DRM_IOCTL_MSM_GEM_SUBMIT, s)
    return s.fence

  def wait(self, fence, queue=0, timeout_ms=200):
    dl = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + timeout_ms * 1_000_000
    self.n.ioctl(u.DRM_IOCTL_MSM_WAIT_FENCE, u.drm_msm_wait_fence(fence=fence, queueid=queue, timeout=u.drm_msm_timespec(*divmod(dl, 1_000_000_000))))

  def faults(self, queue=0):
    n = ctypes.c_uint32()
    self.n.ioctl(u.DRM_IOCTL_MSM_SUBMITQUEUE_QUERY, u.drm_msm_submitqueue_query(data=ctypes.addressof(n), id=queue, param=0, len=4))
    return n.value


@pytest.fixture
def node():
  n = Node()
  yield n
  n.n.close()


def flush_ts(addr, value):
  return pkt(mesa.CP_EVENT_WRITE, qreg.cp_event_write_0(event=mesa.CACHE_FLUSH_TS), *lohi(addr), value)
def wait_ge(addr, ref):
  return pkt(mesa.CP_WAIT_REG_MEM, qreg.cp_wait_reg_mem_0(function=mesa.WRITE_GE, poll=mesa.POLL_MEMORY), *lohi(addr), ref, 0xffffffff, 32)


def test_params_version_and_window(node):
  p = u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_CHIP_ID)
  node.n.ioctl(u.DRM_IOCTL_MSM_GET_PARAM, p)
  assert p.value == 0x06030001
  for bad in (u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=0x7f), u.drm_msm_param(pipe=0, param=u.MSM_PARAM_GPU_ID)):
    with pytest.raises(OSError) as e:
      node.n.ioctl(u.DRM_IOCTL_MSM_GET_PARAM, bad)
    assert e.value.errno == errno.EINVAL
  name = ctypes.create_string_buffer(8)
  node.n.ioctl(u.DRM_IOCTL_VERSION, v := u.drm_version(name_len=8, name=ctypes.addressof(name)))
  assert name.value == b"msm" and (v.version_major, v.version_minor) == (1, 12)
  _, _, iova = node.new()
  assert node.n.window.start <= iova < node.n.window.start + node.n.window.size


def test_cpu_mappings_alias_and_iova_is_not_cpu(node):
  h, cpu, iova = node.new()
  cpu2 = node.n.mmap(0, 0x1000, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, node.maps[h][2])
  ctypes.c_uint32.from_address(cpu).value = 0xdeadbeef
  assert ctypes.c_uint32.from_address(cpu2).value == 0xdeadbeef and cpu != iova


def test_cpu_write_through_iova_crashes():
  code = textwrap.dedent("""
    import ctypes, mmap
    from backend import uapi as u
    from backend.emu import RenderNode
    n = RenderNode()
    n.ioctl(u.DRM_IOCTL_MSM_GEM_NEW, g := u.drm_msm_gem_new(size=4096, flags=u.MSM_BO_WC))
    n.ioctl(u.DRM_IOCTL_MSM_GEM_INFO, i := u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_GET_IOVA))
    print("iova", hex(i.value), flush=True)
    ctypes.c_uint32.from_address(i.value).value = 1
    print("survived", flush=True)
  """)
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert "iova" in r.stdout and "survived" not in r.stdout and r.returncode == -11, (r.returncode, r.stdout, r.stderr[-500:])


def test_signal_and_in_order_fences(node):
  cmd, _, _ = node.new()
  sig, _, sig_iova = node.new()
  f1 = node.submit(cmd, flush_ts(sig_iova, 7), [cmd, sig])
  node.wait(f1)
  assert node.u32(sig).value == 7
  # a job parked on an unmet wait holds back the next one (one ring, in order)
  cmd2, _, _ = node.new()
  f2 = node.submit(cmd, wait_ge(sig_iova + 8, 5) + flush_ts(sig_iova, 8), [cmd, sig])
  f3 = node.submit(cmd2, flush_ts(sig_iova + 4, 9), [cmd2, sig])
  with pytest.raises(OSError) as e:
    node.wait(f3, timeout_ms=20)
  assert e.value.errno == errno.ETIMEDOUT and node.u32(sig, 4).value == 0
  node.u32(sig, 8).value = 5   # the CPU kicks after the submit, like HCQGraph
  node.wait(f3)
  assert (node.u32(sig).value, node.u32(sig, 4).value) == (8, 9) and f2 < f3
  with pytest.raises(OSError) as e:
    node.wait(f3 + 1)
  assert e.value.errno == errno.EINVAL


def test_timestamp_mem_write_and_indirect_buffer(node):
  cmd, _, cmd_iova = node.new()
  buf, _, buf_iova = node.new()
  ib = pkt(mesa.CP_MEM_WRITE, *lohi(buf_iova + 32), 0x11, 0x22)
  ts = pkt(mesa.CP_REG_TO_MEM, qreg.cp_reg_to_mem_0(reg=mesa.REG_A6XX_CP_ALWAYS_ON_COUNTER, cnt=2, _64b=True), *lohi(buf_iova + 8))
  main = [pkt4_hdr(0x1234, 2), 5, 6, *ts, *pkt(mesa.CP_INDIRECT_BUFFER, *lohi(cmd_iova + 0x800), len(ib))]
  (ctypes.c_uint32 * len(ib)).from_address(node.maps[cmd][0] + 0x800)[:] = ib
  node.wait(node.submit(cmd, main, [cmd, buf]))
  assert ctypes.c_uint64.from_address(node.maps[buf][0] + 8).value > 0
  assert (node.u32(buf, 32).value, node.u32(buf, 36).value) == (0x11, 0x22)
  assert node.n.executor.regs[0x1234] == 5 and node.n.executor.regs[0x1235] == 6


@pytest.mark.parametrize("case,err", [("dup", errno.EALREADY), ("closed", errno.EINVAL), ("boflags", errno.EINVAL), ("range", errno.EINVAL),
                                      ("align", errno.EINVAL), ("flags", errno.EINVAL), ("queue", errno.ENOENT), ("pipe", errno.EINVAL)])
def test_submit_validation(node, case, err):
  cmd, _, _ = node.new()
  other, _, _ = node.new()
  dw = flush_ts(node.maps[other][1], 1)
  kw = {"dup": dict(handles=[cmd, other, other]), "boflags": dict(bo_flags=0x100), "range": dict(offset=0xff0, size=0x20),
        "align": dict(size=6), "flags": dict(flags=u.MSM_PIPE_3D0 | 0x100000), "queue": dict(queue=9), "pipe": dict(flags=0x20)}.get(case, {})
  if case == "closed":
    node.n.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=other))
  with pytest.raises(OSError) as e:
    node.submit(cmd, dw if case != "range" else [], **{"handles": [cmd, other], **kw})
  assert e.value.errno == err
  assert node.n.stats.submits == 0


def test_submitqueue_priorities(node):
  node.n.ioctl(u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, q := u.drm_msm_submitqueue(prio=2))
  assert q.id > 0
  for bad in (u.drm_msm_submitqueue(prio=3), u.drm_msm_submitqueue(prio=0, flags=u.MSM_SUBMITQUEUE_ALLOW_PREEMPT)):
    with pytest.raises(OSError) as e:
      node.n.ioctl(u.DRM_IOCTL_MSM_SUBMITQUEUE_NEW, bad)
    assert e.value.errno == errno.EINVAL


def test_gem_close_keeps_backing_until_retired(node):
  cmd, _, _ = node.new()
  sig, _, sig_iova = node.new()
  victim, _, victim_iova = node.new()
  f = node.submit(cmd, wait_ge(sig_iova, 1) + flush_ts(victim_iova, 3), [cmd, sig, victim])
  node.n.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=victim))
  with pytest.raises(OSError):   # the handle is gone at once
    node.submit(cmd, flush_ts(victim_iova, 4), [cmd, victim], offset=0x100)
  node.u32(sig).value = 1
  node.wait(f)
  assert node.u32(victim).value == 3 and node.faults() == 0   # the pending job still wrote it
  assert node.n._by_iova.find(victim_iova) is None            # released after retirement


def test_strict_unlisted_and_freed():
  node = Node(fault_policy="strict")   # page faults counted like hangs, so the test sees them through FAULTS
  cmd, _, _ = node.new()
  sig, _, sig_iova = node.new()
  node.wait(node.submit(cmd, flush_ts(sig_iova, 1), [cmd]))
  assert node.faults() == 1 and f"handle {sig}" in node.n.stats.faults[-1] and "not listed" in node.n.stats.faults[-1]
  gone, _, gone_iova = node.new()
  node.n.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=gone))
  node.wait(node.submit(cmd, flush_ts(gone_iova, 1), [cmd]))
  assert node.faults() == 2 and "freed BO" in node.n.stats.faults[-1]
  lax = Node(strict=False)
  c2, _, _ = lax.new()
  s2, _, s2_iova = lax.new()
  lax.wait(lax.submit(c2, flush_ts(s2_iova, 5), [c2]))   # like the kernel: an unlisted but mapped BO works by luck
  assert lax.faults() == 0 and lax.u32(s2).value == 5
  lax.n.close()
  node.n.close()


def test_page_fault_without_hang_is_not_counted_kernel_rule():
  """msm-kernel-rules.md, "Faults: what userspace can see": SUBMITQUEUE_QUERY FAULTS rises only when the kernel recovers
  from a hang (recover_worker); a page fault that does not hang (fault_worker) is logged, the job retires as if fine and
  the counter does not move. The default node does the same; only its stats (the kernel's log) know."""
  node = Node()
  assert node.n.fault_policy == "kernel"
  cmd, _, _ = node.new()
  sig, _, sig_iova = node.new()
  gone, _, gone_iova = node.new()
  node.n.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=gone))
  f1 = node.submit(cmd, flush_ts(sig_iova, 1), [cmd])                   # a listed-BO violation (strict BO validation)
  f2 = node.submit(cmd, flush_ts(gone_iova, 1), [cmd], offset=0x100)    # a freed BO: an SMMU fault on a real a630
  node.wait(f2)   # the fence retires without an error
  assert f1 < f2 and node.faults() == 0
  p = u.drm_msm_param(pipe=u.MSM_PIPE_3D0, param=u.MSM_PARAM_FAULTS)
  node.n.ioctl(u.DRM_IOCTL_MSM_GET_PARAM, p)
  assert p.value == 0
  assert len(node.n.stats.faults) == 2 and not node.n.stats.reported
  assert all("page fault, no hang (not reported)" in x for x in node.n.stats.faults) and "freed BO" in node.n.stats.faults[-1]
  node.n.inject_gpu_fault("planted hang")   # a hang is counted under either policy
  node.wait(node.submit(cmd, flush_ts(sig_iova, 1), [cmd, sig], offset=0x200))
  assert node.faults() == 1 and node.n.stats.reported == [node.n.stats.faults[-1]] and "planted hang" in node.n.stats.reported[-1]
  node.n.close()


def test_page_fault_drops_the_access_and_the_job_runs_on(capsys):
  """Kernel policy: the GPU resumes after a page fault, so the job's later packets (its signal write) still happen and the CPU's
  wait on that signal returns; the kernel's log (stderr here, like dmesg) has the line. Strict ends the job there, counted."""
  for policy, counted, signalled in (("kernel", 0, 7), ("strict", 1, 0)):
    node = Node(fault_policy=policy)
    cmd, _, _ = node.new()
    sig, _, sig_iova = node.new()
    gone, _, gone_iova = node.new()
    node.n.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=gone))
    node.wait(node.submit(cmd, flush_ts(gone_iova, 1) + flush_ts(sig_iova, 7), [cmd, sig]))
    assert (node.faults(), node.u32(sig).value) == (counted, signalled), policy
    assert "freed BO" in node.n.stats.faults[-1]
    node.n.close()
  err = capsys.readouterr().err
  assert err.count("[emu dmesg] *** gpu fault") == 1 and "not counted in FAULTS" in err


def test_cp_fetch_fault_is_a_hang_under_either_policy():
  """The CP cannot run past a fault on its own fetch (an IB in a freed BO): the ring stalls and hangcheck recovers it, counted."""
  for policy in ("kernel", "strict"):
    node = Node(fault_policy=policy)
    cmd, _, _ = node.new()
    sig, _, sig_iova = node.new()
    gone, _, gone_iova = node.new()
    node.n.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=gone))
    node.wait(node.submit(cmd, pkt(mesa.CP_INDIRECT_BUFFER, *lohi(gone_iova), 4) + flush_ts(sig_iova, 7), [cmd, sig]))
    assert node.faults() == 1 and node.u32(sig).value == 0, policy
    assert "indirect buffer" in node.n.stats.reported[-1] and "a hang" in node.n.stats.reported[-1]
    node.n.close()


def test_page_fault_log_is_bounded(capsys):
  """A fault every frame for hours must not grow the node's log or flood stderr (the kernel rate-limits its messages too)."""
  node = Node()
  node.n.stats.keep = 10
  cmd, _, _ = node.new()
  gone, _, gone_iova = node.new()
  node.n.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=gone))
  for _ in range(40):
    node.wait(node.submit(cmd, flush_ts(gone_iova, 1), [cmd]))
  assert node.n.stats.page_faults == 40 and len(node.n.stats.faults) == 10 and node.faults() == 0
  assert capsys.readouterr().err.count("[emu dmesg]") == 5
  node.n.close()


def test_strict_fault_policy_from_env(monkeypatch):
  monkeypatch.setenv("EMU_STRICT_FAULTS", "1")
  n = RenderNode()
  assert n.fault_policy == "strict"
  n.close()
  with pytest.raises(ValueError):
    RenderNode(fault_policy="lenient")


def test_bad_packets_fault_and_retire(node):
  cmd, _, _ = node.new()
  f = node.submit(cmd, [pkt7_hdr(mesa.CP_WAIT_FOR_IDLE, 0) ^ (1 << 15)], [cmd])
  g = node.submit(cmd, pkt(0x7e), [cmd], offset=0x40)
  node.wait(g)
  assert f < g and node.faults() == 2
  assert "parity" in node.n.stats.faults[-2] and "unknown opcode" in node.n.stats.faults[-1]


def test_injected_faults(node):
  node.n.inject("GEM_NEW", errno.ENOMEM)
  with pytest.raises(OSError) as e:
    node.new()
  assert e.value.errno == errno.ENOMEM and node.n.live_handles == 0
  cmd, _, _ = node.new()
  node.n.inject_gpu_fault("planted page fault")
  node.wait(node.submit(cmd, pkt(mesa.CP_WAIT_FOR_IDLE), [cmd]))
  assert node.faults() == 1 and "planted page fault" in node.n.stats.faults[-1]


def test_set_iova_rules():
  n = Node()
  n.n.ioctl(u.DRM_IOCTL_MSM_GEM_NEW, g := u.drm_msm_gem_new(size=0x2000, flags=u.MSM_BO_WC))
  w = n.n.window
  with pytest.raises(OSError) as e:   # outside the VM
    n.n.ioctl(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_SET_IOVA, value=w.start + w.size + 0x10000))
  assert e.value.errno == errno.ENOSPC
  want = w.start + w.size - 0x10000
  n.n.ioctl(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_SET_IOVA, value=want))
  n.n.ioctl(u.DRM_IOCTL_MSM_GEM_INFO, got := u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_GET_IOVA))
  assert got.value == want
  with pytest.raises(OSError) as e:   # already has another iova
    n.n.ioctl(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=g.handle, info=u.MSM_INFO_SET_IOVA, value=want - 0x10000))
  assert e.value.errno == errno.EBUSY
  n.n.ioctl(u.DRM_IOCTL_MSM_GEM_NEW, g2 := u.drm_msm_gem_new(size=0x1000, flags=u.MSM_BO_WC))
  with pytest.raises(OSError) as e:   # overlaps the first
    n.n.ioctl(u.DRM_IOCTL_MSM_GEM_INFO, u.drm_msm_gem_info(handle=g2.handle, info=u.MSM_INFO_SET_IOVA, value=want + 0x1000))
  assert e.value.errno == errno.ENOSPC
  n.n.close()


def test_cpu_prep_waits_for_the_bo_and_prime_round_trips(node):
  cmd, _, _ = node.new()
  sig, _, sig_iova = node.new()
  node.submit(cmd, wait_ge(sig_iova + 8, 1) + flush_ts(sig_iova, 2), [cmd, sig])
  prep = u.drm_msm_gem_cpu_prep(handle=sig, op=u.MSM_PREP_READ | u.MSM_PREP_NOSYNC)
  with pytest.raises(OSError) as e:
    node.n.ioctl(u.DRM_IOCTL_MSM_GEM_CPU_PREP, prep)
  assert e.value.errno == errno.EBUSY
  node.u32(sig, 8).value = 1
  dl = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + 200_000_000
  node.n.ioctl(u.DRM_IOCTL_MSM_GEM_CPU_PREP, u.drm_msm_gem_cpu_prep(handle=sig, op=u.MSM_PREP_READ, timeout=u.drm_msm_timespec(*divmod(dl, 10**9))))
  assert node.u32(sig).value == 2
  node.n.ioctl(u.DRM_IOCTL_PRIME_HANDLE_TO_FD, p := u.drm_prime_handle(handle=sig))
  try:
    node.n.ioctl(u.DRM_IOCTL_PRIME_FD_TO_HANDLE, back := u.drm_prime_handle(fd=p.fd))
    assert back.handle == sig
  finally:
    os.close(p.fd)


def _memfds() -> int:
  n = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:msm-bo")
    except OSError:
      pass
  return n


def test_memory_budget_refuses_gem_new_with_enomem_and_recovers():
  """A real limit, not an injected errno: past the node's budget GEM_NEW is ENOMEM (the kernel's shmem accounting when memory
  is short), the refused call leaves no handle, memfd or accounted byte behind, and freeing a BO makes room again."""
  fds0 = _memfds()
  node = Node(mem_limit=3 * 0x1000)
  a, _, _ = node.new()
  b, _, _ = node.new(0x2000)
  assert node.n.mem_used == 3 * 0x1000
  with pytest.raises(OSError) as e:
    node.new()
  assert e.value.errno == errno.ENOMEM and "EMU_MEM_LIMIT_MB" in str(e.value)
  assert "0.01 of the node's 0.01 MiB" in str(e.value)
  assert node.n.live_handles == 2 and node.n.mem_used == 3 * 0x1000 and _memfds() == fds0 + 2
  node.n.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=b))
  assert node.n.mem_used == 0x1000
  c, _, _ = node.new(0x2000)   # room again
  assert node.n.live_handles == 2
  node.n.mem_limit = None      # settable at run time: lifted
  node.new(0x10000)
  node.n.close()
  assert _memfds() == fds0 and node.n.mem_used == 0


def test_memory_budget_counts_bos_pinned_by_unretired_jobs():
  """A closed BO that a pending job lists keeps its backing until the job retires (msm-kernel-rules.md, GEM: in-flight submits
  hold references to their BOs), so it keeps its place in the budget until then."""
  node = Node(mem_limit=3 * 0x1000)
  cmd, _, _ = node.new()
  sig, _, sig_iova = node.new()
  gate, _, gate_iova = node.new()
  f = node.submit(cmd, wait_ge(gate_iova, 1) + flush_ts(sig_iova, 1), [cmd, sig, gate])
  node.n.ioctl(u.DRM_IOCTL_GEM_CLOSE, u.drm_gem_close(handle=sig))
  with pytest.raises(OSError) as e:
    node.new()
  assert e.value.errno == errno.ENOMEM
  node.u32(gate).value = 1
  node.wait(f)
  node.new()   # retired: the closed BO's memory is back
  node.n.close()


def test_memory_budget_from_env(monkeypatch):
  monkeypatch.setenv("EMU_MEM_LIMIT_MB", "1.5")
  n = RenderNode()
  assert n.mem_limit == 3 << 19
  n.close()
  monkeypatch.setenv("EMU_MEM_LIMIT_MB", "lots")
  with pytest.raises(ValueError, match="EMU_MEM_LIMIT_MB must be a number of MiB, not 'lots'"):
    RenderNode()
  monkeypatch.delenv("EMU_MEM_LIMIT_MB")
  assert RenderNode().mem_limit is None
  with pytest.raises(ValueError, match="mem_limit must be >= 0"):
    RenderNode(mem_limit=-1)


def test_delayed_job_times_out_waits_then_retires():
  """delay_jobs: a really slow job. A WAIT_FENCE whose deadline falls before it is done is ETIMEDOUT (not injected: the fence is
  simply not signalled), the job behind it waits too, and both retire once the time is up."""
  node = Node()
  cmd, _, _ = node.new()
  sig, _, sig_iova = node.new()
  node.n.delay_jobs(0.3)
  f1 = node.submit(cmd, flush_ts(sig_iova, 1), [cmd, sig])
  f2 = node.submit(cmd, flush_ts(sig_iova, 2), [cmd, sig], offset=0x100)
  t0 = time.monotonic()
  with pytest.raises(OSError) as e:
    node.wait(f2, timeout_ms=50)
  assert e.value.errno == errno.ETIMEDOUT and node.u32(sig).value == 0 and node.n.pending_jobs == 2
  node.wait(f2, timeout_ms=1000)
  assert 0.25 < time.monotonic() - t0 < 1.0 and node.u32(sig).value == 2 and node.faults() == 0 and f1 < f2
  with pytest.raises(ValueError):
    node.n.delay_jobs(-1)
  node.n.close()


def test_cpu_prep_read_waits_for_writers_only(node):
  """msm_gem_cpu_prep waits on dma_resv_usage_rw(write): a CPU read for the jobs that listed the BO with WRITE, a CPU write for
  every job that lists it (the submit attaches its fence as a write fence only to BOs flagged MSM_SUBMIT_BO_WRITE)."""
  cmd, _, _ = node.new()
  buf, _, _ = node.new()
  node.n.delay_jobs(0.5)
  node.submit(cmd, pkt(mesa.CP_WAIT_FOR_IDLE), [cmd, buf], bo_flags=u.MSM_SUBMIT_BO_READ)
  node.n.ioctl(u.DRM_IOCTL_MSM_GEM_CPU_PREP, u.drm_msm_gem_cpu_prep(handle=buf, op=u.MSM_PREP_READ | u.MSM_PREP_NOSYNC))   # no writer
  with pytest.raises(OSError) as e:
    node.n.ioctl(u.DRM_IOCTL_MSM_GEM_CPU_PREP, u.drm_msm_gem_cpu_prep(handle=buf, op=u.MSM_PREP_WRITE | u.MSM_PREP_NOSYNC))
  assert e.value.errno == errno.EBUSY
  node.wait(node.submit(cmd, pkt(mesa.CP_WAIT_FOR_IDLE), [cmd, buf]), timeout_ms=2000)   # READ|WRITE, after the delayed one
  node.n.delay_jobs(0.5)
  node.submit(cmd, pkt(mesa.CP_WAIT_FOR_IDLE), [cmd, buf], bo_flags=u.MSM_SUBMIT_BO_WRITE)
  with pytest.raises(OSError) as e:
    node.n.ioctl(u.DRM_IOCTL_MSM_GEM_CPU_PREP, u.drm_msm_gem_cpu_prep(handle=buf, op=u.MSM_PREP_READ | u.MSM_PREP_NOSYNC))
  assert e.value.errno == errno.EBUSY
