"""Compute kernels written in NIR by hand, compiled by Mesa's ir3 (tinygrad's IR3Compiler) and run by tinygrad's own
QCOMProgram: how the tests reach the IR3 forms tinygrad's renderer does not emit today (ldib, resinfo, atomics,
a0-relative operands, ldc, 3D and array images, bindless descriptors) through the same compiler, lib format, descriptors
and submission the openpilot models use. Built on tinygrad's NIR helpers (renderer/nir.py) and its conventions: kernel arguments are a
UBO (buffer pointers first, 8 bytes each, then the integer values), written images are UAVs numbered from 0, read-only
images are textures numbered from 0 after them.
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import dtypes
from tinygrad.device import TinyELF
from tinygrad.renderer import nir as N
from tinygrad.runtime.autogen import mesa
from tinygrad.runtime.support.compiler_mesa import IR3Compiler

_COMPILER: list[IR3Compiler] = []


def compiler() -> IR3Compiler:
  if not _COMPILER:
    _COMPILER.append(IR3Compiler("a630"))
    mesa.glsl_type_singleton_init_or_ref()
  return _COMPILER[0]


class Kernel:
  """One compute shader under construction. Values are nir_defs; `i(x)` makes a 32-bit immediate."""

  def __init__(self, local: int = 64, nbufs: int = 1, nvals: int = 0, uavs: int = 0, textures: int = 0, shared: int = 0):
    self.b = mesa.nir_builder_init_simple_shader(mesa.MESA_SHADER_COMPUTE,
                                                 mesa.nir_shader_compiler_options.from_buffer_copy(compiler().nir_options), None)
    info = self.b.shader.contents.info
    info.workgroup_size[0], info.workgroup_size[1], info.workgroup_size[2] = local, 1, 1
    info.shared_size = shared
    self.nbufs, self.nvals, self.uavs, self.textures = nbufs, nvals, uavs, textures
    self.arg_bytes = nbufs * 8 + nvals * 4

  # *** values ***
  def i(self, x: int) -> Any:
    return N.nimm(self.b, x, dtypes.int)

  def alu(self, op: str, *srcs) -> Any:
    return N.nalu(self.b, op, *srcs)

  def lid(self) -> Any:
    return N.nchannel(self.b, N.nlid(self.b), 0)

  def wg(self) -> Any:
    return N.nchannel(self.b, N.ngid(self.b), 0)

  def comp(self, v, c: int) -> Any:
    return N.nchannel(self.b, v, c)

  def vec(self, *xs) -> Any:
    xs = xs + tuple(N.nundef(self.b, dtypes.int) for _ in range(4 - len(xs)))
    return self.alu("vec4", *xs)

  def intrinsic(self, name: str, srcs, nc: int = 1, bits: int = 32, has_def: bool = True, **index) -> Any:
    b = self.b
    ins = mesa.nir_intrinsic_instr_create(b.shader, getattr(mesa, f"nir_intrinsic_{name}"))
    if has_def:
      mesa.nir_def_init(ins.contents.instr, ins.contents._def, nc, bits)
    info = mesa.nir_intrinsic_infos[ins.contents.intrinsic]
    table = info.index_map
    for k, v in index.items():
      slot = table[getattr(mesa, f"NIR_INTRINSIC_{k}")]
      assert slot > 0, f"{name} has no index {k} in this Mesa"
      ins.contents.const_index[slot - 1] = v
    for n, s in enumerate(srcs):
      ctypes.cast(ins.contents.src, ctypes.POINTER(mesa.nir_src))[n] = N.nsrc(s)
    if (has_def and info.dest_components == 0) or any(info.src_components[n] == 0 for n in range(info.num_srcs)):
      ins.contents.num_components = nc   # only intrinsics of variable width carry a component count
    mesa.nir_builder_instr_insert(b, ins.contents.instr)
    return ins.contents._def if has_def else None

  # *** kernel arguments (the UBO tinygrad's QCOM runtime pushes into the const file) ***
  def buf(self, slot: int) -> Any:
    return self.intrinsic("load_ubo", [self.i(0), self.i(slot * 8)], bits=64, ALIGN_MUL=8, RANGE=self.arg_bytes)

  def arg(self, offset) -> Any:
    """The 32-bit argument word at byte `offset` (an immediate, or any value: then ir3 indexes the const file by a0)."""
    off = offset if not isinstance(offset, int) else self.i(offset)
    return self.intrinsic("load_ubo", [self.i(0), off], ALIGN_MUL=4, RANGE=self.arg_bytes)

  def val_offset(self, k: int) -> int:
    return self.nbufs * 8 + k * 4

  # *** global memory ***
  def addr(self, slot: int, index, size: int = 4) -> Any:
    return self.alu("iadd", self.buf(slot), self.alu("u2u64", self.alu("imul", index, self.i(size))))

  def load(self, slot: int, index) -> Any:
    return self.intrinsic("load_global", [self.addr(slot, index)], ALIGN_MUL=4)

  def store(self, slot: int, index, value) -> None:
    self.intrinsic("store_global", [value, self.addr(slot, index)], nc=1, has_def=False, WRITE_MASK=1, ALIGN_MUL=4)

  # *** images ***
  def image_load(self, image: int, coord, dim=mesa.GLSL_SAMPLER_DIM_2D, array=False, texture=False) -> Any:
    """A texel as 4 floats: through the texture cache (isam) when `texture`, else as a UAV read (ldib)."""
    return self.intrinsic("image_load", [self.i(image), coord, N.nundef(self.b, dtypes.int), self.i(0)], nc=4, IMAGE_DIM=dim,
                          IMAGE_ARRAY=array, ACCESS=mesa.ACCESS_CAN_REORDER if texture else 0, DEST_TYPE=mesa.nir_type_float32)

  def image_store(self, image: int, coord, value, dim=mesa.GLSL_SAMPLER_DIM_2D, array=False) -> None:
    self.intrinsic("image_store", [self.i(image), coord, N.nundef(self.b, dtypes.int), value, self.i(0)], nc=4, has_def=False,
                   IMAGE_DIM=dim, IMAGE_ARRAY=array, ACCESS=0, SRC_TYPE=mesa.nir_type_float32)

  def image_size(self, image: int, nc: int, dim=mesa.GLSL_SAMPLER_DIM_2D, array=False) -> Any:
    return self.intrinsic("image_size", [self.i(image), self.i(0)], nc=nc, IMAGE_DIM=dim, IMAGE_ARRAY=array)

  # *** function-local arrays (registers, indexed by a0 when the index is not constant) ***
  def array(self, n: int, bits: int = 32) -> Any:
    t = N.glsl_type(dtypes.uint32 if bits == 32 else dtypes.uint16)
    return mesa.nir_local_variable_create(self.b.impl, mesa.glsl_array_type(t, n, 0).contents, b"arr").contents

  def _element(self, var, index) -> Any:
    @N.nir_instr(nc=1, bs=32, modes=lambda: var.data.mode, type=lambda: mesa.glsl_get_array_element(var.type))
    def element(b):
      d = mesa.nir_deref_instr_create(b.shader, mesa.nir_deref_type_array)
      d.contents.parent, d.contents.arr.index = N.nsrc(N.deref_var(b, var)), N.nsrc(index)
      return d
    return element(self.b)

  def array_store(self, var, index, value) -> None:
    self.intrinsic("store_deref", [self._element(var, index), value], has_def=False, WRITE_MASK=1)

  def array_load(self, var, index, bits: int = 32) -> Any:
    return self.intrinsic("load_deref", [self._element(var, index)], bits=bits)

  def compile(self) -> bytes:
    """The lib tinygrad's QCOMProgram loads (variant, const state, immediates, machine code)."""
    sh = self.b.shader.contents
    sh.info.num_ubos, sh.info.num_images = 1, self.uavs + self.textures
    mesa.nir_validate_shader(self.b.shader, b"nir_kernel")
    blob = mesa.struct_blob()
    mesa.nir_serialize(blob, self.b.shader, False)
    src = base64.b64encode(ctypes.string_at(blob.data, blob.size)).decode()
    mesa.ralloc_free(self.b.shader)
    ctypes.CDLL(None).free(blob.data)
    return compiler().compile(src)


