"""`modeld-msm compile`: ONNX pair + camera size + device -> a verified artifact directory.

Validation before anything is written:
  1. each model through tinygrad matches onnxruntime on the raw ONNX (fp16-aware tolerance below);
  2. the fused program, jitted, equals the unjitted program exactly — outputs and every device queue — over a sequence
     of seeded steps that mixes full steps with warp-only (dropped-frame) steps and rotates frame buffers like VisionIPC;
  3. the pickled JITs, loaded back, reproduce the first step exactly and react to different inputs.
The pickles are reproducible (the same models, versions and flags give the same bytes; the metadata holds no build time)
and carry no scratch memory: buffers every JIT writes before reading them are pickled without contents (jit_pickle.pickle_programs);
check 3 runs the reloaded JITs on freshly allocated scratch, so contents that were needed after all would fail it.
QCOM is captured on the emulated render node under the QCOM flags of the openpilot release it is for (QCOM_FLAGS_OF, recorded
as metadata "flags" and "openpilot"), with
the node executing the a630 machine code (level B): the capture runs kernels whose outputs are pickled with the program
(weights converted on the device, e.g. into IMAGE=2 layouts), so a capture that does not execute them pickles buffers that
were never written. 1 and 2 run on the emulated a630 like on the CPU, and 3 also proves that the reloaded pickles replay
the whole step plan through the MSM submit path with strict BO validation, no GPU fault and the same outputs.
"""
from __future__ import annotations

import collections
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from artifact import cpu_threads
from artifact import format as art_mod
from artifact.cpu_info import cpu_info
from artifact.jit_pickle import pickle_programs, unpickle_programs
from artifact.load import frame_tensor
from compile import cpu_layout, cpu_search, preflight
from compile import precision as precision_mod
from compile.metres import describe, metres_apart
from compile.onnx_model import OnnxModelInfo, load_model_info
from compile.program import DrivingProgram
from modeld_msm.host_inputs import HostInputs
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import check_replaceable
from selfdrive_glue.nv12 import NV12Info, nv12_info

