"""Level B beyond what tinygrad's renderer emits today: the IR3 forms Mesa's ir3 produces for UAV image reads (ldib),
image sizes (resinfo), global and shared atomics, a0-relative registers and consts, and 3D / 2D-array images. Each
kernel is written in NIR (tests/nir_kernel.py), compiled by Mesa, decoded (our text == Mesa's), executed on the
emulated a630 through tinygrad's QCOMProgram and compared with the same computation on tinygrad's CPU device.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from tinygrad import Tensor
from tinygrad.runtime.autogen import mesa

from backend.emu.ir3.decode import check_fields, decode
from tests.nir_kernel import Arg, Kernel, machine_code, run
from tests.test_ir3 import _emu, executing, planted_faults

pytestmark = pytest.mark.xdist_group("qcom_artifact")
RNG = np.random.default_rng(28)
DIM3 = mesa.GLSL_SAMPLER_DIM_3D


def cpu(fn, *arrays) -> np.ndarray:
  """The reference: `fn` over tinygrad CPU tensors."""
  return fn(*[Tensor(a, device="CPU") for a in arrays]).numpy()


def compiled(k: Kernel, *expect: str) -> bytes:
  """The kernel's lib, after checking Mesa emitted each expected form and that our decoder prints every instruction as
  Mesa does and agrees with its decoded fields."""
  lib = k.compile()
  prog = decode(machine_code(lib))
  text = "\n".join(i.text for i in prog.instrs)
  for form in expect:
    assert form in text, f"Mesa did not emit '{form}':\n{text}"
  for ins, m in zip(prog.instrs, prog.mesa):
    assert ins.render() == ins.text, (ins.render(), ins.text)
    assert not check_fields(ins, m), (ins.text, check_fields(ins, m))
  return lib


def go(lib: bytes, args: list[Arg], **kw) -> list[np.ndarray]:
  with executing() as node, no_page_faults(node):
    return run(_emu(), lib, args, **kw)


def go_faulting(lib: bytes, args: list[Arg], **kw) -> list[np.ndarray]:
  """`go` for a kernel that faults on purpose: the shared node's fault logs are left as they were found."""
  with executing() as node, planted_faults(node):
    return run(_emu(), lib, args, **kw)


@contextlib.contextmanager
def no_page_faults(node):
  """A page fault without a hang is only logged, as the msm kernel does: here it fails the test."""
  before = node.stats.page_faults
  yield
  assert node.stats.page_faults == before, node.stats.faults[-1]


# *** ldib / resinfo ***

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ldib_reads_a_uav_the_kernel_writes(dtype):
  h, w = 3, 64
  img = RNG.standard_normal((h, w, 4)).astype(dtype)
  k = Kernel(local=w, nbufs=0, uavs=1)
  lid = k.lid()
  # read-modify-write of one image: Mesa must read it as a UAV (ldib), not through the texture cache; 2*x is exact, so a
  # mad Mesa may form rounds once either way
  for y in range(h):
    c = k.vec(lid, k.i(y))
    v = k.image_load(0, c)
    k.image_store(0, c, k.vec(*[k.alu("fadd", k.alu("fmul", k.comp(v, j), k.alu("i2f32", k.i(2))), k.comp(v, (j + 1) % 4)) for j in range(4)]))
  (got,) = go(compiled(k, "ldib.b.typed.2d.f32.4", "stib.b.typed.2d"), [Arg(img, image=True)], local=w)
  # fp16 texels are widened to fp32 by ldib and the fp32 result rounded once by stib: exact either way
  np.testing.assert_array_equal(got, cpu(lambda t: (t.float() * 2 + t.float()[..., [1, 2, 3, 0]]).cast(t.dtype), img))


