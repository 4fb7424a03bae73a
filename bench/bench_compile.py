"""The compile step's output on the CPU: per-call latency of the compiled artifact vs onnxruntime, and compile wall time.

For each model size and tinygrad configuration, one fresh worker process (so env knobs like BEAM apply from import):
  1. compiles the reference models into an artifact (`compile_artifact`, 1928x1208) and records the wall time;
  2. loads the artifact (`load_programs`) and times its fused step (warp x2 + vision + policy, outputs read back)
     and its warp-only step;
  3. times like-for-like TinyJits of vision alone and policy alone built from tinygrad's `OnnxRunner`;
  4. times onnxruntime (CPUExecutionProvider, default threads) on the same ONNX files and inputs in its own process just
     before (in one process the two runtimes' worker threads slowed each other by up to 4x on this 2-core box).
Ratios are tinygrad / onnxruntime (< 1 means tinygrad is faster), measured back to back on the same machine.

  .venv/bin/python bench/bench_compile.py --size tiny --configs CPU@fp16,CPU@fp32,CPU:LLVM@fp32,CPU@fp32+BEAM=2
  .venv/bin/python bench/bench_compile.py --size full --configs CPU@fp16,CPU@fp32 --iters 30
A config is DEVICE[@PRECISION][+ENV=VALUE...]: the --device and --precision (default auto) of `modeld-msm compile`, plus
environment for the worker (e.g. NUM_CPU_THREADS=1, BEAM=2). The CPU's model and the features that decide fp16 speed head
the table: compare ratios from one run, not absolute times across machines.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CAMERA = (1928, 1208)


def _stats(times: list[float]) -> dict[str, float]:
  a = np.asarray(times) * 1e3
  return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def _measure(fns: dict, iters: int, block: int = 5, warmup: int = 3) -> dict[str, dict[str, float]]:
  """Time every callable `iters` times, taking turns in blocks of `block` calls, so all of them see the same background load
  (this box is shared); a block's first call absorbs any spin-down of the previous runtime's threads."""
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  times: dict[str, list[float]] = {k: [] for k in fns}
  while any(len(t) < iters for t in times.values()):
    for k, fn in fns.items():
      for _ in range(min(block, iters - len(times[k]))):
        t = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - t)
  return {k: _stats(v) for k, v in times.items()}


def _feeds(path: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
  from compile.onnx_model import load_model_info
  kind = "vision" if "vision" in path.name else "policy"
  info = load_model_info(path, kind)
  return {n: rng.integers(0, 256, s, dtype=np.uint8) if info.input_dtypes[n] == "uint8" else rng.standard_normal(s).astype(info.input_dtypes[n])
          for n, s in info.input_shapes.items()}


PIPELINE = 8   # steps per pipelined sample (GPU benches)


def worker(models: Path, device: str, iters: int, precision: str, profile: bool = False) -> dict:
  """Runs in a fresh process: compile, then time the artifact and per-model TinyJits (in the artifact's precision)."""
  from artifact.format import verify_artifact
  from artifact.load import frame_tensor, load_programs, read_output
  from compile.build import compile_artifact
  from modeld_msm.named_program import host_of, host_tensors
  from selfdrive_glue.nv12 import nv12_info
  res: dict = {"device": device, "env": {k: os.environ[k] for k in ("BEAM", "NUM_CPU_THREADS") if k in os.environ}}
  out = Path(tempfile.mkdtemp(prefix="bench_compile_")) / "artifact"
  t = time.perf_counter()
  compile_artifact("driving", {k: models / f"driving_{k}.onnx" for k in ("vision", "policy")}, CAMERA, device, out, log=lambda *_: None,
                   precision=precision)
  res["compile_s"] = time.perf_counter() - t
  meta = verify_artifact(out).meta
  res["precision"] = meta["precision"]["compute"]
  res["layout"] = bool(meta.get("cpu_layout", {}).get("on"))
  res["search"] = meta.get("search", {}).get("beam") or 0
  res["search_why"] = meta.get("search", {}).get("why", "")
  res["threads"] = meta.get("cpu_threads") or 1

  from tinygrad import Device
  dev = Device.DEFAULT
  res["renderer"] = type(Device[dev].renderer).__name__
  progs = load_programs(verify_artifact(out))
  policy_jit, warp_jit = progs["step"], progs["warp"]
  nv, rng = nv12_info(*CAMERA), np.random.default_rng(0)
  bufs = [rng.integers(0, 256, nv.size, dtype=np.uint8) for _ in range(4)]
  frames = [frame_tensor(b, dev) for b in bufs]
  host = host_of()
  host["tfm"][:] = [[2.9, 0, 219], [0, 2.9, 465], [0, 0, 1]]
  host["big_tfm"][:] = [[1.25, 0, 645], [0, 1.25, 415], [0, 0, 1]]
  host["traffic_convention"][:] = [[1, 0]]
  ht = host_tensors(host)
  step = [0]

  def fused():
    i = step[0] = (step[0] + 2) % 4
    v, p = policy_jit(frames[i], frames[i + 1], ht["desire"], ht["traffic_convention"], ht["tfm"], ht["big_tfm"])
    read_output(v), read_output(p)   # as modeld reads them

  def warp_only():
    i = step[0] = (step[0] + 2) % 4
    warp_jit(frames[i], frames[i + 1], ht["desire"], ht["traffic_convention"], ht["tfm"], ht["big_tfm"])
    Device[dev].synchronize()

  def pipelined():
    # PIPELINE steps back to back, one sync: the GPU's time per step where the host keeps ahead of it (fused = latency)
    for _ in range(PIPELINE):
      i = step[0] = (step[0] + 2) % 4
      policy_jit(frames[i], frames[i + 1], ht["desire"], ht["traffic_convention"], ht["tfm"], ht["big_tfm"])
    Device[dev].synchronize()

  fns, checks = {"fused": fused, "warp": warp_only}, {}
  if device.split(":")[0] != "CPU":
    fns["pipelined"] = pipelined
  searched = _searched(meta)
  for kind in ("vision", "policy"):
    fns[f"tg_{kind}"], checks[kind] = _per_model(models / f"driving_{kind}.onnx", kind, dev, res["precision"], res["layout"], searched)
  res["load_before"] = os.getloadavg()[0]
  res.update(_measure(fns, iters))
  res["load_after"] = os.getloadavg()[0]
  res.update({f"maxdiff_{k}": c() for k, c in checks.items()})
  if profile:
    res["profile"] = _profile(models, dev, res["precision"], res["layout"], searched, frames[0], frames[1], ht)
  shutil.rmtree(out.parent, ignore_errors=True)
  return res


def _searched(meta: dict):
  """The shipped kernel search the artifact was compiled with (None if none): the per-model JITs and the profile replay it,
  so they run the artifact's kernels."""
  from compile.cpu import search as cpu_search
  if not meta.get("search", {}).get("used"):
    return None
  m = meta["models"]
  key = cpu_search.match_key(device=meta["device"], precision=meta["precision"]["compute"], layout=bool(meta["cpu_layout"]["on"]),
                             camera=CAMERA, model_sha256={"vision": m["vision"]["sha256"], "policy": m["policy"]["sha256"]})
  searched, _ = cpu_search.choose("auto", key)
  if searched:
    cpu_search.install(searched)
  return searched


def _lowering(searched):
  from tinygrad.helpers import Context
  return Context(BEAM=searched["beam"]) if searched else Context()


def _per_model(path: Path, kind: str, dev: str, precision: str, layout: bool, searched) -> tuple:
  """One model alone: a TinyJit around tinygrad's OnnxRunner (the artifact's precision, layout and kernel search), outputs
  read back; returns (timed call, accuracy check)."""
  from tinygrad import Tensor, TinyJit
  from tinygrad.nn.onnx import OnnxRunner

  from compile.cpu import layout as cpu_layout
  from compile.programs.one_model import runner_model
  feeds = _feeds(path, np.random.default_rng(1))
  with tempfile.TemporaryDirectory() as td:
    runner = OnnxRunner(runner_model(path, precision, layout, Path(td))[0])
  if layout:
    cpu_layout.apply(runner)
  jit = TinyJit(lambda **kw: next(iter(runner(kw).values())).realize())
  want = {k: v.dtype for k, v in runner.graph_inputs.items()}
  inputs = {k: Tensor(v.astype(np.float32) if v.dtype == np.float16 else v, device=dev).cast(want[k]).realize() for k, v in feeds.items()}
  with _lowering(searched):
    for _ in range(3):   # the JIT captures on its second call: lower (and replay the search) here, not in the timing
      jit(**inputs).numpy()

  def check() -> float:
    import onnxruntime as ort
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0].astype(np.float32)
    return float(np.abs(jit(**inputs).numpy().astype(np.float32) - ref).max())
  return (lambda: jit(**inputs).numpy()), check


