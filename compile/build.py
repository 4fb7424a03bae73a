"""`modeld-msm compile`: the ONNX models of one kind + camera size + device -> a verified artifact directory. One driver
for every kind (artifact/kinds.py); what differs between kinds is the kind's data and its recipe (compile/programs/).

Validation before anything is written:
  1. each model through tinygrad matches onnxruntime on the raw ONNX (fp16-aware tolerance, compile/checks.py);
  2. the jitted programs equal the unjitted ones exactly, outputs and every device queue, over the kind's seeded step plan
     (full steps mixed with warp-only dropped-frame steps where the kind has them; frame buffers rotating like VisionIPC);
  3. the pickled JITs, loaded back, reproduce the whole plan exactly and react to different inputs.
The pickles are reproducible (the same models, versions and flags give the same bytes; the metadata holds no build time)
and carry no scratch memory: buffers every JIT writes before reading them are pickled without contents (jit_pickle.pickle_programs);
check 3 runs the reloaded JITs on freshly allocated scratch, so contents that were needed after all would fail it.
QCOM is captured on the emulated render node under the QCOM flags of the openpilot release it is for (capture.QCOM_FLAGS_OF,
recorded as metadata "flags" and "openpilot"), the node executing the a630 machine code (level B): the capture runs kernels
whose outputs are pickled with the program (weights converted on the device, e.g. into IMAGE=2 layouts), so a capture that
does not execute them pickles buffers that were never written. Checks 1 and 2 run on the emulated a630 as on the CPU, and 3
also proves that the reloaded pickles replay through the MSM submit path with strict BO validation and no GPU fault.
The metadata records each program's inputs and outputs by name ("programs"), which the runtime binds by.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from artifact import format as art_mod
from artifact import kinds
from artifact.jit_pickle import pickle_programs, unpickle_programs
from compile import image_layout, preflight
from compile.capture import check_out_dir, compile_options, open_capture, replay_on_emu
from compile.checks import ORT_ATOL, ORT_RTOL, ort_check, outputs_of, run_plan, same_steps
from compile.cpu import search as cpu_search
from compile.onnx_model import load_model_info
from compile.programs import check_signature, recipe_of
from compile.report import CompileReport
from compile.runtime_parse import check_runtime_parses
from compile.tuning import qcom_tiles
from modeld_msm.named_program import NamedProgram, host_arrays, host_tensors
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import nv12_info


def compile_artifact(kind: str | kinds.Kind, models: dict[str, str | Path], camera: tuple[int, int], device: str, out_dir: str | Path,
                     log=print, precision: str = "auto", layout: str | None = None, search: str | None = None,
                     openpilot: str | None = None) -> CompileReport:
  """models: {ONNX contract (the kind's `models`): path}. openpilot: whose QCOM flags (default the kind's)."""
  kind = kind if isinstance(kind, kinds.Kind) else kinds.get(kind)
  recipe = recipe_of(kind)
  if set(models) != set(kind.models):
    raise UserError(f"the {kind.title} is compiled from {' + '.join(kind.models)}, not {' + '.join(models) or 'nothing'}")
  if openpilot not in (None, kind.openpilot) and not kind.openpilot_choice:
    either = ", ".join(k.name for k in kinds.KINDS.values() if k.openpilot_choice)
    raise UserError(f"--openpilot {openpilot}: {kind.contract} is {kind.openpilot}'s {'driving ' if kind.process == 'modeld' else ''}model and "
                    f"builds with its flags; --openpilot chooses only for a model that runs under both ({either})")
  if search and not recipe.has_search:
    raise UserError(f"--search is the shipped kernel search of the 0.11 driving model; the {kind.title}'s compile has none")
  compute, why, use_layout, layout_why = compile_options(device, precision, layout)
  out_dir = Path(out_dir)
  report = CompileReport(out_dir)
  t0 = time.perf_counter()
  infos = {m: load_model_info(models[m], m) for m in kind.models}
  sessions = {m: preflight.ort_session(i) for m, i in infos.items()}
  report.checks.append(("model contract", "ok", recipe.contract_line(infos)))
  searched, search_why = recipe.search(device, compute, use_layout, camera, infos, search)
  # one line with the precision: how the program is lowered, not a separate check (the release counts checks)
  report.checks.append(("precision", "ok", f"{compute}: {why}; cpu layout {'on' if use_layout else 'off'} ({layout_why})"
                        + (f"; kernel search: {search_why}" if search_why is not None else "")))
  check_out_dir(out_dir, tuple(Path(models[m]) for m in kind.models))
  cap = open_capture(device, log, openpilot or kind.openpilot)
  from tinygrad.helpers import Context
  # the device opens inside the flags too: QCOM's renderer arch depends on IMAGE. A shipped search is replayed by capturing
  # under BEAM with its results already in tinygrad's search cache (compile/cpu/search.py): every kernel is a cache hit
  beam = {"BEAM": searched["beam"]} if searched else {}
  if searched:
    cpu_search.install(searched)
  # QCOM: the shipped register tiles of the big image convolutions (compile/tuning/qcom_tiles.py), heuristic opts elsewhere
  tiles = qcom_tiles.choose(device, kind.name, camera, {m: i.sha256 for m, i in infos.items()}, cap.flags, cap.dev_name)
  specs = {p.role: p.as_meta(camera) for p in kind.programs}
  plan = recipe.plan
  with Context(**cap.flags, **beam), tiles.hooked():
    nv = nv12_info(*camera)
    log(f"[compile] loading the {kind.title} for {camera[0]}x{camera[1]} on {cap.capture_target} in {compute}")
    for info in infos.values():
      preflight.tinygrad_parse(info)
    # before the build: a kernel the build runs (a weight moved to the device by a kernel) must compute its output too
    cap.start_execution()
    prog = recipe.build(infos, nv, cap.dev_name, compute, use_layout, openpilot or kind.openpilot)
    report.timings["load"] = time.perf_counter() - t0
    t = time.perf_counter()
    log(f"[compile] 1/3 tinygrad vs onnxruntime on the raw model{'s' if len(infos) > 1 else ''}")
    rng = np.random.default_rng(42)
    for m, runner in recipe.runners(prog).items():
      ort_check(infos[m], runner, rng, report, sessions[m])
    report.timings["onnxruntime check"] = time.perf_counter() - t

    t = time.perf_counter()
    log(f"[compile] 2/3 capturing the JITs and checking them against the unjitted program ({len(plan)} steps: {plan})")
    host = host_arrays(specs["step"])
    host_t = host_tensors(host)
    inputs = recipe.inputs(nv, cap.dev_name, 42)
    queues = prog.queues() if hasattr(prog, "queues") else {}

    def bound(fns: dict[str, Any]) -> dict[str, NamedProgram]:
      return {role: NamedProgram(fn, specs[role], role) for role, fn in fns.items()}
    unjitted = recipe.unjitted(prog)
    for role, fn in unjitted.items():
      check_signature(fn, [io["name"] for io in specs[role]["inputs"]], f"the {kind.name} {role} program")
    ref = run_plan(plan, inputs, bound(unjitted), host, host_t, queues)
    if queues:
      prog.reset_queues()
    jits = recipe.jits(prog)
    same_steps(plan, ref, run_plan(plan, inputs, bound(jits), host, host_t, queues), "the jitted programs")
    outs = outputs_of(plan, ref, [io["name"] for io in specs["step"]["outputs"]])
    if not all(np.isfinite(o).all() for run in outs for o in run):
      raise UserError(f"the {kind.title} produces non-finite outputs; check the model file{'s' if len(infos) > 1 else ''}")
    if len(outs) > 1 and np.array_equal(outs[0][0], outs[1][0]):
      raise UserError(f"internal error: the {kind.name} program ignores its inputs; please report it")
    out_specs = specs["step"]["outputs"]
    report.checks.append(("runtime parse", "ok", check_runtime_parses(
      kind, " + ".join(Path(models[m]).name for m in kind.models), {io["name"]: o.reshape(-1) for io, o in zip(out_specs, outs[0])},
      {io["name"]: infos[io["slices"]].output_slices for io in out_specs})))
    report.checks.append(("jit == unjitted", "ok", recipe.jit_line(len(outs))))
    report.timings["jit check"] = time.perf_counter() - t

    t = time.perf_counter()
    log("[compile] 3/3 pickling and checking the reloaded program")
    if queues:
      prog.reset_queues()
    files = {kind.program(role).file: blob for role, blob in zip(jits, pickle_programs(*jits.values()))}

  def replay() -> list[dict[str, np.ndarray]]:
    # the runtime's loader gives the loaded JITs buffers of their own (queues zero, as pickled), so the whole plan replays
    loaded = reload_programs(files)
    return run_plan(plan, inputs, bound(dict(zip(jits, loaded))), host, host_t, {})
  kernel_us: dict[str, float] = {}
  if device != "QCOM":
    same_steps(plan, ref, replay(), "the reloaded programs")
    report.checks.append(("pickle reload", "ok", recipe.reload_line()))
  else:
    back, kernel_us = replay_on_emu(cap.dev_name, replay, len(plan), report)
    same_steps(plan, ref, back, "the reloaded QCOM programs, executed on the emulated a630,")
    if (line := recipe.ci_line(sum(kernel_us.values()) / 1e3)) is not None:
      report.checks.append(("a630 vs tinygrad CI", "ok", line))
  report.timings["pickle check"] = time.perf_counter() - t
  image_rewrites = getattr(prog, "image_rewrites", {})
  if device == "QCOM":
    report.checks.append(("image layout", "ok", image_layout.summary(image_rewrites)))
    report.checks.append(("register tiles", "ok", tiles.summary()))
    tiles.finish()

  meta = cap.meta(camera, nv, tuple(infos.values()), compute, why, kernel_us, kind.name)
  extra = recipe.meta(prog, use_layout, layout_why, searched, search_why)
  if device == "QCOM":
    extra = {**extra, "qcom_tiles": tiles.meta(), "image_layout": image_rewrites}
  meta.update({**extra, "cpu_threads": cap.threads, "programs": kind.specs(camera),
               "validation": {"checks": report.checks, "ort_rtol": ORT_RTOL, "ort_atol": ORT_ATOL, **extra["validation"]}})
  art_mod.write_artifact(out_dir, files, meta)
  report.timings["total"] = time.perf_counter() - t0
  log(f"[compile] wrote {out_dir} ({sum(len(b) for b in files.values()) / 1e6:.1f} MB)")
  return report


def reload_programs(files: dict[str, bytes]) -> tuple:
  """The pickled programs loaded back as the car loads them: through the allowlisted unpickler, never pickle itself."""
  return unpickle_programs(*files.values(), names=tuple(files))