def test_resinfo_gives_the_uav_size():
  h, w = 5, 48
  k = Kernel(local=4, nbufs=1, uavs=1)
  sz = k.image_size(0, 3, dim=DIM3)   # three components: resinfo always writes three
  lid = k.lid()
  k.store(0, lid, k.alu("bcsel", k.alu("ieq", lid, k.i(0)), k.comp(sz, 0), k.alu("bcsel", k.alu("ieq", lid, k.i(1)), k.comp(sz, 1),
                                                                                    k.comp(sz, 2))))
  out, _ = go(compiled(k, "resinfo.b.untyped.3d.u32"), [Arg(np.zeros(4, np.uint32)), Arg(np.zeros((h, w, 4), np.float32), image=True)], local=4)
  # tinygrad's 2D images leave TEX_CONST_5.DEPTH at 0: the third component reads it as written
  assert out.tolist() == [w, h, 0, 0]


# *** atomics ***

def _s(x) -> int:
  return int(np.uint32(x).view(np.int32))


ATOMIC_CASES = {   # NIR op -> the word after every value was applied to `a` (order-independent), as Python ints
  "iadd": lambda a, v: (int(a) + sum(int(x) for x in v)) % 2**32,
  "umax": lambda a, v: max(int(a), *map(int, v)), "umin": lambda a, v: min(int(a), *map(int, v)),
  "imax": lambda a, v: max(_s(a), *map(_s, v)) % 2**32, "imin": lambda a, v: min(_s(a), *map(_s, v)) % 2**32,
  "iand": lambda a, v: int(np.bitwise_and.reduce(v, initial=a)), "ior": lambda a, v: int(np.bitwise_or.reduce(v, initial=a)),
  "ixor": lambda a, v: int(np.bitwise_xor.reduce(v, initial=a)),
}
# the same end values from tinygrad's CPU device where it has the reduction
CPU_REDUCE = {"iadd": lambda t: t.sum(dtype="uint32"), "umax": lambda t: t.max(), "umin": lambda t: t.min(),
              "imax": lambda t: t.bitcast("int32").max().bitcast("uint32"), "imin": lambda t: t.bitcast("int32").min().bitcast("uint32")}


@pytest.mark.parametrize("op", sorted(ATOMIC_CASES) + ["xchg"])
def test_global_atomics_on_one_word_and_on_many(op):
  n = 64
  vals = RNG.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
  start = RNG.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32)
  k = Kernel(local=n, nbufs=3)
  lid = k.lid()
  v = k.load(1, lid)
  kind = getattr(mesa, f"nir_atomic_op_{op}")
  old_shared = k.intrinsic("global_atomic", [k.buf(0), v], ATOMIC_OP=kind)                                   # every lane, one word
  old_own = k.intrinsic("global_atomic", [k.addr(2, lid), v], ATOMIC_OP=kind)                                 # a word each
  k.store(1, lid, old_shared)
  k.store(2, k.alu("iadd", lid, k.i(n)), old_own)
  own = RNG.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
  word, olds, mem = go(compiled(k, "atomic.g."), [Arg(start.copy()), Arg(vals.copy()), Arg(np.concatenate([own, np.zeros(n, np.uint32)]))])
  if op == "xchg":   # order decides which value stays: each value is handed on exactly once
    assert sorted(olds.tolist() + [int(word[0])]) == sorted([int(start[0])] + vals.tolist()) and word[1] == start[1]
    np.testing.assert_array_equal(mem[n:], own)
    np.testing.assert_array_equal(mem[:n], vals)
    return
  ref = ATOMIC_CASES[op](start[0], vals)
  if op in CPU_REDUCE:
    assert int(cpu(lambda t: CPU_REDUCE[op](t), np.concatenate([start[:1], vals]))) == ref
  assert int(word[0]) == ref and word[1] == start[1]
  np.testing.assert_array_equal(mem[n:], own)                                                  # the old value comes back
  np.testing.assert_array_equal(mem[:n], [ATOMIC_CASES[op](o, np.array([x], np.uint32)) for o, x in zip(own, vals)])
  if op == "iadd":   # the shared word's old values are the running sums of some order of the lanes
    steps = np.sort((olds.astype(np.int64) - start[0]) % 2**32)
    assert steps[0] == 0 and len(set(olds.tolist())) == n


