"""`modeld-msm doctor`: versions, usable GPU kernel interfaces, and render-node facts with a submit/fence round trip."""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import time
from typing import Any

from backend.qcom import ir3_compiler_present
from selfdrive_glue.argtypes import integer

TINYMESA_VERSION = "25.2.7.2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--emu", action="store_true", help="check the emulated render node (DEV=EMU+QCOM) instead of a real one")
  parser.add_argument("--rounds", type=integer(1), default=20, help="submit/fence round trips to time (default 20)")


def _line(ok: bool | None, what: str, detail: str) -> None:
  mark = {True: "ok  ", False: "FAIL", None: "--  "}[ok]
  print(f"[{mark}] {what:<22} {detail}")


def _versions() -> bool:
  import backend
  ok = True
  try:
    _line(True, "tinygrad", backend.check_tinygrad())
  except RuntimeError as e:
    _line(False, "tinygrad", str(e))
    ok = False
  if not ir3_compiler_present():
    # the car: its base install has no tinymesa (x86_64 wheels only), and needs none to run what was compiled off the car
    _line(None, "tinymesa", "not installed: compiled artifacts load and run; compiling for QCOM needs the [build] extra")
    return ok
  try:
    v = importlib.metadata.version("tinymesa")
    good = v == TINYMESA_VERSION
    _line(good, "tinymesa", v if good else f"{v}, but car artifacts are compiled with {TINYMESA_VERSION}: pip install tinymesa=={TINYMESA_VERSION}")
    ok = ok and good
  except importlib.metadata.PackageNotFoundError:
    _line(False, "tinymesa", f"not installed (IR3 needs it): pip install tinymesa=={TINYMESA_VERSION}")
    ok = False
  return ok


def _interfaces(emu: bool) -> list[str]:
  from backend.msm import find_render_node
  usable = []
  if os.path.exists("/dev/kgsl-3d0"):
    _line(True, "interface KGSL", "/dev/kgsl-3d0 (tinygrad's own QCOM path)")
    usable.append("KGSL")
  else:
    _line(None, "interface KGSL", "no /dev/kgsl-3d0")
  try:
    fd, path = find_render_node()
    del fd
    _line(True, "interface MSM", path)
    usable.append("MSM")
  except RuntimeError as e:
    _line(None, "interface MSM", str(e))
  level = ("level B: executes the IR3 code (EMU_EXEC=1)" if os.environ.get("EMU_EXEC", "0") not in ("", "0")
           else "level A: submissions only, no compute (EMU_EXEC=1 executes)")
  _line(True if emu else None, "interface EMU", f"emulated render node, {level}" if emu else "available with --emu")
  if emu:
    usable.append("EMU")
  return usable


def _node_report(iface_name: str, rounds: int) -> bool:
  import backend
  backend.install()
  from tinygrad import Context, Device
  try:
    with Context(DEV=f"{iface_name}+QCOM:IR3"):
      dev: Any = Device["QCOM"]
  except Exception as e:  # noqa: BLE001 - any failure to open is the answer here
    _line(False, f"open {iface_name}+QCOM", f"{type(e).__name__}: {e}")
    return False
  it = dev.iface
  s = it.settings
  _line(True, "render node", f"{it.path} (msm {'.'.join(map(str, it.driver_version))})")
  _line(True, "chip id", f"{it.chip_id:#010x} (Adreno {''.join(map(str, it.gpu_id))})")
  va = "not reported (no per-process VM)"
  if it.va_range:
    va = f"[{it.va_range[0]:#x}, {it.va_range[0] + it.va_range[1]:#x}) = {it.va_range[1] >> 20} MiB"
  _line(True, "GPU VA range", va)
  mode = (f"VM_BIND: our own addresses over the VA range ({it.vm_reason})" if it.vm_bind
          else f"kernel-managed: GET_IOVA, BO table per submit ({it.vm_reason})")
  _line(True, "GPU addresses", f"{mode}; MODELD_MSM_VM={it.vm_asked}")
  _line(True, "priorities", f"{it.priorities} (0 is highest)")
  _line(True, "in effect", f"priority {s.priority} (MSM_PRIORITY), chunks of {s.chunk_kernels or 'all'} kernels (MSM_CHUNK_KERNELS), "
                           f"{s.inflight} in flight (MSM_INFLIGHT)")
  try:
    times = []
    for _ in range(max(1, rounds)):
      st = time.perf_counter()
      dev.hw_compute_queue_t().signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
      dev.synchronize()
      times.append(time.perf_counter() - st)
    times.sort()
    _line(True, "submit/fence", f"{len(times)} round trips, median {times[len(times) // 2] * 1e6:.0f} us, fence {it.last_fence} retired")
  except Exception as e:  # noqa: BLE001
    _line(False, "submit/fence", f"{type(e).__name__}: {e}")
    return False
  if not _map_round_trip(dev):
    return False
  node = getattr(it, "node", None)
  if node is not None and node.execute:
    return _exec_check(node)
  return True


