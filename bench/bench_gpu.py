"""The fused step (warp x 2 + queues + vision + policy, outputs read back) on a workstation GPU: tinygrad's CUDA/NV artifact
against PyTorch running the same ONNX graphs with the same weights as one CUDA graph (bench/torch_peer.py), in one run.

  python bench/bench_gpu.py --size full --configs CUDA@fp16,CUDA@fp16+MODELD_CPU_SEARCH=off,CUDA@fp32,NV@fp16 --iters 100

A config is compiled as a user's `compile --device D` would be: with the shipped kernel search for that GPU where one matches
(compile/cpu/search.py), else tinygrad's heuristic; `+MODELD_CPU_SEARCH=off` forces the heuristic, `+BEAM=n` searches anew.

Each tinygrad config compiles an artifact (`compile_artifact`, numerics checked against onnxruntime) and times it in a fresh
process (bench_compile.py's worker); PyTorch runs in its own process per precision. Ratios are tinygrad / PyTorch p50 of the
same precision (< 1: tinygrad faster). Needs a CUDA GPU and torch; CI never runs it.
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


def torch_worker(models: Path, precision: str, iters: int) -> dict:
  import torch

  from bench.bench_compile import _feeds, _measure
  from bench.torch_peer import TorchOnnx, TorchStep
  from compile.precision import widen_to_fp32
  from selfdrive_glue.nv12 import nv12_info
  td = Path(tempfile.mkdtemp(prefix="bench_gpu_torch_"))
  paths = {k: models / f"driving_{k}.onnx" for k in ("vision", "policy")}
  if precision == "fp32":
    paths = {k: widen_to_fp32(p, td / p.name) for k, p in paths.items()}
  nv = nv12_info(*CAMERA)
  res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
  t = time.perf_counter()
  step = TorchStep(paths["vision"], paths["policy"], nv)
  step.capture()
  res["compile_s"] = time.perf_counter() - t
  rng = np.random.default_rng(0)
  frames = [torch.from_numpy(rng.integers(0, 256, nv.size, dtype=np.uint8)).cuda() for _ in range(4)]
  tfm = np.array([[2.9, 0, 219], [0, 2.9, 465], [0, 0, 1]], np.float32)
  big = np.array([[1.25, 0, 645], [0, 1.25, 415], [0, 0, 1]], np.float32)
  i = [0]

  def fused():
    i[0] = (i[0] + 2) % 4
    step(frames[i[0]], frames[i[0] + 1], tfm, big)

  def pipelined():
    from bench.bench_compile import PIPELINE
    for _ in range(PIPELINE):
      i[0] = (i[0] + 2) % 4
      step.frame.copy_(frames[i[0]])
      step.big_frame.copy_(frames[i[0] + 1])
      step.graph.replay()
    torch.cuda.synchronize()

  def eager():
    i[0] = (i[0] + 2) % 4
    step.frame.copy_(frames[i[0]])
    step.big_frame.copy_(frames[i[0] + 1])
    v, p = step._step()
    v.cpu(), p.cpu()
  res.update(_measure({"fused": fused, "eager": eager, "pipelined": pipelined}, iters))
  # the interpreter agrees with onnxruntime on each model (so the peer computes what the models say)
  import onnxruntime as ort
  for kind in ("vision", "policy"):
    feeds = _feeds(models / f"driving_{kind}.onnx", np.random.default_rng(1))
    ref = ort.InferenceSession(str(models / f"driving_{kind}.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0].astype(np.float32)
    m = TorchOnnx(paths[kind], "cuda")
    got = m(**{k: torch.from_numpy(v).cuda().to(m.input_dtypes[k]) for k, v in feeds.items()}).float().cpu().numpy()
    res[f"maxdiff_{kind}"] = float(np.abs(got - ref).max())
  shutil.rmtree(td, ignore_errors=True)
  return res


def _run(args: list[str], env: dict[str, str], timeout: float) -> dict:
  r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}, cwd=REPO)
  if r.returncode != 0:
    return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:160]}
  return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--size", default="full")
  ap.add_argument("--configs", default="CUDA@fp16,CUDA@fp32,NV@fp16", help="tinygrad DEVICE@PRECISION[+ENV=VALUE...], comma-separated")
  ap.add_argument("--iters", type=int, default=100)
  ap.add_argument("--timeout", type=float, default=1200)
  ap.add_argument("--json", help="also write the raw results here")
  ap.add_argument("--worker", choices=("torch",), help=argparse.SUPPRESS)
  ap.add_argument("--models", help=argparse.SUPPRESS)
  ap.add_argument("--precision", default="fp16", help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.worker:
    print(json.dumps(torch_worker(Path(a.models), a.precision, a.iters)))
    return 0
  from artifact.cpu_info import cpu_info
  from bench.bench_compile import _label, _parse_config
  from compile.refmodels.driving import write_models
  models = Path(tempfile.mkdtemp(prefix=f"bench_gpu_models_{a.size}_"))
  write_models(models, a.size, 0)
  rows, peers = [], {}
  for cfg in a.configs.split(","):
    device, precision, env = _parse_config(cfg)
    if precision not in peers:
      print(f"[bench] torch {precision} ...", file=sys.stderr, flush=True)
      peers[precision] = _run([__file__, "--worker", "torch", "--models", str(models), "--precision", precision, "--iters", str(a.iters)], {},
                              a.timeout)
      print(f"  {peers[precision]}", file=sys.stderr, flush=True)
    print(f"[bench] tinygrad {cfg} ...", file=sys.stderr, flush=True)
    r = _run([str(REPO / "bench" / "bench_compile.py"), "--worker", "tinygrad", "--models", str(models), "--device", device, "--iters", str(a.iters),
              "--precision", precision], env, a.timeout)
    r.update(config=cfg, precision=precision)
    print(f"  {r}", file=sys.stderr, flush=True)
    rows.append(r)
  gpu = next((p["gpu"] for p in peers.values() if "gpu" in p), "?")
  torch_v = next((p["torch"] for p in peers.values() if "torch" in p), "?")
  print(f"GPU: {gpu}   CPU: {cpu_info().summary()}   torch {torch_v}, tinygrad 0.14.0, {a.size} reference models, camera {CAMERA[0]}x{CAMERA[1]}")
  from bench.bench_compile import PIPELINE

  def pipe(res: dict) -> float:
    return res["pipelined"]["p50"] / PIPELINE if "pipelined" in res else float("nan")
  head = (f"{'runtime':34s} {'build s':>8s} {'fused p50':>10s} {'p99':>8s} {'vs torch':>9s} | {'pipelined':>9s} {'vs torch':>8s} | "
          f"{'vision':>7s} {'policy':>7s} {'warp':>6s} | max|diff| vs ORT v/p")
  print(head + "\n" + "-" * len(head))
  for prec, p in peers.items():
    if "error" in p:
      print(f"{'torch ' + prec:34s} error: {p['error']}")
      continue
    print(f"{'torch+CUDA graph ' + prec:34s} {p['compile_s']:8.1f} {p['fused']['p50']:10.3f} {p['fused']['p99']:8.3f} {1.0:9.2f} | "
          f"{pipe(p):9.3f} {1.0:8.2f} | {'':>7s} {'':>7s} {'':>6s} | {p['maxdiff_vision']:.3g}/{p['maxdiff_policy']:.3g}")
    print(f"{'torch eager ' + prec:34s} {'':>8s} {p['eager']['p50']:10.3f} {p['eager']['p99']:8.3f} {p['eager']['p50'] / p['fused']['p50']:9.2f} |")
  for r in rows:
    if "error" in r:
      print(f"{'tinygrad ' + _label(r):34s} error: {r['error']}")
      continue
    peer = peers.get(r["precision"], {})
    ratio = r["fused"]["p50"] / peer["fused"]["p50"] if "fused" in peer else float("nan")
    print(f"{'tinygrad ' + _label(r):34s} {r['compile_s']:8.1f} {r['fused']['p50']:10.3f} {r['fused']['p99']:8.3f} {ratio:9.2f} | "
          f"{pipe(r):9.3f} {pipe(r) / pipe(peer) if 'pipelined' in peer else float('nan'):8.2f} | "
          f"{r['tg_vision']['p50']:7.3f} {r['tg_policy']['p50']:7.3f} {r['warp']['p50']:6.3f} | {r['maxdiff_vision']:.3g}/{r['maxdiff_policy']:.3g}")
  for r in rows:
    if "search_why" in r:
      print(f"kernel search, {_label(r)}: {r['search_why']}")
  print("times in ms per call (outputs read back to the host); 'vs torch' = p50 / torch+CUDA graph p50 of the same precision; "
        "build = compile_artifact with its checks (tinygrad) or load + graph capture (torch); "
        f"pipelined = {PIPELINE} steps back to back and one sync, per step, no read-back: the GPU's time where the host keeps ahead "
        "(fused - pipelined ~ the host's latency per step)")
  if a.json:
    Path(a.json).write_text(json.dumps({"torch": peers, "tinygrad": rows}, indent=1))
  shutil.rmtree(models, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