def test_global_compare_exchange_lets_exactly_one_lane_win():
  n = 64
  k = Kernel(local=n, nbufs=2)
  lid = k.lid()
  # NIR's order: address, comparator, new value (Mesa pairs them as (new, comparator))
  old = k.intrinsic("global_atomic_swap", [k.buf(0), k.i(7), k.alu("iadd", lid, k.i(100))], ATOMIC_OP=mesa.nir_atomic_op_cmpxchg)
  k.store(1, lid, old)
  word, olds = go(compiled(k, "atomic.g.cmpxchg"), [Arg(np.array([7], np.uint32)), Arg(np.zeros(n, np.uint32))])
  winners = np.flatnonzero(olds == 7)
  assert len(winners) == 1 and word[0] == 100 + winners[0]
  assert set(olds.tolist()) == {7, int(word[0])}
  word, olds = go(compiled(_swap_kernel(n)), [Arg(np.array([8], np.uint32)), Arg(np.zeros(n, np.uint32))])
  assert word[0] == 8 and (olds == 8).all()   # no lane's comparator matches: nothing is written


def _swap_kernel(n):
  k = Kernel(local=n, nbufs=2)
  lid = k.lid()
  k.store(1, lid, k.intrinsic("global_atomic_swap", [k.buf(0), k.i(7), lid], ATOMIC_OP=mesa.nir_atomic_op_cmpxchg))
  return k


def test_shared_atomics_build_a_histogram_per_workgroup():
  n, groups, bins = 64, 3, 8
  data = RNG.integers(0, bins, n * groups).astype(np.uint32)
  k = Kernel(local=n, nbufs=2, shared=bins * 4)
  lid = k.lid()
  gid = k.alu("iadd", k.alu("imul", k.wg(), k.i(n)), lid)
  k.intrinsic("store_shared", [k.i(0), k.alu("imul", k.alu("iand", lid, k.i(bins - 1)), k.i(4))], has_def=False, WRITE_MASK=1, ALIGN_MUL=4)
  k.intrinsic("barrier", [], has_def=False, EXECUTION_SCOPE=mesa.SCOPE_WORKGROUP, MEMORY_SCOPE=mesa.SCOPE_WORKGROUP,
              MEMORY_SEMANTICS=mesa.NIR_MEMORY_ACQ_REL, MEMORY_MODES=mesa.nir_var_mem_shared)
  k.intrinsic("shared_atomic", [k.alu("imul", k.load(0, gid), k.i(4)), k.i(1)], ATOMIC_OP=mesa.nir_atomic_op_iadd, BASE=0)
  k.intrinsic("barrier", [], has_def=False, EXECUTION_SCOPE=mesa.SCOPE_WORKGROUP, MEMORY_SCOPE=mesa.SCOPE_WORKGROUP,
              MEMORY_SEMANTICS=mesa.NIR_MEMORY_ACQ_REL, MEMORY_MODES=mesa.nir_var_mem_shared)
  count = k.intrinsic("load_shared", [k.alu("imul", k.alu("iand", lid, k.i(bins - 1)), k.i(4))], ALIGN_MUL=4, BASE=0)
  k.store(1, gid, count)
  _, out = go(compiled(k, "atomic.add.untyped.1d.u32.1.l"), [Arg(data), Arg(np.zeros(n * groups, np.uint32))], groups=groups)
  ref = cpu(lambda d, b: (d.reshape(groups, n, 1) == b).sum(1), data, np.arange(bins, dtype=np.uint32))
  np.testing.assert_array_equal(out.reshape(groups, n), ref[:, np.arange(n) % bins])


def test_image_atomics_are_refused_by_name():
  # tinygrad's QCOM runtime binds only RGBA32F/RGBA16F images, on which no atomic is defined: refused, not guessed
  k = Kernel(local=4, nbufs=0, uavs=1)
  k.intrinsic("image_atomic", [k.i(0), k.vec(k.lid(), k.i(0)), k.i(0), k.i(1)],
              IMAGE_DIM=mesa.GLSL_SAMPLER_DIM_2D, ATOMIC_OP=mesa.nir_atomic_op_iadd, FORMAT=mesa.PIPE_FORMAT_R32_UINT, ACCESS=0)
  lib = compiled(k, "atomic.b.add")
  with pytest.raises(Exception, match=r"not implemented: memory instruction 'atomic\.b\.add"):
    go_faulting(lib, [Arg(np.zeros((1, 4, 4), np.float32), image=True)], local=4)


