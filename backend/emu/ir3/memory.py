"""Memory as a dispatch sees it: global memory through the GEM objects by IOVA, and 2D images through their 64-byte
texture/UAV descriptors (format, size, pitch, base IOVA), both for whole vectors of lanes at once."""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import numpy as np
from tinygrad.runtime.autogen import mesa

from backend.emu.executor import Dispatch, GpuFault, PageFault
from backend.emu.pm4 import field as _f

MEM_BYTES = {"u32": 4, "s32": 4, "f32": 4, "b32": 4, "u16": 2, "s16": 2, "f16": 2, "b16": 2, "u8": 1, "s8": 1}


def from_bytes(chunk: np.ndarray, tp: str) -> np.ndarray:
  """(m, size) loaded bytes -> register bits (8/16-bit signed types sign-extend to 32)."""
  size = chunk.shape[1]
  v = np.ascontiguousarray(chunk).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).reshape(-1)
  if tp == "s8":
    return v.view(np.int8).astype(np.int32).astype(np.uint32)
  if tp == "s16":
    return v.view(np.int16).astype(np.int32).astype(np.uint32)
  return v


def to_bytes(bits: np.ndarray, tp: str) -> np.ndarray:
  size = MEM_BYTES[tp]
  v = np.ascontiguousarray(bits).astype({1: np.uint8, 2: np.uint16, 4: np.uint32}[size], casting="unsafe")
  return v.view(np.uint8).reshape(-1, size)


