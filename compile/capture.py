"""The device a compile captures on: targets per device, the QCOM flags of each openpilot release, opening the capture
(QCOM: the emulated render node executing the a630 code) and replaying reloaded programs on it, the output folder's check."""
from __future__ import annotations

import collections
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artifact import cpu_threads
from artifact import format as art_mod
from artifact.cpu_info import cpu_info
from compile import precision as precision_mod
from compile import preflight
from compile.cpu import layout as cpu_layout
from compile.onnx_model import OnnxModelInfo
from compile.report import CompileReport
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import check_replaceable
from selfdrive_glue.nv12 import NV12Info

# device argument -> (capture target, load target)
TARGETS = {
  "CPU": ("CPU", "CPU"),
  "CPU:LLVM": ("CPU:LLVM", "CPU:LLVM"),
  "QCOM": ("EMU+QCOM:IR3", "QCOM:IR3"),
  # workstation and cluster GPUs, for replay and development (tinygrad's own runtimes; captured and loaded on the GPU itself)
  "CUDA": ("CUDA", "CUDA"),
  "NV": ("NV", "NV"),
  "AMD": ("AMD", "AMD"),
}
# tinygrad flags a QCOM capture runs under: those of the openpilot release the artifact is for (its modeld build on the
# device): fp16, no local memory, the whole step as one graph (JIT_BATCH_SIZE=0 lifts the batch limit), tinygrad's openpilot
# scheduling hacks, and images: 0.11 builds IMAGE=2 on larch64 (docs contract §12), master IMAGE=1 (its modeld's QCOM flags)
QCOM_FLAGS_OF = {
  "0.11": {"FLOAT16": 1, "NOLOCALS": 1, "JIT_BATCH_SIZE": 0, "OPENPILOT_HACKS": 1, "IMAGE": 2},
  "master": {"FLOAT16": 1, "NOLOCALS": 1, "JIT_BATCH_SIZE": 0, "OPENPILOT_HACKS": 1, "IMAGE": 1},
}



@dataclass
class Capture:
  """The device a compile captures on, opened for `device` (compile TARGETS): its tinygrad name, targets and flags."""
  device: str
  dev_name: str
  capture_target: str
  load_target: str
  flags: dict[str, int]
  threads: Any
  openpilot: str | None = None   # whose QCOM flags (QCOM_FLAGS_OF); None where no flags apply

  def start_execution(self) -> None:
    """QCOM: the emulated node executes the a630 code from here on (level B) and a page fault fails the build."""
    if self.device != "QCOM":
      return
    from tinygrad import Device
    if (node := emu_node(self.dev_name)) is None:
      raise UserError(f"internal error: QCOM capture opened {type(getattr(Device[self.dev_name], 'iface', None)).__name__}, not the "
                      "emulated render node; please report it")
    node.set_execute(True)
    node.fault_policy = "strict"   # a page fault while capturing must fail the build, not leave quietly wrong outputs behind

  def meta(self, camera: tuple[int, int], nv: NV12Info, infos: tuple[OnnxModelInfo, ...], compute: str, why: str,
           kernel_us: dict[str, float], kind: str) -> dict[str, Any]:
    """The metadata every artifact kind records (no build time: the same inputs give the same bytes)."""
    from tinygrad import Device
    d = Device[self.dev_name]
    on_cpu = self.device.startswith("CPU")
    return {
      "format": art_mod.FORMAT, "kind": kind,
      "camera": {"width": camera[0], "height": camera[1], "stride": nv.stride, "y_height": nv.y_height, "uv_height": nv.uv_height,
                 "uv_offset": nv.uv_offset, "size": nv.size},
      "device": self.dev_name.split(":")[0], "capture_target": self.capture_target, "load_target": self.load_target,
      "target": self.load_target, "renderer": type(d.renderer).__name__, "arch": str(d.arch or ""), "host": platform.machine(),
      "versions": art_mod.installed_versions(),
      "models": {i.kind: {"file": i.path.name, "sha256": i.sha256, "input_shapes": {k: list(v) for k, v in i.input_shapes.items()},
                          "input_dtypes": i.input_dtypes,
                          "output_shapes": {k: list(v) for k, v in i.output_shapes.items()},
                          "output_slices": {k: [s.start, s.stop] for k, s in i.output_slices.items()}, "metadata": i.metadata}
                 for i in infos},
      "flags": dict(self.flags), "openpilot": self.openpilot,
      # estimated a630 time per kernel from its executed work: bound graphs are cut into submits by it (backend/chunking.py)
      "kernel_us": kernel_us,
      "precision": {"compute": compute, "why": why, "cpu": cpu_info().summary() if on_cpu else None},
      # the CPU whose extensions the code may use (-march=native): verify refuses it on a CPU that lacks one of them
      "build_cpu": cpu_info().as_dict() if on_cpu else None,
    }