def machine_code(lib: bytes) -> bytes:
  return IR3Compiler.unpack_lib(lib)[3]


@dataclass
class Arg:
  """A kernel argument: a buffer (1-D array) or an image ((h, w, 4) float32/float16, or (slices, h, w, 4) with a hand-made
  3D/array descriptor). `layer_pitch` spaces the slices (a multiple of 4 KiB, as the descriptor holds it)."""
  data: np.ndarray
  image: bool = False
  texture: bool = False
  kind: str = "2d"            # '2d', '3d', 'array'
  layer_pitch: int = 0


def _descriptor(a: Arg, va: int, uav: bool) -> list[int]:
  """A6XX_TEX_CONST_0..15 as tinygrad's QCOMArgsState writes them, plus TYPE 3D, DEPTH and ARRAY_PITCH for slices."""
  from tinygrad.runtime.ops_qcom import qreg
  slices, h, w, _ = a.data.shape
  fmt = mesa.FMT6_32_32_32_32_FLOAT if a.data.dtype == np.float32 else mesa.FMT6_16_16_16_16_FLOAT
  pitch = w * 4 * a.data.dtype.itemsize
  c0 = qreg.a6xx_tex_const_0(fmt=fmt) if uav else qreg.a6xx_tex_const_0(0x8, swiz_x=0, swiz_y=1, swiz_z=2, swiz_w=3, fmt=fmt)
  kind = mesa.A6XX_TEX_3D if a.kind == "3d" else mesa.A6XX_TEX_2D
  assert a.layer_pitch % 4096 == 0 and a.layer_pitch >= h * pitch
  return [c0, qreg.a6xx_tex_const_1(width=w, height=h),
          qreg.a6xx_tex_const_2(type=kind, pitch=pitch, pitchalign=(pitch & -pitch).bit_length() - 1 - 6),
          qreg.a6xx_tex_const_3(array_pitch=a.layer_pitch >> 12), va & 0xffffffff,
          (va >> 32) | qreg.a6xx_tex_const_5(depth=slices), qreg.a6xx_tex_const_6(plane_pitch=0x400000), qreg.a6xx_tex_const_7(13),
          0, 0, 0, 0, 0, 0, 0, 0]


