"""msm_drm.h and drm.h UAPI used by the MSM kernel interface: ctypes layouts, ioctl numbers, constants.

tinygrad 0.14.0 ships no msm_drm bindings, so the layouts are written out here from the kernel header
(see docs/msm-drm-and-tinygrad.md §1). Explicit pad fields keep each struct byte-identical to the C one.
"""
from __future__ import annotations

import ctypes

u32, s32, u64, s64 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64

DRM_IOCTL_BASE, DRM_COMMAND_BASE = 0x64, 0x40
_IOC_NONE, _IOC_WRITE, _IOC_READ = 0, 1, 2


def ioc(direction: int, nr: int, size: int) -> int:
  return (direction << 30) | (size << 16) | (DRM_IOCTL_BASE << 8) | nr


class Struct(ctypes.Structure):
  def __repr__(self) -> str:
    return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n, *_ in self._fields_ if not n.startswith('pad'))})"


# *** DRM core ***

class drm_version(Struct):
  _fields_ = [("version_major", s32), ("version_minor", s32), ("version_patchlevel", s32), ("pad", u32),
              ("name_len", u64), ("name", u64), ("date_len", u64), ("date", u64), ("desc_len", u64), ("desc", u64)]


class drm_gem_close(Struct):
  _fields_ = [("handle", u32), ("pad", u32)]


class drm_prime_handle(Struct):
  _fields_ = [("handle", u32), ("flags", u32), ("fd", s32)]


# *** msm ***

class drm_msm_timespec(Struct):
  _fields_ = [("tv_sec", s64), ("tv_nsec", s64)]


class drm_msm_param(Struct):
  _fields_ = [("pipe", u32), ("param", u32), ("value", u64), ("len", u32), ("pad", u32)]


class drm_msm_gem_new(Struct):
  _fields_ = [("size", u64), ("flags", u32), ("handle", u32)]


class drm_msm_gem_info(Struct):
  _fields_ = [("handle", u32), ("info", u32), ("value", u64), ("len", u32), ("pad", u32)]


class drm_msm_gem_cpu_prep(Struct):
  _fields_ = [("handle", u32), ("op", u32), ("timeout", drm_msm_timespec)]


class drm_msm_gem_cpu_fini(Struct):
  _fields_ = [("handle", u32)]


class drm_msm_gem_submit_reloc(Struct):
  _fields_ = [("submit_offset", u32), ("or_", u32), ("shift", s32), ("reloc_idx", u32), ("reloc_offset", u64)]


class drm_msm_gem_submit_cmd(Struct):
  _fields_ = [("type", u32), ("submit_idx", u32), ("submit_offset", u32), ("size", u32), ("pad", u32), ("nr_relocs", u32), ("relocs", u64)]

  # the header's union { relocs; iova; }: a VM_BIND context names the command range by GPU address in the same 8 bytes
  @property
  def iova(self) -> int:
    return int(self.relocs)

  @iova.setter
  def iova(self, value: int) -> None:
    self.relocs = value


class drm_msm_gem_submit_bo(Struct):
  _fields_ = [("flags", u32), ("handle", u32), ("presumed", u64)]


class drm_msm_syncobj(Struct):
  _fields_ = [("handle", u32), ("flags", u32), ("point", u64)]


class drm_msm_gem_submit(Struct):
  _fields_ = [("flags", u32), ("fence", u32), ("nr_bos", u32), ("nr_cmds", u32), ("bos", u64), ("cmds", u64), ("fence_fd", s32),
              ("queueid", u32), ("in_syncobjs", u64), ("out_syncobjs", u64), ("nr_in_syncobjs", u32), ("nr_out_syncobjs", u32),
              ("syncobj_stride", u32), ("pad", u32)]


class drm_msm_wait_fence(Struct):
  _fields_ = [("fence", u32), ("flags", u32), ("timeout", drm_msm_timespec), ("queueid", u32), ("pad", u32)]


class drm_msm_gem_madvise(Struct):
  _fields_ = [("handle", u32), ("madv", u32), ("retained", u32)]


class drm_msm_submitqueue(Struct):
  _fields_ = [("flags", u32), ("prio", u32), ("id", u32)]


class drm_msm_submitqueue_query(Struct):
  _fields_ = [("data", u64), ("id", u32), ("param", u32), ("len", u32), ("pad", u32)]


