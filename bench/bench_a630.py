#!/usr/bin/env python3
"""The a630's time per frame of each model kind, summed over every dispatch, with what bounds each kernel and a band.

  .venv/bin/python bench/bench_a630.py [--size tiny|full] [--camera WxH] [--work DIR] [--driving DIR] [--supercombo DIR]
                                       [--dmonitoring DIR] [--top 10] [--json OUT] [--dispatches OUT]

Each QCOM artifact is loaded on the emulated render node, stepped once to bind its graphs, then stepped once more with
execution on (emulator level B): every dispatch of that frame, in ring order, is costed by `backend.a630_cost` from the
work it executed (issued 64-lane waves, SP share, occupancy, launch overhead). The frame is the sum over every dispatch
(a kernel dispatched twice counts twice). The band is the frame under every corner of the unsourced constants' plausible
ranges (`a630_cost.UNSOURCED`). Without artifacts, the reference models of --size are written and compiled for QCOM first
(tiny: a few minutes on 2 cores; full: 60-190 s per model); --work DIR keeps them for the next run.

Calibration compares whole-frame figures measured on comma devices (docs/anchors.md) with the estimate of the program
that was measured, and fits the constants they can identify (`a630_cost.fit`, held to the shipped values by a prior).
openpilot's program is not ours: its tinygrad picks each kernel's register tile by heuristic and runs the models' graphs
as they are. So by default (--calibrate-against baseline) the calibrated kinds are compiled a second time with our
levers that openpilot lacks switched off (BASELINE_ENV), the fit is made on those, and the fitted constants then price
our artifacts: the aims are judged there. --calibrate-against artifacts fits on the artifacts themselves (no extra
compiles; biased low by every lever they carry).
--json OUT: {"models": {kind: {"ms", "band_ms", "dispatches", "dispatch_us"}}, "calibration": [{"source", "measured_ms", "estimated_ms"}]}
(dispatch_us: each dispatch of the frame in ring order, what bench/bench_gpu_shared.py plays).
--dispatches OUT: every dispatch's kind, kernel, estimate (us) and bound, for checking the sums.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from artifact import kinds  # noqa: E402
from backend import a630_cost as ac  # noqa: E402
from backend import timeline as tl  # noqa: E402
from backend.a630_timing import executed, work_of  # noqa: E402

KINDS = tuple(kinds.KINDS)   # as the artifact registry names them


def compile_args(kind: kinds.Kind, m: Path) -> list[str]:
  """`compile`'s model arguments for a kind's reference models in m (the pair by role, a one-file model as --model)."""
  if len(kind.models) == 1:
    return ["--model", str(m / kind.model_files[0])]
  return [a for role, f in zip(kind.models, kind.model_files) for a in (f"--{role}", str(m / f))]


@dataclass(frozen=True)
class Calibration:
  """A figure measured on a comma device and the dispatches of ours it stands for (part: 'model' leaves the warp out)."""
  source: str
  measured_ms: float
  kind: str
  part: str   # "frame" or "model"


# docs/anchors.md §2 and docs/a630-time.md: IR3 (Mesa's compiler, as ours) where one exists
CALIBRATION = (
  Calibration("tinygrad CI: 0.11 driving_vision QCOM:IR3 < 18 ms + driving_policy < 3.2 ms (limits, fastest of 20)", 21.2, "driving", "model"),
  Calibration("openpilot#38399: modelV2 host time on IR3, combined model", 24.8, "supercombo", "frame"),
  Calibration("openpilot#38399: driverStateV2 host time on IR3", 14.7, "dmonitoring", "frame"),
)
FIT_PARAMS = ["tex_rate", "launch_us", "overlap"]   # what three whole-frame figures can move; the prior holds the rest
# our compile levers openpilot's own build lacks: the shipped register tiles and the image layout's graph rewrites (local
# sizes stay ours: on a device tinygrad times its candidates, which the cost model's choice stands in for)
BASELINE_ENV = {"MODELD_QCOM_TILES": "off", "MODELD_IMAGE_LAYOUT": "off"}
# the calibrated programs are compiled for this camera, whatever --camera says: the figures' devices are not named, and
# between camera sizes only the warps' kernels differ
CALIBRATION_CAMERA = (1928, 1208)
AIMS_MS = {"driving": 20.0, "supercombo": 26.0, "stateful": 26.0, "dmonitoring": 11.0}   # issue 43's, per frame


@dataclass(frozen=True)
class Dispatched:
  work: ac.Work
  part: str          # "warp" (the warp_jit: warp and image queues) or "model"
  local: tuple[int, int, int]
  groups: tuple[int, int, int]
  read: frozenset = frozenset()      # [lo, hi) address ranges the dispatch read and wrote (level B), for the wait-for-idle lever
  written: frozenset = frozenset()


def build(size: str, work: Path, wanted, baseline: bool = False, camera: tuple[int, int] = CALIBRATION_CAMERA) -> dict[str, Path]:
  """The QCOM artifacts of `wanted` for the reference models of `size` and `camera`, compiled into work (baseline: into
  work/baseline, with BASELINE_ENV; another camera: into work/<kind>-<W>x<H>) unless already there."""
  cli = [sys.executable, "-m", "cli.main"]
  m = work / "models"
  env, what = ({**os.environ, **BASELINE_ENV}, " baseline") if baseline else (None, "")
  out = {}
  for kind in wanted:
    name = kind if camera == CALIBRATION_CAMERA else f"{kind}-{camera[0]}x{camera[1]}"
    art = work / "baseline" / name if baseline else work / name
    if (art / "manifest.json").exists():
      print(f"using the {size}{what} {kind} artifact compiled before in {art}")
      out[kind] = art
      continue
    k = kinds.KINDS[kind]
    mk = m / kind   # the combined and the stateful model share a file name
    if not all((mk / f).exists() for f in k.model_files):
      subprocess.run([*cli, "models", "--kind", kind, "--size", size, "-o", str(mk)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    t = time.perf_counter()
    r = subprocess.run([*cli, "compile", *compile_args(k, mk), "--camera", f"{camera[0]}x{camera[1]}", "--device", "QCOM", "-o", str(art)],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode:
      raise SystemExit(f"compile of the {size}{what} {kind} model failed:\n{r.stdout}\n{r.stderr}")
    print(f"compiled the {size}{what} {kind} model for QCOM on EMU in {time.perf_counter() - t:.0f} s", flush=True)
    out[kind] = art
  return out


def _kernels(jits, device: str) -> dict[int, float]:
  """Shader IOVA -> tinygrad's FLOP estimate, for every program of the JITs."""
  from tinygrad.engine import realize
  from tinygrad.uop.ops import Ops, sym_infer
  flops = {}
  for jit in jits:
    for u in jit.captured._linear.toposort():
      if u.op is Ops.PROGRAM and (rt := realize.runtime_cache.get((u.key, device))) is not None:
        flops[int(rt.lib_gpu.va_addr)] = float(sym_infer(u.src[0].arg.estimates.ops, {}))
  return flops