def _layout(a: Arg) -> np.ndarray:
  """The bytes of an argument as the GPU sees them: slices `layer_pitch` apart for a sliced image."""
  if a.data.ndim != 4:
    return np.ascontiguousarray(a.data).view(np.uint8).reshape(-1)
  slices = a.data.shape[0]
  raw = np.zeros(slices * a.layer_pitch, np.uint8)
  for s in range(slices):
    sl = np.ascontiguousarray(a.data[s]).view(np.uint8).reshape(-1)
    raw[s * a.layer_pitch:s * a.layer_pitch + sl.size] = sl
  return raw


@contextlib.contextmanager
def before_each_dispatch(dev, emit):
  """tinygrad's QCOM queue (or the backend's subclass of it) calling `emit(queue, program, args_state)` just before the
  commands of every dispatch it records: how a test adds state tinygrad 0.14.0's runtime never binds."""
  queue = type(dev.hw_compute_queue_t())
  plain = queue.exec

  def exec_after(q, prg, args_state, global_size, local_size):
    emit(q, prg, args_state)
    return plain(q, prg, args_state, global_size, local_size)
  queue.exec = exec_after  # type: ignore[method-assign]
  try:
    yield
  finally:
    queue.exec = plain  # type: ignore[method-assign]


def arguments_as_ubo0(dev):
  """UBO descriptor 0 pointing at the kernel's arguments (the bytes the runtime pushes into the const file), which a UBO
  load Mesa did not push reads with ldc. Without it no UBO descriptor is loaded, as in tinygrad 0.14.0."""
  from tinygrad.runtime.ops_qcom import qreg

  def emit(q, prg, args_state):
    base, size = args_state.buf.va_addr + prg.buf_off, (prg.kernargs_alloc_size - prg.buf_off + 15) // 16
    q.cmd(mesa.CP_LOAD_STATE6_FRAG, qreg.cp_load_state6_0(state_type=mesa.ST6_UBO, state_src=mesa.SS6_DIRECT, state_block=mesa.SB6_CS_SHADER,
                                                          num_unit=1), 0, 0, base & 0xffffffff, (base >> 32) | (size << 17))
  return before_each_dispatch(dev, emit)