# fp16 graphs: each op rounds to 11 significant bits and the two runtimes order reductions differently, so compare with
# a tolerance scaled to fp16 precision: |a - b| <= ATOL + RTOL * |ref| elementwise
ORT_RTOL, ORT_ATOL = 2e-2, 2e-2
# step sequence for the JIT equivalence check: P = full step, W = warp-only (dropped frame)
STEP_PLAN = "PPWPWWPP"

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
class CompileReport:
  out_dir: Path
  timings: dict[str, float] = field(default_factory=dict)
  checks: list[tuple[str, str, str]] = field(default_factory=list)  # (check, result, detail)

  def table(self) -> str:
    w = max(len(c) for c, _, _ in self.checks)
    lines = [f"{'check':{w}s}  result  detail", "-" * (w + 40)]
    lines += [f"{c:{w}s}  {r:6s}  {d}" for c, r, d in self.checks]
    lines.append("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items()))
    return "\n".join(lines)


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
    if (node := _emu_node(self.dev_name)) is None:
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


def ort_check(info: OnnxModelInfo, runner, rng: np.random.Generator, report: CompileReport, sess=None) -> None:
  from tinygrad import Tensor
  sess = sess or preflight.ort_session(info)
  worst = 0.0
  apart: dict[str, float] = {}
  for _ in range(2):
    feeds = {}
    for name, shape in info.input_shapes.items():
      dt = np.dtype(info.input_dtypes[name])
      feeds[name] = rng.integers(0, 256, shape, dtype=np.uint8) if dt == np.uint8 else rng.standard_normal(shape).astype(dt)
    ref = sess.run(None, feeds)[0].astype(np.float32)
    # inputs enter as the program feeds them (fp32 host data cast on the device): tinygrad 0.14's IR3 path fails to verify
    # the policy graph fed fp16 tensors built from numpy directly (a WHERE mixing half and float)
    # (an fp32-widened runner takes the same values in fp32, exactly)
    want = {k: v.dtype for k, v in runner.graph_inputs.items()}
    inputs = {k: Tensor(v.astype(np.float32)).cast(want[k]) if v.dtype == np.float16 else Tensor(v) for k, v in feeds.items()}
    got = next(iter(runner(inputs).values())).float().numpy()
    if not np.isfinite(got).all():
      raise UserError(f"{info.kind} model produces non-finite outputs under tinygrad; check the model file")
    excess = np.abs(got - ref) - (ORT_ATOL + ORT_RTOL * np.abs(ref))
    worst = max(worst, float(np.abs(got - ref).max()))
    for k, v in metres_apart(got, ref, info.output_slices).items():
      apart[k] = max(apart.get(k, 0.0), v)
    if (excess > 0).any():
      i = int(np.argmax(excess))
      where = _locate(lambda feed=inputs: next(iter(runner(feed).values())).float().numpy())
      raise UserError(f"{info.kind} model: tinygrad and onnxruntime disagree at output {i}: {got.flat[i]:.5g} vs {ref.flat[i]:.5g} "
                      f"(tolerance {ORT_ATOL} + {ORT_RTOL}*|ref|)" + (f"; {where}" if where else ""))
  where = "in the driver's face" if "face_orientation_deg" in apart else "on the road"
  metres = f"; {where}: {describe(apart)}" if apart else ""
  report.checks.append((f"{info.kind} vs onnxruntime", "ok", f"max |diff| {worst:.3g} (tol {ORT_ATOL}+{ORT_RTOL}*|ref|){metres}"))


def _emu_node(dev_name: str):
  """The emulated render node under dev_name, or None on any other device."""
  from tinygrad import Device
  return getattr(getattr(Device[dev_name], "iface", None), "node", None)


def _locate(run) -> str | None:
  """On the executing emulator: the first kernel whose output differs from the same kernel on the CPU."""
  from tinygrad import Device
  if not getattr(node := _emu_node(Device.DEFAULT), "execute", False):
    return None
  from backend.emu.ir3.locate import first_divergent_kernel
  return first_divergent_kernel(run, node)


class _Steps:
  """Seeded inputs for the equivalence sequence; frames rotate through 3 buffers per camera like a VisionIPC ring."""

  def __init__(self, nv: NV12Info, device: str, seed: int):
    rng = np.random.default_rng(seed)
    self.frames = [rng.integers(0, 256, nv.size, dtype=np.uint8) for _ in range(6)]
    self.tensors = [frame_tensor(f, device) for f in self.frames]
    self.host = [self._host(rng) for _ in STEP_PLAN]

  @staticmethod
  def _host(rng: np.random.Generator) -> dict[str, np.ndarray]:
    tfm = np.array([[2.9, 0.0, 219.0], [0.0, 2.9, 465.0], [0.0, 0.0, 1.0]], np.float32)
    tfm[:2] += rng.normal(0, [[0.05, 0.05, 30.0]], (2, 3)).astype(np.float32)
    big = np.array([[1.25, 0.0, 645.0], [0.0, 1.25, 415.0], [0.0, 0.0, 1.0]], np.float32)
    big[:2] += rng.normal(0, [[0.02, 0.02, 20.0]], (2, 3)).astype(np.float32)
    desire = (rng.random(8) > 0.7).astype(np.float32)
    tc = np.zeros((1, 2), np.float32)
    tc[0, int(rng.integers(0, 2))] = 1
    return {"desire": desire, "traffic_convention": tc, "tfm": tfm, "big_tfm": big}

  def args(self, i: int, host_np, host_t) -> tuple:
    for k, v in self.host[i].items():
      host_np[k][...] = v
    frames = (self.tensors[(2 * i) % 6], self.tensors[(2 * i + 1) % 6])
    return (*frames, host_t["desire"], host_t["traffic_convention"], host_t["tfm"], host_t["big_tfm"])


def _run_sequence(policy_fn, warp_fn, steps: _Steps, host_np, host_t, queues) -> list[dict[str, np.ndarray]]:
  out = []
  for i, kind in enumerate(STEP_PLAN):
    a = steps.args(i, host_np, host_t)
    rec: dict[str, np.ndarray] = {}
    if kind == "P":
      v, p = policy_fn(*a)
      rec["vision"], rec["policy"] = v.numpy().copy(), p.numpy().copy()
    else:
      warp_fn(*a)
    for name, q in queues.items():
      rec[name] = q.numpy().copy()
    out.append(rec)
  return out


def runner_model(path: Path, compute: str, layout: bool, workdir: Path) -> tuple[Path, dict[str, int]]:
  """The ONNX file tinygrad runs for one model: widened to fp32 and/or with the CPU layout's graph rewrites, as written
  into workdir (onnxruntime always checks the original). -> (path, {rewrite: count})."""
  if compute == "fp32":
    path = precision_mod.widen_to_fp32(path, workdir / f"fp32_{path.name}")
  if not layout:
    return path, {}
  out = workdir / f"cpu_{path.name}"
  return out, cpu_layout.rewrite(path, out)


def build_program(vinfo: OnnxModelInfo, pinfo: OnnxModelInfo, nv: NV12Info, device: str, compute: str, layout: bool | None = None):
  """The unjitted per-frame program in the given precision and layout: fp32 builds the runners from widened copies of
  the models, the CPU layout from rewritten ones plus its op table (compile/cpu_layout.py); onnxruntime still checks the
  originals. layout None: as compile_artifact chooses it for `device`. The rewrite counts are on the program as
  `layout_rewrites`."""
  if layout is None:
    layout, _ = cpu_layout.choose(device, os.environ.get("MODELD_CPU_LAYOUT", "auto"))
  if compute != "fp32" and not layout:
    return DrivingProgram(vinfo, pinfo, nv, device)
  with tempfile.TemporaryDirectory(prefix="modeld-msm-build-") as td:
    (vpath, vn), (ppath, pn) = (runner_model(i.path, compute, layout, Path(td)) for i in (vinfo, pinfo))
    prog = DrivingProgram(replace(vinfo, path=vpath), replace(pinfo, path=ppath), nv, device, cpu_ops=layout)
  prog.layout_rewrites = {f"{m}_{k}": n for m, counts in (("vision", vn), ("policy", pn)) for k, n in counts.items()}
  return prog


def compile_options(device: str, precision: str, layout: str | None) -> tuple[str, str, bool, str]:
  """The options first (a word in the wrong place is refused at once), then the device: -> (compute precision, why, CPU
  layout on, why). layout None: MODELD_CPU_LAYOUT (benchmarks, A/B), else auto."""
  if device not in TARGETS:
    raise UserError(f"unknown device '{device}': use one of {', '.join(TARGETS)}")
  compute, why = precision_mod.choose(device, precision)
  use_layout, layout_why = cpu_layout.choose(device, layout or os.environ.get("MODELD_CPU_LAYOUT", "auto"))
  preflight.check_device(device)
  return compute, why, use_layout, layout_why


def compile_artifact(vision: str | Path, policy: str | Path, camera: tuple[int, int], device: str, out_dir: str | Path,
                     log=print, precision: str = "auto", layout: str | None = None, search: str | None = None) -> CompileReport:
  compute, why, use_layout, layout_why = compile_options(device, precision, layout)
  out_dir = Path(out_dir)
  report = CompileReport(out_dir)
  t0 = time.perf_counter()
  vinfo, pinfo = load_model_info(vision, "vision"), load_model_info(policy, "policy")
  sessions = {i.kind: preflight.ort_session(i) for i in (vinfo, pinfo)}
  report.checks.append(("model contract", "ok", f"vision out {vinfo.output_width}, policy out {pinfo.output_width}, "
                        f"{len(vinfo.output_slices)}+{len(pinfo.output_slices)} slices"))
  search_key = cpu_search.match_key(device=device, precision=compute, layout=use_layout, camera=camera,
                                    model_sha256={"vision": vinfo.sha256, "policy": pinfo.sha256})
  searched, search_why = cpu_search.choose(search or os.environ.get("MODELD_CPU_SEARCH", "auto"), search_key)
  # one line with the precision: how the program is lowered, not a separate check (the release counts checks)
  report.checks.append(("precision", "ok", f"{compute}: {why}; cpu layout {'on' if use_layout else 'off'} ({layout_why}); "
                        f"kernel search: {search_why}"))
  check_out_dir(out_dir, (Path(vision), Path(policy)))
  cap = open_capture(device, log)
  dev_name, capture_target, flags, threads = cap.dev_name, cap.capture_target, cap.flags, cap.threads
  from tinygrad.helpers import Context
  # the device opens inside the flags too: QCOM's renderer arch depends on IMAGE. A shipped search is replayed by capturing
  # under BEAM with its results already in tinygrad's search cache (compile/cpu_search.py): every kernel is a cache hit
  beam = {"BEAM": searched["beam"]} if searched else {}
  if searched:
    cpu_search.install(searched)
  with Context(**flags, **beam):
    nv = nv12_info(*camera)
    log(f"[compile] loading models for {camera[0]}x{camera[1]} on {capture_target} in {compute}")
    for info in (vinfo, pinfo):
      preflight.tinygrad_parse(info)
    prog = build_program(vinfo, pinfo, nv, dev_name, compute, layout=use_layout)
    report.timings["load"] = time.perf_counter() - t0
    cap.start_execution()
    rng = np.random.default_rng(42)
    t = time.perf_counter()
    log("[compile] 1/3 tinygrad vs onnxruntime on the raw models")
    ort_check(vinfo, prog.vision, rng, report, sessions["vision"])
    ort_check(pinfo, prog.policy, rng, report, sessions["policy"])
    report.timings["onnxruntime check"] = time.perf_counter() - t

    t = time.perf_counter()
    log(f"[compile] 2/3 capturing the JIT and checking it against the unjitted program ({len(STEP_PLAN)} steps: {STEP_PLAN})")
    host = HostInputs.zeros()
    host_np = {k: getattr(host, k) for k in ("desire", "traffic_convention", "tfm", "big_tfm")}
    host_t = host.tensors()
    steps = _Steps(nv, dev_name, 42)
    ref = _run_sequence(prog.run_policy, prog.run_warp, steps, host_np, host_t, prog.queues())
    prog.reset_queues()
    policy_jit, warp_jit = prog.jits()
    got = _run_sequence(policy_jit, warp_jit, steps, host_np, host_t, prog.queues())
    for i, (r, g) in enumerate(zip(ref, got)):
      for k in r:
        if not np.array_equal(r[k], g[k]):
          raise UserError(f"internal error: jitted program differs from unjitted at step {i} ({STEP_PLAN[i]}) in {k}; please report it")
      if "policy" in r and not (np.isfinite(r["vision"]).all() and np.isfinite(r["policy"]).all()):
        raise UserError(f"the models produce non-finite outputs at step {i}; check the model files")
    report.checks.append(("jit == unjitted", "ok", f"outputs and 4 queues bit-exact over {len(STEP_PLAN)} steps, rotating buffers"))
    report.timings["jit check"] = time.perf_counter() - t

    t = time.perf_counter()
    log("[compile] 3/3 pickling and checking the reloaded program")
    prog.reset_queues()
    policy_pkl, warp_pkl = pickle_programs(policy_jit, warp_jit)
  # outside the capture flags, like the runtime's load
  kernel_us: dict[str, float] = {}
  if device != "QCOM":
    _check_reload(policy_pkl, warp_pkl, steps, host_np, host_t, ref, report)
  else:
    kernel_us = _check_replay(policy_pkl, warp_pkl, steps, host_np, host_t, dev_name, report, ref)
  report.timings["pickle check"] = time.perf_counter() - t

  meta = cap.meta(camera, nv, (vinfo, pinfo), compute, why, kernel_us, "driving")
  meta.update({
    # compute-preserving rewrites the runners were built with (compile/cpu_layout.py); checked against onnxruntime like the rest
    "cpu_layout": {"on": use_layout, "why": layout_why, **prog.layout_rewrites,
                   "dense_conv_materialised": use_layout, "elu_own_kernel": use_layout,
                   # convolutions run on compile/cpu_pointwise.py's kernel (MODELD_CPU_POINTWISE=0: none)
                   "pointwise_kernel": {m: len(getattr(getattr(prog, m), "cpu_pointwise", {})) for m in ("vision", "policy")}},
    # kernels were split into this many parts, run concurrently at load (artifact/cpu_threads.py)
    "cpu_threads": threads,
    "search": {"used": searched is not None, "why": search_why, "beam": searched["beam"] if searched else None,
               "kernels": len(searched["entries"]) if searched else 0,
               # kernels the tuner re-searched and changed (compile/cpu_tune.py)
               "tuned": cpu_search.tuned_count(searched) if searched else 0},
    "validation": {"checks": report.checks, "ort_rtol": ORT_RTOL, "ort_atol": ORT_ATOL, "step_plan": STEP_PLAN},
  })
  art_mod.write_artifact(out_dir, {art_mod.POLICY_PKL: policy_pkl, art_mod.WARP_PKL: warp_pkl}, meta)
  report.timings["total"] = time.perf_counter() - t0
  log(f"[compile] wrote {out_dir} ({(len(policy_pkl) + len(warp_pkl)) / 1e6:.1f} MB)")
  return report


def _same_outputs(ref: list[dict[str, np.ndarray]], got: list[dict[str, np.ndarray]], what: str) -> None:
  for i, (r, g) in enumerate(zip(ref, got)):
    if "policy" in r and not (np.array_equal(r["vision"], g["vision"]) and np.array_equal(r["policy"], g["policy"])):
      raise UserError(f"internal error: {what} differ from the unjitted program at step {i} ({STEP_PLAN[i]}); please report it")


def _check_reload(policy_pkl: bytes, warp_pkl: bytes, steps: _Steps, host_np, host_t, ref: list[dict[str, np.ndarray]],
                  report: CompileReport) -> None:
  # the runtime's loader gives the loaded JITs buffers of their own (queues zero, as pickled), so the whole plan replays
  policy, warp = unpickle_programs(policy_pkl, warp_pkl, names=(art_mod.POLICY_PKL, art_mod.WARP_PKL))
  got = _run_sequence(policy, warp, steps, host_np, host_t, {})
  _same_outputs(ref, got, "the reloaded programs")
  if np.array_equal(got[0]["vision"], got[1]["vision"]):
    raise UserError("internal error: the reloaded program ignores its inputs; please report it")
  report.checks.append(("pickle reload", "ok", f"policy + warp JITs reloaded: outputs bit-exact over {len(STEP_PLAN)} steps"))


def _check_replay(policy_pkl: bytes, warp_pkl: bytes, steps: _Steps, host_np, host_t, dev_name: str, report: CompileReport,
                  ref: list[dict[str, np.ndarray]]) -> dict[str, float]:
  """QCOM: the pickles, loaded back and executed on the emulated a630, replay through the MSM submit path with every
  submit passing the node's (strict) BO validation, no GPU fault, and the unjitted program's outputs.
  -> each kernel's estimated a630 time (us) from the work it executed."""
  def replay():
    policy, warp = unpickle_programs(policy_pkl, warp_pkl, names=(art_mod.POLICY_PKL, art_mod.WARP_PKL))
    return _run_sequence(policy, warp, steps, host_np, host_t, {})
  got, kernel_us = replay_on_emu(dev_name, replay, len(STEP_PLAN), report)
  _same_outputs(ref, got, "the reloaded QCOM programs, executed on the emulated a630,")
  return kernel_us


def replay_on_emu(dev_name: str, replay, steps: int, report: CompileReport) -> tuple[Any, dict[str, float]]:
  """Run `replay` (load the pickles back, run them) on the emulated render node, counting every dispatch: it must submit
  work, pass the node's BO validation and fault nowhere. -> (what replay returned, each kernel's a630 time estimate in us
  from the work it executed); the report gets the replay and time-estimate rows."""
  from tinygrad import Device

  from backend.msm import MSMFault, MSMTimeout
  from backend.timeline import executed_us
  dev, node = Device[dev_name], _emu_node(dev_name)   # the compile checked that it is the emulated node
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