def record_frame(step, jits: dict[str, object], device: str) -> list[Dispatched]:
  """Every dispatch of one call of `step` on the emulated node, executed, in ring order (the first call binds, uncounted)."""
  from tinygrad import Device
  dev: Any = Device[device]
  step()
  dev.synchronize()
  try:
    _, ran = executed(dev, step)
  except RuntimeError as e:
    raise SystemExit(str(e)) from None
  part = {addr: tag for tag, jit in jits.items() for addr in _kernels([jit], device)}
  flops = _kernels(list(jits.values()), device)
  out = []
  for name, c, d in ran:
    groups, local = (int(d.groups[0]), int(d.groups[1]), int(d.groups[2])), (int(d.local_size[0]), int(d.local_size[1]), int(d.local_size[2]))
    w = replace(work_of(name or hex(d.shader_iova), c, d), flops=flops.get(d.shader_iova, 0.0))
    out.append(Dispatched(w, part.get(d.shader_iova, "model"), local, groups, getattr(c, "read", frozenset()), getattr(c, "written", frozenset())))
  return out


def camera_of(art: Path) -> tuple[int, int]:
  c = json.loads((art / "metadata.json").read_text())["camera"]
  return int(c["width"]), int(c["height"])


def frame_of(art: Path) -> list[Dispatched]:
  """Every dispatch of one frame of a QCOM artifact of any kind, on calibrate-a630's inputs (offcar/a630_calibration.py)."""
  os.environ["MODELD_DEV"] = "EMU+QCOM:IR3"
  from tinygrad import Device

  from artifact.format import verify_artifact
  from offcar.a630_calibration import program_frame
  frame, jits = program_frame(verify_artifact(art, device="QCOM"))
  return record_frame(functools.partial(frame, 0), jits, Device.DEFAULT)