def bindless_sets(dev, sets: dict[int, Any]):
  """SP_CS_BINDLESS_BASE(n) (and HLSQ's twin) written before each dispatch: `sets[n]` is (the device buffer of set n's
  64-byte descriptors, the buffers they describe), all listed in the submit. tinygrad 0.14.0 binds no bindless set."""
  def emit(q, prg, args_state):
    for n, (buf, described) in sets.items():
      for b in (buf, *described):
        getattr(q, "_ref", lambda _: None)(b)   # the backend's BO table (MSM/EMU); KGSL needs none
      lo, hi = (buf.va_addr & 0xffffffff) | mesa.BINDLESS_DESCRIPTOR_64B, buf.va_addr >> 32
      q.reg(mesa.REG_A6XX_SP_CS_BINDLESS_BASE(n), lo, hi)
      q.reg(mesa.REG_A6XX_HLSQ_CS_BINDLESS_BASE(n), lo, hi)
  return before_each_dispatch(dev, emit)


def bindless_table(dev, images: list[tuple[np.ndarray, bool]]) -> tuple[Any, list[Any]]:
  """A descriptor set of 2D images ((h, w, 4) data, as a UAV?) in device memory: (the set's buffer, the images' buffers)."""
  bufs = []
  words: list[int] = []
  for data, uav in images:
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    buf = dev.allocator.alloc(raw.size)
    dev.allocator._copyin(buf, memoryview(raw))
    bufs.append(buf)
    words += _descriptor(Arg(data[None], image=True, texture=not uav, layer_pitch=(data.nbytes + 4095) // 4096 * 4096), buf.va_addr, uav)
  table = np.array(words, np.uint32).view(np.uint8)
  tbuf = dev.allocator.alloc(table.size)
  dev.allocator._copyin(tbuf, memoryview(table))
  return tbuf, bufs


def read_back(dev, buf, like: np.ndarray) -> np.ndarray:
  out = np.empty_like(like)
  dev.allocator._copyout(memoryview(out.view(np.uint8).reshape(-1)), buf)
  return out


def run(dev, lib: bytes, args: list[Arg], vals: tuple[int, ...] = (), groups: int = 1, local: int = 64) -> list[np.ndarray]:
  """Runs the kernel once on `dev` (a QCOM device) through tinygrad's QCOMProgram; every argument as it is afterwards.
  Images must come in tinygrad's order: UAVs, then textures."""
  sig: list[tuple] = []
  bufs, raws = [], []
  for n, a in enumerate(args):
    dt = {np.dtype(np.float32): dtypes.float, np.dtype(np.float16): dtypes.half}.get(a.data.dtype, dtypes.uint32)
    shape = a.data.shape[-3:] if a.image else (a.data.size,)
    sig.append((f"arg{n}", n, dt, shape))
    raw = _layout(a)
    buf = dev.allocator.alloc(max(raw.size, 4))
    dev.allocator._copyin(buf, memoryview(raw))
    bufs.append(buf)
    raws.append(raw)
  sig += [(f"val{k}", len(args) + k, dtypes.int, ()) for k in range(len(vals))]
  prg = dev.runtime(TinyELF(lib, "nir_kernel", dev.renderer.target, tuple(sig)))
  sliced = [(n, a) for n, a in enumerate(args) if a.data.ndim == 4]
  if sliced:
    fill = prg.fill_kernargs

    def fill_sliced(b, v=(), kernargs=None):
      st = fill(b, v, kernargs)
      uav_index, tex_index = 0, 0
      for n, a in enumerate(args):
        if not a.image:
          continue
        uav = not a.texture
        k = uav_index if uav else tex_index
        uav_index, tex_index = uav_index + uav, tex_index + (not uav)
        if a.data.ndim == 4:
          off = prg.ibo_off + 0x40 * k if uav else prg.tex_off + 0x40 * prg.tex_to_image.index(k)
          st.bind_sints_to_buf(*_descriptor(a, bufs[n].va_addr, uav), buf=st.buf, fmt="I", offset=off)
      return st
    prg.fill_kernargs = fill_sliced
  prg(*bufs, global_size=(groups, 1, 1), local_size=(local, 1, 1), vals=vals, wait=True)
  outs = []
  for a, raw, buf in zip(args, raws, bufs):
    got = np.empty_like(raw)
    dev.allocator._copyout(memoryview(got), buf)
    if a.data.ndim == 4:
      outs.append(np.stack([got[s * a.layer_pitch:s * a.layer_pitch + a.data[s].nbytes].view(a.data.dtype).reshape(a.data.shape[1:])
                            for s in range(a.data.shape[0])]))
    else:
      outs.append(got.view(a.data.dtype).reshape(a.data.shape))
  return outs
