"""msm_drm / drm UAPI layouts and ioctl numbers against the values in docs/msm-drm-and-tinygrad.md §1."""
import ctypes

import pytest

from backend import uapi as u

SIZES = {u.drm_msm_timespec: 16, u.drm_msm_param: 24, u.drm_msm_gem_new: 16, u.drm_msm_gem_info: 24, u.drm_msm_gem_cpu_prep: 24,
         u.drm_msm_gem_cpu_fini: 4, u.drm_msm_gem_submit_cmd: 32, u.drm_msm_gem_submit_bo: 16, u.drm_msm_syncobj: 16,
         u.drm_msm_gem_submit: 72, u.drm_msm_wait_fence: 32, u.drm_msm_gem_madvise: 12, u.drm_msm_submitqueue: 12,
         u.drm_msm_submitqueue_query: 24, u.drm_msm_vm_bind_op: 40, u.drm_msm_vm_bind: 88, u.drm_gem_close: 8, u.drm_prime_handle: 12,
         u.drm_version: 64}

OFFSETS = [
  (u.drm_msm_param, {"pipe": 0, "param": 4, "value": 8, "len": 16}),
  (u.drm_msm_gem_new, {"size": 0, "flags": 8, "handle": 12}),
  (u.drm_msm_gem_info, {"handle": 0, "info": 4, "value": 8, "len": 16}),
  (u.drm_msm_gem_cpu_prep, {"handle": 0, "op": 4, "timeout": 8}),
  (u.drm_msm_gem_submit_cmd, {"type": 0, "submit_idx": 4, "submit_offset": 8, "size": 12, "nr_relocs": 20, "relocs": 24}),
  (u.drm_msm_gem_submit_bo, {"flags": 0, "handle": 4, "presumed": 8}),
  (u.drm_msm_syncobj, {"handle": 0, "flags": 4, "point": 8}),
  (u.drm_msm_gem_submit, {"flags": 0, "fence": 4, "nr_bos": 8, "nr_cmds": 12, "bos": 16, "cmds": 24, "fence_fd": 32, "queueid": 36,
                          "in_syncobjs": 40, "out_syncobjs": 48, "nr_in_syncobjs": 56, "nr_out_syncobjs": 60, "syncobj_stride": 64}),
  (u.drm_msm_wait_fence, {"fence": 0, "flags": 4, "timeout": 8, "queueid": 24}),
  (u.drm_msm_submitqueue, {"flags": 0, "prio": 4, "id": 8}),
  (u.drm_msm_submitqueue_query, {"data": 0, "id": 8, "param": 12, "len": 16}),
  (u.drm_msm_vm_bind_op, {"op": 0, "handle": 4, "obj_offset": 8, "iova": 16, "range": 24, "flags": 32}),
  (u.drm_msm_vm_bind, {"flags": 0, "nr_ops": 4, "fence_fd": 8, "queue_id": 12, "op_stride": 44, "u": 48}),
  (u.drm_prime_handle, {"handle": 0, "flags": 4, "fd": 8}),
  (u.drm_version, {"version_major": 0, "version_minor": 4, "version_patchlevel": 8, "name_len": 16, "name": 24, "desc": 56}),
]

NUMBERS = {"DRM_IOCTL_MSM_GET_PARAM": 0xC0186440, "DRM_IOCTL_MSM_SET_PARAM": 0x40186441, "DRM_IOCTL_MSM_GEM_NEW": 0xC0106442,
           "DRM_IOCTL_MSM_GEM_INFO": 0xC0186443, "DRM_IOCTL_MSM_GEM_CPU_PREP": 0x40186444, "DRM_IOCTL_MSM_GEM_CPU_FINI": 0x40046445,
           "DRM_IOCTL_MSM_GEM_SUBMIT": 0xC0486446, "DRM_IOCTL_MSM_WAIT_FENCE": 0x40206447, "DRM_IOCTL_MSM_GEM_MADVISE": 0xC00C6448,
           "DRM_IOCTL_MSM_SUBMITQUEUE_NEW": 0xC00C644A, "DRM_IOCTL_MSM_SUBMITQUEUE_CLOSE": 0x4004644B,
           "DRM_IOCTL_MSM_SUBMITQUEUE_QUERY": 0x4018644C, "DRM_IOCTL_MSM_VM_BIND": 0xC058644D, "DRM_IOCTL_GEM_CLOSE": 0x40086409,
           "DRM_IOCTL_PRIME_HANDLE_TO_FD": 0xC00C642D, "DRM_IOCTL_PRIME_FD_TO_HANDLE": 0xC00C642E, "DRM_IOCTL_VERSION": 0xC0406400}


@pytest.mark.parametrize("struct_t,size", SIZES.items(), ids=lambda x: getattr(x, "__name__", str(x)))
def test_struct_size(struct_t, size):
  assert ctypes.sizeof(struct_t) == size


@pytest.mark.parametrize("struct_t,offsets", OFFSETS, ids=[s.__name__ for s, _ in OFFSETS])
def test_field_offsets(struct_t, offsets):
  assert {name: getattr(struct_t, name).offset for name in offsets} == offsets


@pytest.mark.parametrize("name,number", NUMBERS.items())
def test_ioctl_number(name, number):
  assert getattr(u, name) == number
  assert u.IOCTL_NAMES[number] == name.removeprefix("DRM_IOCTL_")


def test_vm_bind_inline_op_and_pointer_share_storage():
  b = u.drm_msm_vm_bind()
  b.op.op = 0x1122334455667788 & 0xffffffff
  b.op.handle = 0x11223344
  assert b.ops == 0x11223344_55667788


def test_submit_flags_are_disjoint_from_pipe():
  assert u.MSM_SUBMIT_FLAGS & u.MSM_PIPE_MASK == 0
  assert u.MSM_PIPE_3D0 & u.MSM_PIPE_MASK == u.MSM_PIPE_3D0
