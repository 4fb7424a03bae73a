"""Child program of tests/test_upstream_patch.py: tinygrad's QCOM driver on a recording stand-in for /dev/kgsl-3d0, so the
KGSL path of the stock driver and of the patched one can be compared ioctl by ioctl and command byte by command byte.

  python tests/kgsl_record.py OUT.json

The stand-in hands out GPU objects at fixed addresses (the GPU address is the CPU mapping, as on KGSL), keeps every
GPU_COMMAND's command bytes, and completes the signal writes (CP_EVENT_WRITE) so tinygrad's waits return; shaders are not
executed, so results are not computed, only the work tinygrad gives the kernel is recorded. The driver's own code runs
(backend.install() is not called).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import struct
import sys

import numpy as np
from tinygrad.runtime import ops_qcom
from tinygrad.runtime.autogen import kgsl, mesa
from tinygrad.runtime.support.hcq import FileIOInterface

BASE = 0x2000_0000_0000   # fixed GPU/CPU addresses: two runs lay memory out the same way
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_FIXED_NOREPLACE = 0x100000


def _req(ioctl) -> int:
  d, base, nr, st = ioctl.args
  return (d << 30) | (ctypes.sizeof(st) << 16) | (base << 8) | nr


NAMES = {_req(getattr(kgsl, n)): n.removeprefix("IOCTL_KGSL_") for n in dir(kgsl) if n.startswith("IOCTL_KGSL_")
         and getattr(getattr(kgsl, n), "args", (None,) * 4)[3] is not None}


class FakeKGSL(FileIOInterface):
  def __init__(self):
    self.path, self.fd = "/dev/kgsl-3d0", -1
    self.log: list[list] = []
    self.objs: dict[int, tuple[int, int]] = {}
    self.next_addr, self.ts = BASE, 0

  def __del__(self):
    pass

  def ioctl(self, request, arg):
    name = NAMES[request]
    if name == "GPUOBJ_ALLOC":
      arg.id = len(self.objs) + 1
      self.objs[arg.id] = (0, arg.mmapsize)
      self.log.append([name, arg.size, arg.flags, arg.mmapsize])
    elif name == "GPUOBJ_FREE":
      self.objs.pop(arg.id)
      self.log.append([name, arg.id])
    elif name == "DRAWCTXT_CREATE":
      arg.drawctxt_id = 7
      self.log.append([name, arg.flags])
    elif name == "DEVICE_GETPROPERTY":
      info = kgsl.struct_kgsl_devinfo.from_address(arg.value)
      info.chip_id = 0x06030001
      self.log.append([name, arg.type])
    elif name == "SETPROPERTY":
      self.log.append([name, arg.type, bytes((ctypes.c_char * arg.sizebytes).from_address(arg.value)).hex()[:16]])
    elif name == "GPU_COMMAND":
      obj = kgsl.struct_kgsl_command_object.from_address(arg.cmdlist)
      words = (ctypes.c_uint32 * (obj.size // 4)).from_address(obj.gpuaddr)
      self._signals(list(words))
      self.ts += 1
      arg.timestamp = self.ts
      self.log.append([name, arg.context_id, arg.numcmds, obj.gpuaddr, obj.size, obj.flags, hashlib.sha256(bytes(words)).hexdigest()])
    elif name == "DEVICE_WAITTIMESTAMP_CTXTID":
      pass   # every command completed when it was given
    else:
      raise OSError(f"kgsl ioctl {name} is not recorded")
    return 0

  def _signals(self, w: list[int]) -> None:
    i = 0
    while i < len(w):
      hdr = w[i]
      if hdr >> 28 == 7:
        op, n = (hdr >> 16) & 0x7f, hdr & 0x3fff
        if op == mesa.CP_EVENT_WRITE and n == 4:
          ctypes.c_uint32.from_address(w[i + 2] | w[i + 3] << 32).value = w[i + 4]
      else:
        n = hdr & 0x7f
      i += 1 + n

  def mmap(self, start, sz, prot, flags, offset):
    addr = libc.mmap(self.next_addr, sz, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
    assert addr == self.next_addr, f"fixed mapping at {self.next_addr:#x} failed"
    self.next_addr += (sz + 0xfffff) & ~0xfffff
    self.objs[offset // 0x1000] = (addr, sz)
    self.log.append(["mmap", addr - BASE, sz, offset])
    return addr


def main(out: str) -> int:
  fake = FakeKGSL()
  real = ops_qcom.FileIOInterface
  ops_qcom.FileIOInterface = lambda path, *a: fake if path == "/dev/kgsl-3d0" else real(path, *a)  # type: ignore[misc]
  ops_qcom.FileIOInterface.munmap = real.munmap  # type: ignore[attr-defined]
  from tinygrad import Device, Tensor, TinyJit
  dev = Device["QCOM"]
  x = np.random.default_rng(1).standard_normal((4, 33)).astype(np.float32)
  w = np.random.default_rng(2).standard_normal((8, 4, 3, 3)).astype(np.float32)
  a = Tensor(x, device="QCOM")
  ((a * 3 + 1).exp().sum(axis=1) + a.max()).realize()
  wt = Tensor(w, device="QCOM").realize()

  @TinyJit
  def f(img):
    return img.conv2d(wt, padding=1).relu() * 2
  for i in range(3):
    f(Tensor(np.full((1, 4, 8, 8), i, np.float32), device="QCOM").realize()).realize()
  del a
  dev.synchronize()
  # what every live GPU object holds at the end: commands, kernel arguments, shader images, signals, data
  memory = {i: hashlib.sha256(bytes((ctypes.c_char * sz).from_address(addr))).hexdigest() for i, (addr, sz) in sorted(fake.objs.items())}
  res = {"iface": type(getattr(dev, "iface", None)).__name__, "log": fake.log, "memory": memory}
  with open(out, "w") as fh:
    json.dump(res, fh)
  print("RECORDED", len(fake.log), struct.calcsize("P"))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