def _map_round_trip(dev) -> bool:
  """A fresh buffer mapped (VM_BIND MAP or GET_IOVA), written by a GPU job, freed (UNMAP once its fence retired): the
  address-mode path every allocation takes, end to end."""
  it = dev.iface
  before = (it.stats["vm_map"], it.stats["vm_unmap"], len(it.va.live) if it.va else 0)
  try:
    buf = dev._gpu_alloc(0x1000)
    sig = dev.signal_t(base_buf=buf)
    dev.hw_compute_queue_t().signal(sig, 42).signal(dev.timeline_signal, dev.next_timeline()).submit(dev)
    dev.synchronize()
    wrote, iova = sig.value, buf.va_addr
    del sig
    dev._gpu_free(buf)
    after = (it.stats["vm_map"], it.stats["vm_unmap"], len(it.va.live) if it.va else 0)
  except Exception as e:  # noqa: BLE001 - the failure is the answer
    _line(False, "map/submit/unmap", f"{type(e).__name__}: {e}")
    return False
  if it.vm_bind:
    ok = wrote == 42 and after[0] == before[0] + 1 and after[1] == before[1] + 1 and after[2] == before[2]
    detail = (f"VM_BIND MAP at {iova:#x}, the job wrote {wrote}, UNMAP after its fence; {after[2]} VA ranges live "
              f"({'as before' if after[2] == before[2] else f'was {before[2]}'})")
  else:
    ok, detail = wrote == 42, f"GET_IOVA {iova:#x}, the job wrote {wrote}, closed after its fence"
  _line(ok, "map/submit/unmap", detail)
  return ok


def _exec_check(node) -> bool:
  """Level B: one small kernel compiled by tinymesa, executed on the emulated a630, checked against numpy."""
  if not ir3_compiler_present():
    _line(None, "IR3 execution", "not checked: its test kernel needs Mesa's IR3 compiler (the [build] extra)")
    return True
  import numpy as np
  from tinygrad import Tensor
  try:
    x = np.arange(-500, 500, dtype=np.float32) / 50
    got = (Tensor(x, device="QCOM") * 3 + 1).exp2().numpy()
    want = np.exp2(x * 3 + 1)
    ok = bool(np.allclose(got, want, rtol=1e-5))
    tot = node.exec_total
    _line(ok, "IR3 execution", f"{tot.instrs} fiber-instructions over {tot.fibers} fibers, "
                               f"{'matches' if ok else 'DIFFERS from'} numpy (max rel diff {np.max(np.abs(got / want - 1)):.2g})")
    return ok
  except Exception as e:  # noqa: BLE001
    _line(False, "IR3 execution", f"{type(e).__name__}: {e}")
    return False


def run(args: argparse.Namespace) -> int:
  ok = _versions()
  usable = _interfaces(args.emu)
  target = "EMU" if args.emu else ("MSM" if "MSM" in usable else None)
  if target is None:
    print("no render node to check" + ("" if "KGSL" in usable else "; run with --emu to check the emulated one"))
    return 0 if ok and usable else 1
  return 0 if _node_report(target, args.rounds) and ok else 1