def _profile(models: Path, dev: str, precision: str, layout: bool, searched, frame, big_frame, ht) -> list[dict]:
  """Per-kernel times of one fused step (the unjitted program as compiled, each kernel synchronised: tinygrad's DEBUG=2
  lines), summed per kernel name: [{name, calls, ms, gflops}] slowest first."""
  import contextlib
  import io
  import re

  from tinygrad.helpers import Context

  from compile.onnx_model import load_model_info
  from compile.programs.driving import build_program
  from selfdrive_glue.nv12 import nv12_info
  prog = build_program(load_model_info(models / "driving_vision.onnx", "vision"), load_model_info(models / "driving_policy.onnx", "policy"),
                       nv12_info(*CAMERA), dev, precision, layout=layout)
  args = (frame, big_frame, ht["desire"], ht["traffic_convention"], ht["tfm"], ht["big_tfm"])
  with _lowering(searched):
    for _ in range(2):
      [t.numpy() for t in prog.run_policy(*args)]
  buf = io.StringIO()
  # under the same BEAM as the warm-up: tinygrad keys its lowered kernels by it, so a pass without would re-lower heuristically
  with contextlib.redirect_stdout(buf), _lowering(searched), Context(DEBUG=2):
    [t.numpy() for t in prog.run_policy(*args)]
  agg: dict[str, dict] = {}
  for line in re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue()).splitlines():
    m = re.match(r"\*\*\* \S+\s+\d+ (\S+).* tm\s+([\d.]+)(us|ms|s)/.*\(\s*(\d+) GFLOPS", line)
    if not m or m.group(1) == "copy":
      continue
    ms = float(m.group(2)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(3)]
    a = agg.setdefault(m.group(1), {"name": m.group(1), "calls": 0, "ms": 0.0, "gflop": 0.0})
    a["calls"] += 1
    a["ms"] += ms
    a["gflop"] += int(m.group(4)) * ms * 1e-3   # tinygrad prints each call's achieved GFLOP/s
  rows = sorted(agg.values(), key=lambda a: -a["ms"])
  for a in rows:
    a["gflops"] = a.pop("gflop") / (a["ms"] * 1e-3) if a["ms"] else 0.0
  return rows