def open_capture(device: str, log=print, openpilot: str = "0.11") -> Capture:
  """Point tinygrad at the capture target of `device` (QCOM: our kernel interfaces installed, the emulated node first, and
  the flags of the `openpilot` release the artifact is for)."""
  capture_target, load_target = TARGETS[device]
  if device == "QCOM":
    import backend
    backend.install()
  from tinygrad import Device
  from tinygrad.helpers import DEV
  DEV.value = capture_target
  dev_name = Device.DEFAULT
  threads = cpu_threads.install(dev_name) if device == "CPU" else None
  flags = QCOM_FLAGS_OF[openpilot] if device == "QCOM" else {}
  if flags:
    log(f"[compile] capture flags (openpilot {openpilot}'s): {' '.join(f'{k}={v}' for k, v in flags.items())}")
  return Capture(device, dev_name, capture_target, load_target, dict(flags), threads, openpilot if flags else None)


def emu_node(dev_name: str):
  """The emulated render node under dev_name, or None on any other device."""
  from tinygrad import Device
  return getattr(getattr(Device[dev_name], "iface", None), "node", None)


def compile_options(device: str, precision: str, layout: str | None) -> tuple[str, str, bool, str]:
  """The options first (a word in the wrong place is refused at once), then the device: -> (compute precision, why, CPU
  layout on, why). layout None: MODELD_CPU_LAYOUT (benchmarks, A/B), else auto."""
  if device not in TARGETS:
    raise UserError(f"unknown device '{device}': use one of {', '.join(TARGETS)}")
  compute, why = precision_mod.choose(device, precision)
  use_layout, layout_why = cpu_layout.choose(device, layout or os.environ.get("MODELD_CPU_LAYOUT", "auto"))
  preflight.check_device(device)
  return compute, why, use_layout, layout_why


def replay_on_emu(dev_name: str, replay, steps: int, report: CompileReport) -> tuple[Any, dict[str, float]]:
  """Run `replay` (load the pickles back, run them) on the emulated render node, counting every dispatch: it must submit
  work, pass the node's BO validation and fault nowhere. -> (what replay returned, each kernel's a630 time estimate in us
  from the work it executed); the report gets the replay and time-estimate rows."""
  from tinygrad import Device

  from backend.msm import MSMFault, MSMTimeout
  from backend.timeline import executed_us
  dev, node = Device[dev_name], emu_node(dev_name)   # the compile checked that it is the emulated node
  subs0, disp0, faults0 = node.stats.submits, node.stats.dispatches, len(node.stats.faults)
  kept, node.counts = node.counts, collections.deque()   # every dispatch of the replay, not only the node's recent history
  try:
    got = replay()
    dev.synchronize()
  except (MSMFault, MSMTimeout, OSError) as e:
    raise UserError(f"internal error: the reloaded QCOM program does not replay on the emulated render node: {e}; please report it") from None
  finally:
    executed, node.counts = node.counts, kept
  kernel_us = {name: round(executed_us(c.alu, c.sfu, c.tex, c.mem_load + c.mem_store), 2) for name, c in executed if name}
  subs, disp, faults = node.stats.submits - subs0, node.stats.dispatches - disp0, node.stats.faults[faults0:]
  if faults:
    raise UserError(f"internal error: the reloaded QCOM program faulted on the emulated render node: {faults[0]}; please report it")
  if not subs or not disp:
    raise UserError("internal error: the reloaded QCOM program submitted no GPU work; please report it")
  report.checks.append(("pickle replay (EMU)", "ok", f"reloaded JITs replayed {steps} steps: {subs} submits, {disp} dispatches, "
                        f"{'strict' if node.strict else 'NON-strict'} BO validation, 0 faults (outputs bit-exact with the unjitted "
                        "program, executed (level B))"))
  report.checks.append(("a630 time estimate", "ok", f"{len(kernel_us)} distinct kernels, {sum(kernel_us.values()) / 1e3:.2f} ms "
                        "summed one run each, not a frame (bench/bench_a630.py sums every dispatch); chunks submits by time"))
  return got, kernel_us


def check_out_dir(out_dir: Path, inputs: tuple[Path, ...] = ()) -> None:
  parent = out_dir.resolve().parent
  probe = parent
  while not probe.exists():
    probe = probe.parent
  if not probe.is_dir():
    raise UserError(f"output directory {out_dir} cannot be created: {probe} is a file; choose another -o")
  # os.access says yes to root everywhere (even /proc), so try for real before the minutes of compiling
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".modeld-msm-probe-", dir=probe))
  except OSError as e:
    raise UserError(f"output directory {out_dir} is not writable ({e.strerror} in {probe}); choose another -o") from None
  check_replaceable(out_dir, {art_mod.MANIFEST: "format"}, "artifact of ours", inputs)
