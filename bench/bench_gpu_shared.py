#!/usr/bin/env python3
"""The a630 shared by three: modeld (driving model), dmonitoringmodeld (driver monitoring) and the UI's compositor, on one
ring without preemption (mainline msm). Each model process has its own submitqueue; both run at 20 Hz.

  .venv/bin/python bench/bench_gpu_shared.py [--a630-json BENCH_A630.json] [--modeld-kind driving|supercombo|stateful]
                                             [--artifact QCOM_DRIVING --dm-artifact QCOM_DM | --size full|tiny [--work DIR]]
                                             [--compositor-ms 5] [--ui-hz 60 20] [--dm-offset-ms 0 25] [--seconds 20] [--phases 10] [--plot OUT.png]

Each model's frame is a list of dispatch times on the a630. By default they follow the a630 time model's estimates:
`--a630-json` is what `bench/bench_a630.py --json` wrote ({"models": {"<kind>": {"ms", "dispatches", "dispatch_us"}}}),
whose `dispatch_us` is the executed frame's every dispatch in ring order, played as it is; without it (the figures of
docs/a630-time.md, or an older file) a frame of N dispatches and M ms is spread over its dispatches by a seeded
log-normal draw (a few long convolutions, many short kernels), so the table follows the estimates as levers land.
With --artifact/--dm-artifact (or --size, which compiles the reference models first; full: several minutes) the
dispatches are the real programs' instead: stepped on the emulated render node and costed by the artifact's `kernel_us`.

`backend.timeline.simulate_shared` plays both models against the compositor for each policy, UI rate (60 Hz: a job every
vsync; 20 FPS, openpilot's UI default on a comma 3X: every third) and camera phase (the driver camera's frames captured
with the road camera's, or half a frame later), over camera/vsync phases. "x alone" is a model's p99 over its p99 with
the GPU to itself (the compositor only, same policy); "aims": 0 misses/s and both within 1.2x; "20 Hz": both p99 under
50 ms, so no camera frame waits behind the previous one. The DM-yields policies hold the DM's next chunk while modeld's
frame is in flight (modeld_msm/gpu_turn.py), most with the car's bounds per chunk and per DM frame; "before" and
"after" are the car's submit policy without and with it. The compositor's job per UI frame is an assumption
(--compositor-ms). --plot draws 400 ms of the ring under "after" (first --ui-hz, cameras in phase; matplotlib).
"""
from __future__ import annotations

import argparse
import functools
import io
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend import chunking  # noqa: E402
from backend import timeline as tl  # noqa: E402
from backend.msm import DEFAULT_INFLIGHT  # noqa: E402
from bench.bench_gpu_priority import step_dispatches  # noqa: E402
from modeld_msm import gpu_turn  # noqa: E402
from selfdrive_glue.argtypes import integer, real  # noqa: E402
from selfdrive_glue.files import write_atomic  # noqa: E402

# on-device host times of openpilot's own processes over KGSL (openpilot PR #37866), the figures to compare with
KGSL_MS = {"modeld": (24.5, 28.0), "dmonitoringmodeld": (13.0, 19.0)}
# docs/a630-time.md "Every lever together" (bench_a630 --size full, 2026-12-07): a frame's estimate and dispatches per kind,
# when no --a630-json
DOC_FIGURES = {"driving": (19.86, 128), "supercombo": (21.26, 130), "stateful": (19.88, 127), "dmonitoring": (10.98, 72)}
PHASES = {"in phase": 0.0, "DM half a frame later": tl.MODEL_PERIOD_US / 2}
MAX_SHARE = 0.15   # a spread dispatch is at most this share of its frame (the largest real ones: 5-8 %)