# *** a0-relative operands ***

@pytest.mark.parametrize("bits", [32, 16])
def test_register_array_indexed_by_a0_reads_and_writes(bits):
  n, size = 64, 8
  k = Kernel(local=n, nbufs=2)
  lid = k.lid()
  arr = k.array(size, bits)
  narrow = (lambda v: k.alu("u2u16", v)) if bits == 16 else (lambda v: v)
  x = k.load(0, lid)
  for j in range(size):
    k.array_store(arr, k.i(j), narrow(k.alu("imul", x, k.i(j + 1))))
  k.array_store(arr, k.alu("iand", x, k.i(size - 1)), narrow(k.alu("iadd", lid, k.i(1000))))     # a relative destination
  v = k.array_load(arr, k.alu("iand", k.alu("iadd", lid, k.i(3)), k.i(size - 1)), bits)          # a relative source
  k.store(1, lid, k.alu("u2u32", v) if bits == 16 else v)
  data = RNG.integers(0, 1 << 20, n).astype(np.uint32)
  lib = compiled(k, "mova a0.x", "hr<a0.x" if bits == 16 else " r<a0.x")
  _, got = go(lib, [Arg(data), Arg(np.zeros(n, np.uint32))])
  j = (np.arange(n) + 3) % size
  ref = cpu(lambda d, jj, ll: ((d & (size - 1)) == jj).where(ll + 1000, d * (jj + 1)), data, j.astype(np.uint32), np.arange(n, dtype=np.uint32))
  np.testing.assert_array_equal(got, ref & (0xffff if bits == 16 else 0xffffffff))


def test_kernel_arguments_indexed_by_a0_are_relative_consts():
  n = 16
  vals = (11, -22, 33, -(1 << 31))
  k = Kernel(local=n, nbufs=1, nvals=4)
  lid = k.lid()
  k.store(0, lid, k.arg(k.alu("iadd", k.i(k.val_offset(0)), k.alu("imul", k.alu("iand", lid, k.i(3)), k.i(4)))))
  (got,) = go(compiled(k, "c<a0.x"), [Arg(np.zeros(n, np.uint32))], vals=vals, local=n)
  np.testing.assert_array_equal(got.view(np.int32), cpu(lambda v, i: v[i], np.array(vals, np.int32), np.arange(n, dtype=np.int32) % 4))


def test_a_relative_index_past_the_register_file_faults():
  k = Kernel(local=4, nbufs=2)
  lid = k.lid()
  arr = k.array(8)
  for j in range(8):
    k.array_store(arr, k.i(j), k.alu("iadd", lid, k.i(j)))
  k.store(1, lid, k.array_load(arr, k.load(0, lid)))
  lib = compiled(k, "r<a0.x")
  with pytest.raises(Exception, match=r"relative operand r<a0\.x \+ \d+> reaches scalar \d+, outside the register file"):
    go_faulting(lib, [Arg(np.array([0, 1, 2, 4000], np.uint32)), Arg(np.zeros(4, np.uint32))], local=4)


# *** ldc: UBO loads Mesa did not push into the const file ***

def _ldc_kernel(n: int) -> Kernel:
  k = Kernel(local=n, nbufs=1, nvals=4)
  lid = k.lid()
  off = k.alu("iadd", k.i(k.val_offset(0)), k.alu("imul", k.alu("iand", lid, k.i(3)), k.i(4)))
  # a range Mesa cannot bound (as a kernel's arguments past the const file would be) is left to ldc
  k.store(0, lid, k.intrinsic("load_ubo", [k.i(0), off], ALIGN_MUL=4, RANGE=0xffffffff))
  return k


def test_ldc_reads_the_ubo_through_its_descriptor():
  from tests.nir_kernel import arguments_as_ubo0
  n, vals = 16, (7, -8, 9, (1 << 31) - 1)
  lib = compiled(_ldc_kernel(n), "ldc.offset0.4.imm")
  with arguments_as_ubo0(_emu()):
    (got,) = go(lib, [Arg(np.zeros(n, np.uint32))], vals=vals, local=n)
  np.testing.assert_array_equal(got.view(np.int32), cpu(lambda v, i: v[i], np.array(vals, np.int32), np.arange(n, dtype=np.int32) % 4))