def load_bytes(buf: np.ndarray, offs: np.ndarray, nbytes: int) -> np.ndarray:
  """(m, nbytes) bytes of `buf` at byte offsets `offs` (dword-aligned loads take the fast path)."""
  offs = np.asarray(offs, np.int64)
  if nbytes % 4 == 0 and buf.size % 4 == 0 and not (offs & 3).any():
    words = buf.view(np.uint32)
    idx = (offs >> 2)[:, None] + np.arange(nbytes // 4)
    return words[idx].view(np.uint8).reshape(len(offs), nbytes)
  return buf[offs[:, None] + np.arange(nbytes)]


def store_bytes(buf: np.ndarray, offs: np.ndarray, data: np.ndarray) -> None:
  offs = np.asarray(offs, np.int64)
  nbytes = data.shape[1] if data.ndim == 2 else 0
  if not nbytes or not len(offs):
    return
  if nbytes % 4 == 0 and buf.size % 4 == 0 and not (offs & 3).any():
    buf.view(np.uint32)[(offs >> 2)[:, None] + np.arange(nbytes // 4)] = np.ascontiguousarray(data).view(np.uint32)
  else:
    buf[offs[:, None] + np.arange(nbytes)] = data


# what an access is called (the `what` of each lookup) where it may write
_WRITING = ("stg", "atomic", "UAV", "bindless")


def merged(ranges) -> frozenset[tuple[int, int]]:
  """[lo, hi) ranges with the overlapping and touching ones joined."""
  out: list[list[int]] = []
  for lo, hi in sorted(ranges):
    if out and lo <= out[-1][1]:
      out[-1][1] = max(out[-1][1], hi)
    else:
      out.append([lo, hi])
  return frozenset((lo, hi) for lo, hi in out)


class GlobalMemory:
  """GEM objects of the running job as numpy byte arrays, found by IOVA through the node (which faults on an unmapped
  address, and in strict mode on a BO the submit did not list)."""

  def __init__(self, mem):
    self.mem = mem
    self._arrays: dict[int, tuple[int, np.ndarray]] = {}   # start iova -> (size, bytes)
    # address ranges [lo, hi) the dispatch read and wrote, for the ordering check (backend/emu/executor.py); a UAV may be
    # both, and is counted written
    self.read: set[tuple[int, int]] = set()
    self.written: set[tuple[int, int]] = set()

  def _touch(self, lo: int, hi: int, what: str) -> None:
    (self.written if what.startswith(_WRITING) else self.read).add((lo, hi))

  def _region(self, iova: int, what: str) -> tuple[int, np.ndarray]:
    start, size, host = self.mem.region(iova, what)
    if (hit := self._arrays.get(start)) is None:
      hit = self._arrays[start] = (size, np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(host)))
    return start, hit[1]

  def _groups(self, addr: np.ndarray, nbytes: int, what: str):
    """Yields (lane selection, BO bytes, offsets) covering every lane; one group when all lanes hit one BO."""
    addr = np.asarray(addr, np.uint64)
    if not addr.size:
      return
    left = np.ones(addr.size, np.bool_)
    while left.any():
      lo = int(addr[left].min())
      start, arr = self._region(lo, what)
      inside = left & (addr >= np.uint64(start)) & (addr < np.uint64(start + arr.size))
      offs = (addr[inside] - np.uint64(start)).astype(np.int64)
      if int(offs.max()) + nbytes > arr.size:
        bad = int(addr[inside][np.argmax(offs)])
        raise PageFault(f"{what} at {bad:#x}+{nbytes} runs past the end of its BO (ends at {start + arr.size:#x})")
      self._touch(start + int(offs.min()), start + int(offs.max()) + nbytes, what)
      yield inside, arr, offs
      left &= ~inside

  def single(self, addr: np.ndarray, nbytes: int, what: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(BO bytes, offsets) when every lane's access lies inside the BO of the lowest address, else None (more than one
    BO, or a fault, which `_groups` then raises). The lookup is the first one `_groups` makes, so it faults the same."""
    if not addr.size:
      return None
    lo, hi = int(addr.min()), int(addr.max())
    start, arr = self._region(lo, what)
    if hi - start + nbytes > arr.size:
      return None
    self._touch(lo, hi + nbytes, what)
    return arr, (addr - np.uint64(start)).astype(np.int64)

  def load(self, addr: np.ndarray, nbytes: int) -> np.ndarray:
    out = np.zeros((len(addr), nbytes), np.uint8)
    for sel, arr, offs in self._groups(addr, nbytes, "ldg address"):
      out[sel] = load_bytes(arr, offs, nbytes)
    return out

  def store(self, addr: np.ndarray, data: np.ndarray) -> None:
    for sel, arr, offs in self._groups(addr, data.shape[1], "stg address"):
      store_bytes(arr, offs, data[sel])

  def array(self, iova: int, nbytes: int, what: str) -> np.ndarray:
    start, arr = self._region(iova, what)
    if iova - start + nbytes > arr.size:
      raise PageFault(f"{what} at {iova:#x}+{nbytes:#x} runs past the end of its BO")
    self._touch(iova, iova + nbytes, what)
    return arr[iova - start:iova - start + nbytes]


# texel formats the QCOM runtime writes into descriptors: (bytes per texel, numpy component type)
FORMATS = {mesa.FMT6_32_32_32_32_FLOAT: (16, np.float32), mesa.FMT6_16_16_16_16_FLOAT: (8, np.float16)}


@dataclass(frozen=True)
class Image:
  width: int
  height: int
  pitch: int
  base: int
  fmt: int
  texel: int
  dtype: type
  data: np.ndarray     # the image's bytes (depth slices of height * pitch), a view into its BO
  depth: int = 0       # TEX_CONST_5.DEPTH as written: a 3D image's depth or a 2D array's layers (tinygrad's 2D images: 0)
  layer_pitch: int = 0   # bytes from one slice/layer to the next (TEX_CONST_3.ARRAY_PITCH, in 4 KiB units there)
  kind: int = 1        # TEX_CONST_2.TYPE: 0 1D, 1 2D, 2 cube, 3 3D, 4 buffer

  @property
  def slices(self) -> int:
    return max(self.depth, 1)


def parse_descriptor(desc: bytes, gmem: GlobalMemory, what: str) -> Image:
  d = struct.unpack("<16I", desc[:64])
  fmt = _f(d[0], "A6XX_TEX_CONST_0_FMT")
  if fmt not in FORMATS:
    raise GpuFault(f"{what}: texel format {fmt} is not emulated (RGBA32F {mesa.FMT6_32_32_32_32_FLOAT}, RGBA16F {mesa.FMT6_16_16_16_16_FLOAT})")
  if _f(d[0], "A6XX_TEX_CONST_0_TILE_MODE"):
    raise GpuFault(f"{what}: tiled images are not emulated")
  w, h = _f(d[1], "A6XX_TEX_CONST_1_WIDTH"), _f(d[1], "A6XX_TEX_CONST_1_HEIGHT")
  pitch = _f(d[2], "A6XX_TEX_CONST_2_PITCH")
  base = d[4] | (_f(d[5], "A6XX_TEX_CONST_5_BASE_HI") << 32)
  texel, dt = FORMATS[fmt]
  if pitch < w * texel:
    raise GpuFault(f"{what}: pitch {pitch} is less than width {w} x {texel} bytes")
  kind = _f(d[2], "A6XX_TEX_CONST_2_TYPE")
  if kind not in (mesa.A6XX_TEX_2D, mesa.A6XX_TEX_3D):
    raise GpuFault(f"{what}: texture type {kind} is not emulated (2D {mesa.A6XX_TEX_2D}, 2D array, 3D {mesa.A6XX_TEX_3D})")
  depth, layer_pitch = _f(d[5], "A6XX_TEX_CONST_5_DEPTH"), _f(d[3], "A6XX_TEX_CONST_3_ARRAY_PITCH") << 12
  slices = max(depth, 1)
  if slices > 1 and layer_pitch < h * pitch:
    raise GpuFault(f"{what}: {slices} slices {layer_pitch} bytes apart overlap (a slice is {h} rows x {pitch} bytes)")
  data = gmem.array(base, (slices - 1) * layer_pitch + (h - 1) * pitch + w * texel, f"{what} base")
  return Image(w, h, pitch, base, fmt, texel, dt, data, depth, layer_pitch, kind)


class Images:
  """The dispatch's texture (isam) and UAV (stib/ldib) descriptors, parsed on first use."""

  def __init__(self, d: Dispatch, gmem: GlobalMemory):
    self.d, self.gmem = d, gmem
    self._tex: dict[int, Image] = {}
    self._uav: dict[int, Image] = {}
    self._rows: dict[int, tuple[np.ndarray, int]] = {}   # texture slot -> its texels as rows, texels per image row
    self._native: dict[tuple[int, ...], np.ndarray] = {}
    self._bindless: dict[tuple[int, int], Image] = {}

  def bindless(self, dset: int, slot: int) -> Image:
    """The image of descriptor `slot` of bindless set `dset`: 64-byte descriptors from SP_CS_BINDLESS_BASE(dset)."""
    if (img := self._bindless.get((dset, slot))) is None:
      reg = mesa.REG_A6XX_SP_CS_BINDLESS_BASE(dset)
      if reg not in self.d.regs:
        raise GpuFault(f"bindless set {dset} is used but SP_CS_BINDLESS_BASE({dset}) was never written (tinygrad's QCOM runtime binds "
                       "no bindless sets)")
      lo, hi = self.d.regs[reg], self.d.regs.get(reg + 1, 0)
      if (size := _f(lo, "A6XX_SP_CS_BINDLESS_BASE_DESCRIPTOR_DESC_SIZE")) != mesa.BINDLESS_DESCRIPTOR_64B:
        raise GpuFault(f"bindless set {dset}: descriptor size {size} is not emulated (64-byte descriptors: {mesa.BINDLESS_DESCRIPTOR_64B})")
      addr = ((lo & ~3) | (hi << 32)) + 64 * slot
      desc = bytes(self.gmem.array(addr, 64, f"bindless set {dset} descriptor {slot}"))
      img = self._bindless[(dset, slot)] = parse_descriptor(desc, self.gmem, f"bindless set {dset} descriptor {slot}")
    return img

  def _get(self, cache: dict[int, Image], descs: bytes, slot: int, kind: str) -> Image:
    if (img := cache.get(slot)) is None:
      if (slot + 1) * 64 > len(descs):
        raise GpuFault(f"{kind} slot {slot} has no descriptor ({len(descs) // 64} loaded)")
      img = cache[slot] = parse_descriptor(descs[slot * 64:(slot + 1) * 64], self.gmem, f"{kind} descriptor {slot}")
    return img

  def gather(self, slot: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """isam for every lane: (n, 4) texels in the image's dtype, 0 outside the image (what `fetch` returns, transposed and
    before the widening to fp32; lanes a mask leaves out are read too, harmlessly: they are inside the image)."""
    img = self._get(self._tex, self.d.textures, slot, "texture")
    if (rows := self._rows.get(slot)) is None:
      # texels as rows of 4 components, row y*stride + x (np.take over rows is much faster than 2-D fancy indexing)
      stride = img.pitch // img.texel if img.pitch % img.texel == 0 else 0
      n = (img.height - 1) * stride + img.width if stride else 0
      rows = self._rows[slot] = (np.ndarray((n, 4), img.dtype, img.data, 0, (img.texel, img.texel // 4)) if stride else
                                 np.ndarray((img.height, img.width, 4), img.dtype, img.data, 0, (img.pitch, img.texel, img.texel // 4)), stride)
    grid, stride = rows
    ok = (x.view(np.uint32) < img.width) & (y.view(np.uint32) < img.height)
    if ok.all():
      return grid.take(y.astype(np.int64) * stride + x, axis=0) if stride else grid[y, x]
    out: np.ndarray = np.zeros((len(ok), 4), img.dtype)
    yo, xo = y[ok], x[ok]
    out[ok] = grid.take(yo.astype(np.int64) * stride + xo, axis=0) if stride else grid[yo, xo]
    return out

  def native_table(self, slots: tuple[int, ...]) -> int:
    """The textures of `slots` as the C image table native.Run reads (data pointer, pitch, width, height, texel bytes
    per row, in the order given), made once per dispatch; its address. Raises GpuFault as `gather` would."""
    if (t := self._native.get(slots)) is None:
      t = self._native[slots] = np.array([[img.data.ctypes.data, img.pitch, img.width, img.height, img.texel]
                                          for img in (self._get(self._tex, self.d.textures, s, "texture") for s in slots)], np.int64)
    return t.ctypes.data

  def _offsets(self, img: Image, x: np.ndarray, y: np.ndarray, sel: np.ndarray | None,
               z: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    shape = sel.shape if sel is not None else x.shape
    x, y = np.broadcast_to(x, shape), np.broadcast_to(y, shape)
    ok = (x >= 0) & (x < img.width) & (y >= 0) & (y < img.height)
    if z is not None:
      z = np.broadcast_to(z, shape)
      ok &= (z >= 0) & (z < img.slices)
    if sel is not None:
      ok &= sel
    offs = y[ok].astype(np.int64) * img.pitch + x[ok].astype(np.int64) * img.texel
    return ok, (offs if z is None else offs + z[ok].astype(np.int64) * img.layer_pitch)

  def _read(self, img: Image, x: np.ndarray, y: np.ndarray, sel: np.ndarray | None, z: np.ndarray | None) -> np.ndarray:
    ok, offs = self._offsets(img, x, y, sel, z)
    out = np.zeros((4, len(ok)), np.float32)
    raw = load_bytes(img.data, offs, img.texel)
    out[:, ok] = raw.view(img.dtype).reshape(-1, 4).T.astype(np.float32)
    return out

  def texture(self, slot: int, dset: int | None = None) -> Image:
    return self._get(self._tex, self.d.textures, slot, "texture") if dset is None else self.bindless(dset, slot)

  def uav(self, slot: int, dset: int | None = None) -> Image:
    return self._get(self._uav, self.d.uavs, slot, "UAV") if dset is None else self.bindless(dset, slot)

  def fetch(self, slot: int, x: np.ndarray, y: np.ndarray, sel: np.ndarray | None, z: np.ndarray | None = None,
            dset: int | None = None) -> np.ndarray:
    """isam: 4 components per lane as float32; a coordinate outside the image reads 0 (clamp-to-border, zero border).
    `z` is the slice of a 3D image or the layer of a 2D array; `dset` a bindless descriptor set."""
    return self._read(self.texture(slot, dset), x, y, sel, z)

  def load(self, slot: int, x: np.ndarray, y: np.ndarray, sel: np.ndarray | None, z: np.ndarray | None = None,
           dset: int | None = None) -> np.ndarray:
    """ldib (typed): `fetch` through the UAV descriptor. Outside the image it reads 0 as isam does: a choice, no source
    we found states what the hardware returns there."""
    return self._read(self.uav(slot, dset), x, y, sel, z)

  def size(self, slot: int, dset: int | None = None) -> tuple[int, int, int]:
    """resinfo: the UAV's width, height and depth/layers as its descriptor gives them."""
    img = self.uav(slot, dset)
    return img.width, img.height, img.depth

  def store_all(self, slot: int, x: np.ndarray, y: np.ndarray, comps: list[np.ndarray]) -> int | None:
    """`store` for every lane when all of them are inside the image (else None, and `store` does it): the same texel
    bytes, made without the per-lane selections."""
    img = self._get(self._uav, self.d.uavs, slot, "UAV")
    if not ((x.view(np.uint32) < img.width) & (y.view(np.uint32) < img.height)).all():
      return None
    vals = np.zeros((len(x), 4), np.float32)
    for c, v in enumerate(comps):
      vals[:, c] = v
    offs = y.astype(np.int64) * img.pitch + x.astype(np.int64) * img.texel
    store_bytes(img.data, offs, np.ascontiguousarray(vals.astype(img.dtype)).view(np.uint8).reshape(len(offs), img.texel))
    return len(offs) * img.texel

  def store(self, slot: int, x: np.ndarray, y: np.ndarray, comps: list[np.ndarray], sel: np.ndarray,
            z: np.ndarray | None = None, dset: int | None = None) -> int:
    """stib: writes the lanes' components in the image's format; a coordinate outside the image is dropped."""
    img = self.uav(slot, dset)
    ok, offs = self._offsets(img, x, y, sel, z)
    vals = np.stack([np.broadcast_to(c, ok.shape)[ok] for c in comps] + [np.zeros(int(ok.sum()), np.float32)] * (4 - len(comps)), 1)
    store_bytes(img.data, offs, np.ascontiguousarray(vals.astype(img.dtype)).view(np.uint8).reshape(len(offs), img.texel))
    return len(offs) * img.texel