def machine() -> str:
  from artifact.cpu_info import cpu_info
  c = cpu_info()
  return f"{c.model} ({platform.machine()}, {os.cpu_count()} cores; ISA {' '.join(sorted(c.flags & {'avx2', 'fma', 'avx512f', 'avx512_fp16'}))})"


def report(kind: str, frame: list[Dispatched], c: ac.Constants, top: int) -> None:
  work = [d.work for d in frame]
  us, terms, bound = ac.dispatch_us(work, c), ac.terms_us(work, c), ac.bounds(work, c)
  lo, hi = ac.band_us(work, c)
  by_bound: dict[str, list[float]] = collections.defaultdict(list)
  for b, t in zip(bound, us):
    by_bound[b].append(t)
  warp = sum(t for d, t in zip(frame, us) if d.part == "warp")
  # the model before waves, SP share and occupancy were counted (what README and compile reports gave), summed the same way
  old = sum(tl.executed_us(w.alu, w.sfu, w.tex, w.nbytes) for w in work)
  print(f"\n{kind}: {len(frame)} dispatches, {sum(us) / 1e3:.2f} ms per frame (band {lo / 1e3:.2f}-{hi / 1e3:.2f}; "
        f"previous model {old / 1e3:.2f}); warp and queues "
        f"{warp / 1e3:.2f} ms; {sum(w.flops for w in work) / 1e9:.2f} GFLOP, {sum(w.tex for w in work) / 1e6:.0f} M texels, "
        f"{sum(w.nbytes for w in work) / 1e6:.0f} MB ldg+stg")
  print("  bound by: " + ", ".join(f"{b} {len(v)} dispatches {sum(v) / 1e3:.2f} ms" for b, v in sorted(by_bound.items(), key=lambda kv: -sum(kv[1]))))
  agg: dict[str, dict] = {}
  for d, t, tm, b in zip(frame, us, terms, bound):
    a = agg.setdefault(d.work.name, {"n": 0, "us": 0.0, "terms": [0.0, 0.0, 0.0], "flops": 0.0, "bound": b, "local": d.local, "groups": d.groups,
                                      "active": d.work.fibers / max(1, d.work.groups * -(-d.work.group_size // ac.WAVE) * ac.WAVE)})
    a["n"] += 1
    a["us"] += t
    a["flops"] += d.work.flops
    a["terms"] = [x + y for x, y in zip(a["terms"], tm)]
  rows = sorted(agg.items(), key=lambda kv: -kv[1]["us"])[:top]
  head = (f"  {'kernel':<34} {'disp':>4} {'us':>8} {'%':>5} {'ALU us':>8} {'DRAM us':>8} {'TEX us':>8} {'bound':>6} {'GFLOPS':>6} "
          f"{'lanes':>5}  local x groups")
  print(head)
  for name, a in rows:
    gf = f"{a['flops'] / (a['us'] * 1e-6) / 1e9:.0f}" if a["flops"] else "-"
    print(f"  {name[:34]:<34} {a['n']:>4} {a['us']:>8.0f} {100 * a['us'] / sum(us):>5.1f} {a['terms'][0]:>8.0f} {a['terms'][1]:>8.0f} "
          f"{a['terms'][2]:>8.0f} {a['bound']:>6} {gf:>6} {100 * a['active']:>4.0f}%  "
          f"{'x'.join(map(str, a['local']))} x {'x'.join(map(str, a['groups']))}")
  print(f"  top {top} kernels: {100 * sum(a['us'] for _, a in rows) / sum(us):.1f} % of the frame")


def independent(frame: list[Dispatched]) -> int:
  """Dispatches that touch nothing a dispatch since the last kept wait for idle writes, nor write what one reads: the
  waits MSM_INDEPENDENT_NO_WFI=1 may drop (by the address ranges each dispatch touched, one submit assumed)."""
  from backend.emu.executor import order_hazard
  n, in_flight = 0, []
  for d in frame:
    if in_flight and order_hazard(in_flight, d.work.name, d.read, d.written) is None:
      n += 1
      in_flight.append((d.work.name, d.read, d.written))
    else:
      in_flight = [(d.work.name, d.read, d.written)]
  return n


def wait_for_idle_line(frames: dict[str, list[Dispatched]], c: ac.Constants) -> str:
  """The wait-for-idle lever by the model: launch_us holds the wait, the flush and the state load of a dispatch, so a
  dropped wait saves at most launch_us (its upper end) and all waits dropped (tinygrad#17070's hand edit, unsafe where a
  dispatch reads its predecessor's output) at most launch_us per dispatch."""
  parts = []
  for k, f in frames.items():
    n = independent(f)
    parts.append(f"{k} {n} of {len(f)} dispatches independent, <= {n * c.launch_us / 1e3:.3f} ms "
                 f"(all {len(f)} waits: <= {len(f) * c.launch_us / 1e3:.2f} ms, up to {len(f) * ac.UNSOURCED['launch_us'][1] / 1e3:.2f} at launch_us "
                 f"{ac.UNSOURCED['launch_us'][1]:g})")
  return "wait-for-idle lever (the model's saving bound): " + "; ".join(parts)


def calibration_points(frames: dict[str, list[Dispatched]], size: str) -> list[tuple[Calibration, ac.Point]]:
  out = []
  for cal in CALIBRATION:
    if cal.kind not in frames:
      continue
    work = tuple(d.work for d in frames[cal.kind] if cal.part == "frame" or d.part == "model")
    src = cal.source if size == "full" else f"{cal.source} [against a {size} stand-in: not comparable]"
    out.append((replace(cal, source=src), ac.Point(src, cal.measured_ms * 1e3, work)))
  return out


def aims_table(frames: dict[str, list[Dispatched]], c: ac.Constants, fitted: ac.Constants) -> str:
  """Each artifact's frame at the shipped and at the fitted constants, against issue 43's aim (judged at the fitted)."""
  lines = [f"\naims (issue 43), our artifacts at the fitted constants:\n  {'kind':<12} {'shipped':>8} {'fitted':>8} {'band':>15} "
           f"{'aim':>5}"]
  for k, f in frames.items():
    work = [d.work for d in f]
    lo, hi = ac.band_us(work, fitted)
    fit_ms = ac.frame_us(work, fitted) / 1e3
    aim = AIMS_MS.get(k)
    verdict = "" if aim is None else f"<= {aim:g} {'met' if fit_ms <= aim else 'missed'}"
    lines.append(f"  {k:<12} {ac.frame_us(work, c) / 1e3:8.2f} {fit_ms:8.2f} {lo / 1e3:7.2f}-{hi / 1e3:<7.2f} {verdict}")
  return "\n".join(lines)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", choices=("full", "tiny"), default="full", help="reference models to compile where no artifact is given")
  ap.add_argument("--work", type=Path, help="keep the compiled artifacts here and reuse them next time (default: a temp dir)")
  for k in KINDS:
    ap.add_argument(f"--{k}", type=Path, help=f"a QCOM {k} artifact (default: compile --size)")
  ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
  ap.add_argument("--camera", default="1928x1208", help="camera size the artifacts are compiled for (default 1928x1208; the comma "
                  "four's is 1344x760); the calibration's stay at 1928x1208")
  ap.add_argument("--top", type=int, default=10, help="kernels listed per model (default 10)")
  ap.add_argument("--json", type=Path, help="write the per-model figures and the calibration here")
  ap.add_argument("--dispatches", type=Path, help="write every dispatch's estimate here")
  ap.add_argument("--calibrate-against", choices=("baseline", "artifacts"), default="baseline",
                  help="fit on the calibrated kinds compiled without our levers (default; one more compile each) or on the artifacts")
  args = ap.parse_args()
  from selfdrive_glue.errors import UserError
  from selfdrive_glue.nv12 import parse_camera
  try:
    camera = parse_camera(args.camera)
  except UserError as e:
    ap.error(str(e))
  print(f"machine: {machine()} (the estimates do not depend on it)")
  c = ac.DEFAULT
  print("constants: " + ", ".join(f"{k}={v:g}" for k, v in ac.constants_dict(c).items()) + f"; band over {', '.join(ac.UNSOURCED)}")
  with tempfile.TemporaryDirectory(prefix="bench-a630-") as tmp:
    work = args.work or Path(tmp)
    work.mkdir(parents=True, exist_ok=True)
    given = {k: getattr(args, k) for k in args.kinds if getattr(args, k)}
    arts = {**build(args.size, work, [k for k in args.kinds if k not in given], camera=camera), **given}
    print("cameras: " + ", ".join(f"{k} {w}x{h}" for k, (w, h) in ((k, camera_of(a)) for k, a in arts.items())))
    cal_kinds = [cal.kind for cal in CALIBRATION if cal.kind in args.kinds]
    base = build(args.size, work, cal_kinds, baseline=True) if args.calibrate_against == "baseline" else {}
    frames = {k: frame_of(arts[k]) for k in args.kinds}
    base_frames = {k: frame_of(a) for k, a in base.items()}
  models, rows = {}, []
  for kind, frame in frames.items():
    report(kind, frame, c, args.top)
    work_list = [d.work for d in frame]
    us = ac.dispatch_us(work_list, c)
    lo, hi = ac.band_us(work_list, c)
    models[kind] = {"ms": round(sum(us) / 1e3, 4), "band_ms": [round(lo / 1e3, 4), round(hi / 1e3, 4)], "dispatches": len(frame),
                    "dispatch_us": [round(t, 3) for t in us]}
    rows += [{"kind": kind, "kernel": d.work.name, "part": d.part, "us": t, "bound": b} for d, t, b in zip(frame, us, ac.bounds(work_list, c))]
  cals = calibration_points(base_frames or frames, args.size)
  calibration = [{"source": cal.source, "measured_ms": cal.measured_ms, "estimated_ms": round(ac.frame_us(list(p.work), c) / 1e3, 4)}
                 for cal, p in cals]
  if cals:
    fitted = ac.fit([p for _, p in cals], FIT_PARAMS, c, prior=0.1)
    against = ("the program measured: the kinds compiled without our levers, " + ", ".join(f"{k}={v}" for k, v in BASELINE_ENV.items())
               if base_frames else "our artifacts, levers on (biased low)")
    print(f"\ncalibration (measured on comma devices vs the estimate of {against}; fit of {', '.join(FIT_PARAMS)} with a prior "
          "to the shipped values):")
    pts = [p for _, p in cals]
    for (cal, _), (_, m, e), (_, _, f) in zip(cals, ac.residuals(pts, c), ac.residuals(pts, fitted)):
      print(f"  {cal.kind:<12} {cal.part:<6} measured {m:6.2f} ms  estimated {e:6.2f} ({100 * (e - m) / m:+.0f} %)  fitted {f:6.2f} "
            f"({100 * (f - m) / m:+.0f} %)  {cal.source}")
    print("  fitted: " + ", ".join(f"{n}={getattr(fitted, n):.4g} (shipped {getattr(c, n):g})" for n in FIT_PARAMS))
    if args.size != "full":
      print(f"  (the figures are for full-size models: at --size {args.size} neither residual nor fit means anything)")
    print(aims_table(frames, c, fitted))
  print(wait_for_idle_line(frames, c))
  for name, scale in (("half", 0.5), ("double", 2.0)):
    t = replace(c, tex_rate=c.tex_rate * scale)
    print(f"texture rate {name}: " + ", ".join(f"{k} {ac.frame_us([d.work for d in f], t) / 1e3:.2f} ms" for k, f in frames.items()))
  if args.json:
    from selfdrive_glue.files import write_atomic
    write_atomic(args.json, json.dumps({"models": models, "calibration": calibration}, indent=1).encode())
  if args.dispatches:
    from selfdrive_glue.files import write_atomic
    write_atomic(args.dispatches, json.dumps(rows).encode())
  return 0


if __name__ == "__main__":
  sys.exit(main())