def test_ldc_without_a_ubo_descriptor_says_tinygrads_runtime_loads_none():
  lib = compiled(_ldc_kernel(4), "ldc.")
  with pytest.raises(Exception, match=r"ldc reads UBO 0, but 0 UBO descriptors were loaded \(tinygrad's QCOM runtime loads none"):
    go_faulting(lib, [Arg(np.zeros(4, np.uint32))], vals=(1, 2, 3, 4), local=4)


# *** 3D and 2D-array images ***

SLICES, IH, IW = 3, 4, 16            # a slice of RGBA32F: 4 rows x 256 B = 1 KiB; slices 4 KiB apart (ARRAY_PITCH's unit)


@pytest.mark.parametrize("kind", ["3d", "array"])
@pytest.mark.parametrize("via", ["isam", "ldib"])
def test_sliced_images_read_each_slice_and_give_their_depth(kind, via):
  img = RNG.integers(-1000, 1000, (SLICES, IH, IW, 4)).astype(np.float32)   # sums exact in any order Mesa adds them
  n = IW * IH
  k = Kernel(local=n, nbufs=1, uavs=int(via == "ldib"), textures=int(via == "isam"))
  lid = k.lid()
  x, y = k.alu("iand", lid, k.i(IW - 1)), k.alu("ushr", lid, k.i(4))
  dim, array = (DIM3, False) if kind == "3d" else (mesa.GLSL_SAMPLER_DIM_2D, True)
  z = k.alu("umod", k.alu("iadd", y, k.i(1)), k.i(SLICES))
  v = k.image_load(0, k.vec(x, y, z), dim=dim, array=array, texture=via == "isam")
  total = k.alu("fadd", k.alu("fadd", k.comp(v, 0), k.comp(v, 1)), k.alu("fadd", k.comp(v, 2), k.comp(v, 3)))
  if via == "ldib":   # the depth through resinfo too
    total = k.alu("fadd", total, k.alu("u2f32", k.comp(k.image_size(0, 3, dim=dim, array=array), 2)))
  k.store(0, lid, total)
  form = {"isam": "isam.3d" if kind == "3d" else "isam.a", "ldib": "ldib.b.typed.3d"}[via]
  out, _ = go(compiled(k, form), [Arg(np.zeros(n, np.float32)), Arg(img, image=True, texture=via == "isam", kind=kind, layer_pitch=4096)],
              local=n)
  yy, xx = np.arange(n) // IW, np.arange(n) % IW
  zz = (yy + 1) % SLICES
  picked = img[zz, yy, xx]   # (n, 4)
  ref = cpu(lambda p: (p[:, 0] + p[:, 1]) + (p[:, 2] + p[:, 3]), picked) + (SLICES if via == "ldib" else 0)
  np.testing.assert_array_equal(out, ref.astype(np.float32))