def peak_gflops(n: int = 1024, reps: int = 10) -> float:
  """The machine's measured fp32 peak for the profile: numpy's sgemm (its BLAS, all cores), best of reps."""
  a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
  a @ a
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    a @ a
    best = min(best, time.perf_counter() - t)
  return 2 * n ** 3 / best / 1e9


def ort_worker(models: Path, iters: int) -> dict:
  """onnxruntime alone in its own process (default threads), so neither runtime's thread pool disturbs the other."""
  import onnxruntime as ort
  fns = {}
  for kind in ("vision", "policy"):
    path = models / f"driving_{kind}.onnx"
    feeds = _feeds(path, np.random.default_rng(1))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fns[f"ort_{kind}"] = (lambda s, f: lambda: s.run(None, f))(sess, feeds)
  return _measure(fns, iters)


def _parse_config(cfg: str) -> tuple[str, str, dict[str, str]]:
  target, *envs = cfg.split("+")
  device, _, precision = target.partition("@")
  return device, precision or "auto", dict(e.split("=", 1) for e in envs)


def _run_worker(args: list[str], env: dict[str, str], timeout: float) -> dict:
  r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}, cwd=REPO)
  if r.returncode != 0:
    raise RuntimeError((r.stderr.strip().splitlines() or ["?"])[-1][:120])
  return json.loads(r.stdout.strip().splitlines()[-1])


def run_config(models: Path, cfg: str, iters: int, timeout: float, profile: bool = False) -> dict:
  """onnxruntime in one fresh process, then tinygrad (compile + timing) in another, back to back."""
  device, precision, env = _parse_config(cfg)
  t = time.perf_counter()
  try:
    res = _run_worker(["--worker", "ort", "--models", str(models), "--iters", str(iters)], {}, timeout)
    res.update(_run_worker(["--worker", "tinygrad", "--models", str(models), "--device", device, "--iters", str(iters),
                            "--precision", precision, *(["--profile"] if profile else [])], env, timeout))
  except subprocess.TimeoutExpired:
    return {"config": cfg, "error": f"timed out after {timeout:.0f} s"}
  except RuntimeError as e:
    return {"config": cfg, "error": str(e)}
  res["config"], res["worker_s"] = cfg, time.perf_counter() - t
  return res


def _label(r: dict) -> str:
  """The config as given, with what the artifact's manifest says it was compiled with (precision, layout, search)."""
  cfg = r["config"] if "@" in r["config"] else f"{r['config']}@{r['precision']}"
  cfg = cfg.replace("MODELD_CPU_LAYOUT=", "layout=").replace("MODELD_CPU_SEARCH=", "search=")
  if "error" in r:
    return cfg
  return f"{cfg} [{'L' if r.get('layout') else '-'}{'B' + str(r['search']) if r.get('search') else '-'}T{r.get('threads', 1)}]"