def build(size: str, work: Path) -> tuple[Path, Path]:
  if all((work / n / "manifest.json").exists() for n in ("driving", "dmonitoring")):
    print(f"using the {size} artifacts compiled before in {work}")
    return work / "driving", work / "dmonitoring"
  cli = [sys.executable, "-m", "cli.main"]
  m = work / "models"
  subprocess.run([*cli, "models", "--size", size, "-o", str(m)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
  subprocess.run([*cli, "models", "--contract", "dmonitoring", "--size", size, "-o", str(m)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
  out = []
  for name, args in (("driving", ["--vision", str(m / "driving_vision.onnx"), "--policy", str(m / "driving_policy.onnx")]),
                     ("dmonitoring", ["--dmonitoring", str(m / "dmonitoring_model.onnx")])):
    t = time.perf_counter()
    r = subprocess.run([*cli, "compile", *args, "--device", "QCOM", "-o", str(work / name)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
      raise SystemExit(f"compile failed:\n{r.stdout}\n{r.stderr}")
    print(f"compiled the {size} {name} model for QCOM on EMU in {time.perf_counter() - t:.0f} s", flush=True)
    out.append(work / name)
  return out[0], out[1]


def programs(driving: Path, dm: Path) -> dict[str, list[float]]:
  os.environ["MODELD_DEV"] = "EMU+QCOM:IR3"
  from tinygrad import Device

  from artifact.format import verify_artifact
  from offcar.a630_calibration import program_frame
  out = {}
  for name, art in (("modeld", driving), ("dmonitoringmodeld", dm)):
    frame, jits = program_frame(verify_artifact(art, device="QCOM"))
    order, _ = step_dispatches(functools.partial(frame, 0), tuple(jits.values()), Device.DEFAULT)
    us = json.loads((art / "metadata.json").read_text())["kernel_us"]
    if missing := sorted({k for k, _, _ in order if k not in us}):
      raise SystemExit(f"{art}: no a630 time for {len(missing)} kernels ({missing[:3]}); recompile it")
    out[name] = [us[k] for k, _, _ in order]
  return out


def machine() -> str:
  from artifact.cpu_info import cpu_info
  c = cpu_info()
  return f"{c.model} ({platform.machine()}, {os.cpu_count()} cores; ISA {' '.join(sorted(c.flags & {'avx2', 'fma', 'avx512f', 'avx512_fp16'}))})"


def spread(total_ms: float, dispatches: int, seed: int) -> list[float]:
  """A frame of total_ms over its dispatches (us): seeded log-normal shares, none over MAX_SHARE of the frame."""
  rng = random.Random(seed)
  w = [rng.lognormvariate(0, 1.2) for _ in range(max(1, dispatches))]
  for _ in range(8):   # clip the few outliers and renormalize until none is over the cap
    total = sum(w)
    w = [min(x, MAX_SHARE * total) for x in w]
  total = sum(w)
  return [total_ms * 1e3 * x / total for x in w]


def _dispatches(model: dict, ms: float, n: int) -> list[float] | None:
  """bench_a630's frame in ring order (`dispatch_us`), if the file has it for all n dispatches: -> us, scaled to ms."""
  us = model.get("dispatch_us")
  if not (isinstance(us, list) and len(us) == n and all(isinstance(x, (int, float)) and x > 0 for x in us)):
    return None
  return [x * ms * 1e3 / sum(us) for x in us]


def from_estimates(a630_json: Path | None, modeld_kind: str, frame_ms: list[float] | None = None) -> tuple[dict[str, list[float]], str]:
  """Each model's frame as dispatch times (us): bench_a630's executed dispatches where its --json has them, else its (or the
  docs') per-frame figure spread over the dispatch count; `frame_ms` scales both frames to other totals."""
  models: dict = {}
  if a630_json is not None:
    try:
      models = json.loads(a630_json.read_text())["models"]
      figs = {k: (float(models[k]["ms"]), int(models[k]["dispatches"])) for k in (modeld_kind, "dmonitoring")}
    except (KeyError, TypeError, ValueError) as e:
      raise SystemExit(f"{a630_json}: not bench_a630's --json with {modeld_kind} and dmonitoring ({type(e).__name__}: {e}); "
                       "write it with bench/bench_a630.py --json OUT") from None
    src = f"{a630_json} (bench_a630)"
  else:
    if modeld_kind not in DOC_FIGURES:
      raise SystemExit(f"docs/a630-time.md has no {modeld_kind} frame; pass --a630-json from bench/bench_a630.py")
    figs = {k: DOC_FIGURES[k] for k in (modeld_kind, "dmonitoring")}
    src = "docs/a630-time.md"
  if frame_ms:   # what-if: the same dispatch counts at other frame times (e.g. the aims once the levers land)
    figs = {modeld_kind: (frame_ms[0], figs[modeld_kind][1]), "dmonitoring": (frame_ms[1], figs["dmonitoring"][1])}
    src += f", frames set to {frame_ms[0]:g} / {frame_ms[1]:g} ms"
  for k, (ms, n) in figs.items():
    if not (ms > 0 and n > 0):
      raise SystemExit(f"{src}: {k} has {ms} ms over {n} dispatches; both must be > 0")
  out, how = {}, []
  for name, kind, seed in (("modeld", modeld_kind, 1), ("dmonitoringmodeld", "dmonitoring", 2)):
    played = _dispatches(models.get(kind, {}), *figs[kind])
    how.append(f"{kind}'s executed dispatches" if played else f"{kind} spread")
    out[name] = played or spread(*figs[kind], seed=seed)
  return out, f"{src}; {', '.join(how)}"


def policies(progs: dict[str, list[float]]) -> list[tuple[str, dict[str, tl.Policy], dict]]:
  """(label, policy per process, the DM's yield as Client keyword arguments). "before" is the car's submit policy
  without the GPU turn, "after" with it: the DM, following, submits one chunk at a time (backend/msm.py DEFAULT_INFLIGHT,
  backend/chunking.py, modeld_msm/gpu_turn.py FOLLOWER_INFLIGHT)."""
  budget = chunking.budget_us() or chunking.DEFAULT_CHUNK_US
  car = tl.Policy(f"lowest prio, <= {budget / 1e3:g} ms chunks, {DEFAULT_INFLIGHT} in flight", 2, 0, DEFAULT_INFLIGHT, chunk_us=budget)
  one = tl.Policy(f"lowest prio, <= {budget / 1e3:g} ms chunks, 1 in flight", 2, 0, 1, chunk_us=budget)
  small = tl.Policy("lowest prio, <= 1.5 ms chunks, 1 in flight", 2, 0, 1, chunk_us=1500.0)
  bounded = {"yield_to": "modeld", "yield_chunk_us": gpu_turn.CHUNK_WAIT_MS * 1e3, "yield_frame_us": gpu_turn.FRAME_WAIT_MS * 1e3}
  bounds = f"<= {gpu_turn.CHUNK_WAIT_MS:g}/{gpu_turn.FRAME_WAIT_MS:g} ms"
  return [
    ("KGSL-style: prio 0, one submit per graph", {n: tl.STOCK for n in progs}, {}),
    (f"before: {budget / 1e3:g} ms chunks, {DEFAULT_INFLIGHT} in flight", {n: car for n in progs}, {}),
    (f"{budget / 1e3:g} ms chunks, 1 in flight", {n: one for n in progs}, {}),
    ("1 in flight + DM yields, unbounded", {n: one for n in progs}, {"yield_to": "modeld"}),
    (f"before + DM yields ({bounds})", {n: car for n in progs}, bounded),
    (f"after: before, DM 1 in flight + yields ({bounds})", {"modeld": car, "dmonitoringmodeld": one}, bounded),
    (f"1 in flight + DM yields ({bounds})", {n: one for n in progs}, bounded),
    ("1.5 ms chunks, 1 in flight + DM yields", {n: small for n in progs}, bounded),
  ]


def clients(progs, pols, dm_yield: dict, offset_us: float) -> list[tl.Client]:
  return [tl.Client("modeld", tuple(progs["modeld"]), pols["modeld"]),
          tl.Client("dmonitoringmodeld", tuple(progs["dmonitoringmodeld"]), pols["dmonitoringmodeld"], offset_us=offset_us, **dm_yield)]


def table(progs: dict[str, list[float]], setups, comp_us: float, ui_hz: float, offset_us: float, seconds: float, phases: int,
          alone_cache: dict) -> list[dict]:
  phase = next((k for k, v in PHASES.items() if v == offset_us), f"DM {offset_us / 1e3:g} ms later")
  print(f"\nUI at {ui_hz:g} Hz ({comp_us / 1e3:g} ms compositor job per UI frame, prio {tl.COMPOSITOR_PRIO}), cameras {phase}; "
        f"{phases} vsync phases x {seconds:g} s")
  w = max(len(x[0]) for x in setups)
  head = (f"{'policy':<{w}} {'miss/s':>6} {'UI wait':>7} {'modeld p50':>10} {'p99':>6} {'x alone':>7} {'DM p50':>6} {'p99':>6} {'x alone':>7} "
          f"{'aims':>4} {'20 Hz':>5}  (ms)")
  print(head)
  print("-" * len(head))
  rows = []
  for label, pols, dm_yield in setups:
    cl = clients(progs, pols, dm_yield, offset_us)
    shared = tl.sweep_shared(cl, seconds, phases, comp_us, ui_hz)
    row: dict = {"policy": label, "ui_hz": ui_hz, "phase": phase, "misses_per_s": shared.misses_per_s, "ui_wait_ms": shared.compositor_wait_max_ms}
    cells = []
    for c in cl:
      key = (c.name, c.policy, ui_hz, comp_us)
      if key not in alone_cache:
        alone_cache[key] = tl.sweep_shared([tl.Client(c.name, c.program_us, c.policy)], seconds, phases, comp_us, ui_hz).models[c.name].model_p99_ms
      r = shared.models[c.name]
      lat = r.latencies_ms
      p50 = lat[len(lat) // 2] if lat else 0.0
      ratio = r.model_p99_ms / max(alone_cache[key], 1e-9)
      row[c.name] = {"p50_ms": p50, "p99_ms": r.model_p99_ms, "x_alone": ratio}
      cells.append(f"{p50:>{10 if c.name == 'modeld' else 6}.2f} {r.model_p99_ms:>6.2f} {ratio:>7.2f}")
    row["aims_met"] = shared.misses_per_s == 0 and all(row[c.name]["x_alone"] <= 1.2 for c in cl)
    row["keeps_20hz"] = all(row[c.name]["p99_ms"] < tl.MODEL_PERIOD_US / 1e3 for c in cl)   # no frame waits behind the last
    rows.append(row)
    print(f"{label:<{w}} {shared.misses_per_s:>6.2f} {shared.compositor_wait_max_ms:>7.2f} {' '.join(cells)} "
          f"{'yes' if row['aims_met'] else 'no':>4} {'yes' if row['keeps_20hz'] else 'no':>5}")
  load = (sum(sum(p) for p in progs.values()) / tl.MODEL_PERIOD_US + comp_us * ui_hz / 1e6) * 100
  print(f"GPU load: {load:.0f} % (both models' frames every {tl.MODEL_PERIOD_US / 1e3:g} ms + the UI)"
        + ("; over 100 %: no submit policy keeps both at 20 Hz" if load > 100 else ""))
  return rows


def plot(progs, setups, comp_us: float, ui_hz: float, offset_us: float, out: Path, label: str) -> None:
  """The ring's jobs over 400 ms as bars per owner, vsyncs as lines."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("no matplotlib (pip install -e .[replay]): no plot")
    return
  _, pols, dm_yield = next(s for s in setups if s[0] == label)
  trace: list = []
  tl.simulate_shared(clients(progs, pols, dm_yield, offset_us), seconds=0.4, compositor_us=comp_us, seed=0, ui_hz=ui_hz, trace=trace)
  rows = {"compositor": 2, "modeld": 1, "dmonitoringmodeld": 0}
  colors = {"compositor": "tab:gray", "modeld": "tab:blue", "dmonitoringmodeld": "tab:orange"}
  fig, ax = plt.subplots(figsize=(12, 2.6))
  for who, y in rows.items():
    bars = [(a / 1e3, (b - a) / 1e3) for a, b, w in trace if w == who and a < 400e3]
    ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colors[who], edgecolor="white", linewidth=0.3)
  for k in range(int(400e3 / tl.VSYNC_US) + 1):
    ax.axvline(k * tl.VSYNC_US / 1e3, color="k", lw=0.3, alpha=0.4)
  ax.set_yticks(list(rows.values()), list(rows.keys()))
  ax.set_xlabel("ms (vertical lines: vsync)")
  ax.set_title(f"a630 ring, {label}; UI {ui_hz:g} Hz, {comp_us / 1e3:g} ms per UI frame", fontsize=9)
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=110)
  write_atomic(out, buf.getvalue())
  print(f"timeline plot: {out}")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--a630-json", type=Path, help="bench_a630's --json: the per-frame estimates (default: docs/a630-time.md's)")
  ap.add_argument("--modeld-kind", choices=("driving", "supercombo", "stateful"), default="driving", help="modeld's model kind (default driving)")
  ap.add_argument("--frame-ms", type=real(0, lo_open=True), nargs=2, metavar=("MODELD", "DM"),
                  help="what-if: these a630 times per frame instead of the estimates' (their dispatch counts kept)")
  ap.add_argument("--artifact", type=Path, help="QCOM driving artifact: its real dispatches (with --dm-artifact)")
  ap.add_argument("--dm-artifact", type=Path, help="QCOM driver-monitoring artifact")
  ap.add_argument("--size", choices=("full", "tiny"), help="compile the reference models of this size and use their real dispatches")
  ap.add_argument("--work", type=Path, help="with --size: keep the compiled artifacts here and reuse them next time")
  ap.add_argument("--compositor-ms", type=real(0), nargs="+", default=[tl.COMPOSITOR_US / 1e3],
                  help=f"the compositor's GPU time per UI frame, one table each (default {tl.COMPOSITOR_US / 1e3:g})")
  ap.add_argument("--ui-hz", type=real(0, lo_open=True), nargs="+", default=[60.0, 20.0], help="UI frame rates (divisors of 60; default 60 20)")
  ap.add_argument("--dm-offset-ms", type=real(0), nargs="+", default=[v / 1e3 for v in PHASES.values()],
                  help="where the driver camera's frames land after the road camera's, one table each (default 0 25)")
  ap.add_argument("--seconds", type=real(0, lo_open=True), default=20.0, help="simulated seconds per vsync phase (default 20)")
  ap.add_argument("--phases", type=integer(1), default=10, help="camera/vsync phases averaged (default 10)")
  ap.add_argument("--json", type=Path, help="write every row here")
  ap.add_argument("--plot", type=Path, help="a PNG of 400 ms of the ring under the policy as shipped (UI at the first --ui-hz, in phase)")
  args = ap.parse_args()
  if bool(args.artifact) != bool(args.dm_artifact):
    ap.error("--artifact and --dm-artifact go together")
  print(f"machine: {machine()} (the simulation's numbers do not depend on it)")
  if args.artifact or args.size:
    with tempfile.TemporaryDirectory(prefix="bench-gpu-shared-") as tmp:
      work = args.work or Path(tmp)
      work.mkdir(parents=True, exist_ok=True)
      driving, dm = (args.artifact, args.dm_artifact) if args.artifact else build(args.size, work)
      progs = programs(driving, dm)
    src = "the artifacts' real dispatches (kernel_us)"
  else:
    progs, src = from_estimates(args.a630_json, args.modeld_kind, args.frame_ms)
  print(f"frames from {src}:")
  for name, p in progs.items():
    print(f"  {name}: {len(p)} dispatches, {sum(p) / 1e3:.2f} ms of a630 time per frame (largest {max(p) / 1e3:.2f} ms)")
  setups = policies(progs)
  rows: list[dict] = []
  cache: dict = {}
  for comp_ms in args.compositor_ms:
    for ui_hz in args.ui_hz:
      for offset in (x * 1e3 for x in args.dm_offset_ms):
        rows += table(progs, setups, comp_ms * 1e3, ui_hz, offset, args.seconds, args.phases, cache)
  print(f"\non a comma device over KGSL (openpilot PR #37866, host time): modeld {KGSL_MS['modeld'][0]}-{KGSL_MS['modeld'][1]} ms, "
        f"dmonitoringmodeld {KGSL_MS['dmonitoringmodeld'][0]}-{KGSL_MS['dmonitoringmodeld'][1]} ms")
  if args.json:
    write_atomic(args.json, json.dumps({"source": src, "frames_ms": {k: sum(v) / 1e3 for k, v in progs.items()}, "rows": rows}, indent=1).encode())
  if args.plot:
    plot(progs, setups, args.compositor_ms[0] * 1e3, args.ui_hz[0], 0.0, args.plot, next(s[0] for s in setups if s[0].startswith("after")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