def test_stib_writes_the_slice_its_coordinate_names():
  img = np.zeros((SLICES, IH, IW, 4), np.float32)
  n = IW * IH
  k = Kernel(local=n, nbufs=0, uavs=1)
  lid = k.lid()
  x, y = k.alu("iand", lid, k.i(IW - 1)), k.alu("ushr", lid, k.i(4))
  f = k.alu("u2f32", lid)
  k.image_store(0, k.vec(x, y, k.alu("umod", lid, k.i(SLICES))), k.vec(f, f, f, f), dim=DIM3)
  (got,) = go(compiled(k, "stib.b.typed.3d"), [Arg(img, image=True, kind="3d", layer_pitch=4096)], local=n)
  lanes = np.arange(n)
  ref = np.zeros_like(img)
  ref[lanes % SLICES, lanes // IW, lanes % IW] = lanes[:, None].astype(np.float32)
  np.testing.assert_array_equal(got, ref)


# *** bindless descriptors ***

def test_bindless_images_read_write_and_size_through_their_set():
  from tests.nir_kernel import bindless_sets, bindless_table, read_back
  h, w = 2, 32
  src = RNG.integers(-500, 500, (h, w, 4)).astype(np.float32)
  tex = RNG.integers(-500, 500, (h, w, 4)).astype(np.float32)
  dst = np.zeros((h, w, 4), np.float32)
  k = Kernel(local=w, nbufs=1)
  lid = k.lid()
  # set 1 holds [unused, tex, src (UAV), dst (UAV)]: isam.base1 t#1, ldib/stib/resinfo .base1 on slots 2 and 3
  t = k.intrinsic("bindless_resource_ir3", [k.i(1)], DESC_SET=1)
  u = k.intrinsic("bindless_resource_ir3", [k.i(2)], DESC_SET=1)
  o = k.intrinsic("bindless_resource_ir3", [k.i(3)], DESC_SET=1)
  for y in range(h):
    c = k.vec(lid, k.i(y))
    a = k.intrinsic("bindless_image_load", [t, c, k.i(0), k.i(0)], nc=4, IMAGE_DIM=mesa.GLSL_SAMPLER_DIM_2D, IMAGE_ARRAY=False,
                    ACCESS=mesa.ACCESS_CAN_REORDER, DEST_TYPE=mesa.nir_type_float32, FORMAT=0)
    b = k.intrinsic("bindless_image_load", [u, c, k.i(0), k.i(0)], nc=4, IMAGE_DIM=mesa.GLSL_SAMPLER_DIM_2D, IMAGE_ARRAY=False,
                    ACCESS=0, DEST_TYPE=mesa.nir_type_float32, FORMAT=0)
    k.intrinsic("bindless_image_store", [o, c, k.i(0), k.vec(*[k.alu("fadd", k.comp(a, j), k.comp(b, j)) for j in range(4)]), k.i(0)],
                nc=4, has_def=False, IMAGE_DIM=mesa.GLSL_SAMPLER_DIM_2D, IMAGE_ARRAY=False, ACCESS=0, SRC_TYPE=mesa.nir_type_float32, FORMAT=0)
  sz = k.intrinsic("bindless_image_size", [o, k.i(0)], nc=2, IMAGE_DIM=mesa.GLSL_SAMPLER_DIM_2D, IMAGE_ARRAY=False)
  k.store(0, lid, k.alu("iadd", k.alu("imul", k.comp(sz, 0), k.i(1000)), k.comp(sz, 1)))
  lib = compiled(k, "isam.base1", "ldib.b.typed.2d.f32.4.imm.base1", "stib.b.typed.2d.f32.4.imm.base1", "resinfo.b.untyped.2d.u32.1.imm.base1")
  dev = _emu()
  with executing() as node, no_page_faults(node):
    table, bufs = bindless_table(dev, [(np.zeros((1, 4, 4), np.float32), False), (tex, False), (src, True), (dst, True)])
    with bindless_sets(dev, {1: (table, bufs)}):
      (sizes,) = run(dev, lib, [Arg(np.zeros(w, np.uint32))], local=w)
    got = read_back(dev, bufs[3], dst)
  np.testing.assert_array_equal(got, cpu(lambda a, b: a + b, tex, src))
  assert (sizes == w * 1000 + h).all()


def test_a_bindless_set_nobody_bound_is_a_clear_fault():
  k = Kernel(local=4, nbufs=1)
  t = k.intrinsic("bindless_resource_ir3", [k.i(0)], DESC_SET=4)   # no test binds set 4
  v = k.intrinsic("bindless_image_load", [t, k.vec(k.lid(), k.i(0)), k.i(0), k.i(0)], nc=4, IMAGE_DIM=mesa.GLSL_SAMPLER_DIM_2D,
                  IMAGE_ARRAY=False, ACCESS=mesa.ACCESS_CAN_REORDER, DEST_TYPE=mesa.nir_type_float32, FORMAT=0)
  k.store(0, k.lid(), k.comp(v, 0))
  with pytest.raises(Exception, match=r"bindless set 4 is used but SP_CS_BINDLESS_BASE\(4\) was never written"):
    go_faulting(compiled(k, "isam.base4"), [Arg(np.zeros(4, np.float32))], local=4)