def table(rows: list[dict], peak: float | None = None) -> str:
  from artifact.cpu_info import cpu_info
  head = (f"{'size':5s} {'config':44s} {'compile':>8s} | {'vision tg p50/p99':>18s} {'ORT p50/p99':>14s} {'ratio':>5s} | "
          f"{'policy tg p50/p99':>18s} {'ORT p50/p99':>14s} {'ratio':>5s} | {'fused step p50/p99':>19s} {'vs ORT v+p':>10s} | {'warp':>6s} | load")
  lines = [f"CPU: {cpu_info().summary()}" + (f"; measured fp32 peak {peak:.0f} GFLOP/s (numpy sgemm 1024)" if peak else ""),
           head, "-" * len(head)]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['size']:5s} {_label(r):44s} error: {r['error']}")
      continue
    def pp(k, r=r):
      return f"{r[k]['p50']:7.2f}/{r[k]['p99']:7.2f}"
    ort_sum = r["ort_vision"]["p50"] + r["ort_policy"]["p50"]
    lines.append(f"{r['size']:5s} {_label(r):44s} {r['compile_s']:7.1f}s | {pp('tg_vision'):>18s} {pp('ort_vision'):>14s} "
                 f"{r['tg_vision']['p50'] / r['ort_vision']['p50']:5.2f} | {pp('tg_policy'):>18s} {pp('ort_policy'):>14s} "
                 f"{r['tg_policy']['p50'] / r['ort_policy']['p50']:5.2f} | {pp('fused'):>19s} {r['fused']['p50'] / ort_sum:10.2f} | "
                 f"{r['warp']['p50']:6.2f} | {r['load_before']:.1f}-{r['load_after']:.1f}")
  lines.append("times in ms (p50/p99 per call; tinygrad, onnxruntime each alone in a fresh process); ratio = tinygrad p50 / onnxruntime p50;\n"
               "'vs ORT v+p' = fused step (incl. 2 warps) / (ORT vision + ORT policy); compile = wall time of compile_artifact incl. its "
               "validation;\n[L = CPU layout (compile/cpu/layout.py), Bn = shipped BEAM=n kernel search (compile/cpu/search.py), - = off, "
               "Tn = kernels split into n parts run concurrently (artifact/cpu_threads.py)]; "
               "load = 1-min loadavg before-after (the box is shared: compare ratios within one run)")
  for r in rows:
    if r.get("profile"):
      lines.append(profile_table(r, peak))
  return "\n".join(lines)


def profile_table(r: dict, peak: float | None, top: int = 10) -> str:
  rows = r["profile"]
  total = sum(a["ms"] for a in rows) or 1.0
  lines = [f"\ntop {top} kernels of one fused step, {r['size']} {_label(r)} ({len(rows)} kernels, {total:.1f} ms with a sync after each):",
           f"  {'kernel':40s} {'calls':>5s} {'ms':>8s} {'share':>6s} {'GFLOP/s':>8s} {'of peak':>7s}"]
  for a in rows[:top]:
    lines.append(f"  {a['name']:40s} {a['calls']:5d} {a['ms']:8.2f} {100 * a['ms'] / total:5.1f}% {a['gflops']:8.1f} "
                 + (f"{100 * a['gflops'] / peak:6.1f}%" if peak else "      -"))
  return "\n".join(lines)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--size", default="tiny", help="tiny, full, or tiny,full")
  ap.add_argument("--configs", default="CPU@fp16,CPU@fp32,CPU:LLVM@fp32,CPU@fp32+NUM_CPU_THREADS=1",
                  help="comma-separated DEVICE[@PRECISION][+ENV=VALUE...]")
  ap.add_argument("--iters", type=int, default=0, help="timed calls per measurement (default 200 tiny, 30 full)")
  ap.add_argument("--timeout", type=float, default=1800, help="seconds per config (compile included)")
  ap.add_argument("--profile", action="store_true", help="also print each config's top 10 kernels with achieved GFLOP/s against the measured peak")
  ap.add_argument("--json", help="also write the raw results here")
  ap.add_argument("--worker", choices=("ort", "tinygrad"), help=argparse.SUPPRESS)
  ap.add_argument("--models", help=argparse.SUPPRESS)
  ap.add_argument("--device", help=argparse.SUPPRESS)
  ap.add_argument("--precision", default="auto", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    res = ort_worker(Path(args.models), args.iters) if args.worker == "ort" else \
      worker(Path(args.models), args.device, args.iters, args.precision, args.profile)
    print(json.dumps(res))
    return 0
  from compile.refmodels.driving import write_models
  peak = peak_gflops() if args.profile else None
  rows = []
  for size in args.size.split(","):
    models = Path(tempfile.mkdtemp(prefix=f"bench_models_{size}_"))
    write_models(models, size, 0)
    for cfg in args.configs.split(","):
      print(f"[bench] {size} {cfg} ...", file=sys.stderr, flush=True)
      r = run_config(models, cfg, args.iters or (200 if size == "tiny" else 30), args.timeout, args.profile)
      r["size"] = size
      rows.append(r)
      print(table([r]).splitlines()[3], file=sys.stderr, flush=True)
    shutil.rmtree(models, ignore_errors=True)
  print(table(rows, peak))
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