class drm_msm_vm_bind_op(Struct):
  _fields_ = [("op", u32), ("handle", u32), ("obj_offset", u64), ("iova", u64), ("range", u64), ("flags", u32), ("pad", u32)]


class _vm_bind_ops(ctypes.Union):
  _fields_ = [("op", drm_msm_vm_bind_op), ("ops", u64)]


class drm_msm_vm_bind(Struct):
  _anonymous_ = ("u",)
  _fields_ = [("flags", u32), ("nr_ops", u32), ("fence_fd", s32), ("queue_id", u32), ("in_syncobjs", u64), ("out_syncobjs", u64),
              ("nr_in_syncobjs", u32), ("nr_out_syncobjs", u32), ("syncobj_stride", u32), ("op_stride", u32), ("u", _vm_bind_ops)]


def _cmd(direction: int, nr: int, struct_t) -> int:
  return ioc(direction, DRM_COMMAND_BASE + nr, ctypes.sizeof(struct_t))


_WR = _IOC_READ | _IOC_WRITE
DRM_IOCTL_VERSION = ioc(_WR, 0x00, ctypes.sizeof(drm_version))
DRM_IOCTL_GEM_CLOSE = ioc(_IOC_WRITE, 0x09, ctypes.sizeof(drm_gem_close))
DRM_IOCTL_PRIME_HANDLE_TO_FD = ioc(_WR, 0x2D, ctypes.sizeof(drm_prime_handle))
DRM_IOCTL_PRIME_FD_TO_HANDLE = ioc(_WR, 0x2E, ctypes.sizeof(drm_prime_handle))
DRM_IOCTL_MSM_GET_PARAM = _cmd(_WR, 0x00, drm_msm_param)
DRM_IOCTL_MSM_SET_PARAM = _cmd(_IOC_WRITE, 0x01, drm_msm_param)
DRM_IOCTL_MSM_GEM_NEW = _cmd(_WR, 0x02, drm_msm_gem_new)
DRM_IOCTL_MSM_GEM_INFO = _cmd(_WR, 0x03, drm_msm_gem_info)
DRM_IOCTL_MSM_GEM_CPU_PREP = _cmd(_IOC_WRITE, 0x04, drm_msm_gem_cpu_prep)
DRM_IOCTL_MSM_GEM_CPU_FINI = _cmd(_IOC_WRITE, 0x05, drm_msm_gem_cpu_fini)
DRM_IOCTL_MSM_GEM_SUBMIT = _cmd(_WR, 0x06, drm_msm_gem_submit)
DRM_IOCTL_MSM_WAIT_FENCE = _cmd(_IOC_WRITE, 0x07, drm_msm_wait_fence)
DRM_IOCTL_MSM_GEM_MADVISE = _cmd(_WR, 0x08, drm_msm_gem_madvise)
DRM_IOCTL_MSM_SUBMITQUEUE_NEW = _cmd(_WR, 0x0A, drm_msm_submitqueue)
DRM_IOCTL_MSM_SUBMITQUEUE_CLOSE = ioc(_IOC_WRITE, DRM_COMMAND_BASE + 0x0B, ctypes.sizeof(u32))
DRM_IOCTL_MSM_SUBMITQUEUE_QUERY = _cmd(_IOC_WRITE, 0x0C, drm_msm_submitqueue_query)
DRM_IOCTL_MSM_VM_BIND = _cmd(_WR, 0x0D, drm_msm_vm_bind)

IOCTL_NAMES = {v: k.removeprefix("DRM_IOCTL_") for k, v in dict(globals()).items() if k.startswith("DRM_IOCTL_") and isinstance(v, int)}

MSM_PIPE_3D0 = 0x10

# GET_PARAM
MSM_PARAM_GPU_ID, MSM_PARAM_GMEM_SIZE, MSM_PARAM_CHIP_ID, MSM_PARAM_MAX_FREQ, MSM_PARAM_TIMESTAMP = 0x01, 0x02, 0x03, 0x04, 0x05
MSM_PARAM_GMEM_BASE, MSM_PARAM_PRIORITIES, MSM_PARAM_FAULTS, MSM_PARAM_SUSPENDS = 0x06, 0x07, 0x09, 0x0a
MSM_PARAM_VA_START, MSM_PARAM_VA_SIZE, MSM_PARAM_HAS_PRR, MSM_PARAM_EN_VM_BIND = 0x0e, 0x0f, 0x15, 0x16

# GEM_NEW flags
MSM_BO_SCANOUT, MSM_BO_GPU_READONLY, MSM_BO_NO_SHARE = 0x1, 0x2, 0x4
MSM_BO_CACHED, MSM_BO_WC, MSM_BO_UNCACHED, MSM_BO_CACHED_COHERENT = 0x10000, 0x20000, 0x40000, 0x80000
MSM_BO_CACHE_MASK = 0xf0000
MSM_BO_FLAGS = MSM_BO_SCANOUT | MSM_BO_GPU_READONLY | MSM_BO_NO_SHARE | MSM_BO_CACHE_MASK

# GEM_INFO
MSM_INFO_GET_OFFSET, MSM_INFO_GET_IOVA, MSM_INFO_SET_NAME, MSM_INFO_GET_NAME, MSM_INFO_SET_IOVA, MSM_INFO_GET_FLAGS = 0, 1, 2, 3, 4, 5

# CPU_PREP
MSM_PREP_READ, MSM_PREP_WRITE, MSM_PREP_NOSYNC, MSM_PREP_BOOST = 1, 2, 4, 8
MSM_PREP_FLAGS = MSM_PREP_READ | MSM_PREP_WRITE | MSM_PREP_NOSYNC | MSM_PREP_BOOST

# GEM_SUBMIT
MSM_SUBMIT_CMD_BUF, MSM_SUBMIT_CMD_IB_TARGET_BUF, MSM_SUBMIT_CMD_CTX_RESTORE_BUF = 1, 2, 3
MSM_SUBMIT_BO_READ, MSM_SUBMIT_BO_WRITE, MSM_SUBMIT_BO_DUMP, MSM_SUBMIT_BO_NO_IMPLICIT = 1, 2, 4, 8
MSM_SUBMIT_BO_FLAGS = MSM_SUBMIT_BO_READ | MSM_SUBMIT_BO_WRITE | MSM_SUBMIT_BO_DUMP | MSM_SUBMIT_BO_NO_IMPLICIT
MSM_SUBMIT_NO_IMPLICIT, MSM_SUBMIT_FENCE_FD_IN, MSM_SUBMIT_FENCE_FD_OUT, MSM_SUBMIT_SUDO = 0x80000000, 0x40000000, 0x20000000, 0x10000000
MSM_SUBMIT_SYNCOBJ_IN, MSM_SUBMIT_SYNCOBJ_OUT, MSM_SUBMIT_FENCE_SN_IN = 0x08000000, 0x04000000, 0x02000000
MSM_SUBMIT_FLAGS = (MSM_SUBMIT_NO_IMPLICIT | MSM_SUBMIT_FENCE_FD_IN | MSM_SUBMIT_FENCE_FD_OUT | MSM_SUBMIT_SUDO | MSM_SUBMIT_SYNCOBJ_IN
                    | MSM_SUBMIT_SYNCOBJ_OUT | MSM_SUBMIT_FENCE_SN_IN)
MSM_PIPE_MASK = 0xffff
MSM_IB_MAX_BYTES = ((1 << 20) - 1) * 4  # the IB size field holds 20 bits of dwords

# WAIT_FENCE
MSM_WAIT_FENCE_BOOST = 1
MSM_WAIT_FENCE_FLAGS = MSM_WAIT_FENCE_BOOST

# SUBMITQUEUE
MSM_SUBMITQUEUE_ALLOW_PREEMPT, MSM_SUBMITQUEUE_VM_BIND = 0x1, 0x2
MSM_SUBMITQUEUE_FLAGS = MSM_SUBMITQUEUE_ALLOW_PREEMPT | MSM_SUBMITQUEUE_VM_BIND

# VM_BIND (msm 1.13, kernel 6.17+)
MSM_VM_BIND_OP_UNMAP, MSM_VM_BIND_OP_MAP, MSM_VM_BIND_OP_MAP_NULL = 0, 1, 2
MSM_VM_BIND_OP_DUMP = 0x1
MSM_VM_BIND_OP_FLAGS = MSM_VM_BIND_OP_DUMP
MSM_VM_BIND_FENCE_FD_IN, MSM_VM_BIND_FENCE_FD_OUT = 0x1, 0x2
MSM_VM_BIND_FLAGS = MSM_VM_BIND_FENCE_FD_IN | MSM_VM_BIND_FENCE_FD_OUT
MSM_SUBMITQUEUE_PARAM_FAULTS = 0

ADRENO_630_CHIP_ID = 0x06030001
