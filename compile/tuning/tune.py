"""A second, steadier look at the kernels that take most of a recorded search set's step (maintainers only, like `record`).

BEAM=1 is greedy: from no opts it takes whichever single action times best, three runs each, and stops when nothing
helps, so it can stop where no single step improves, e.g. with a kernel on one core and a narrow register tile where a
square tile split over both cores is twice as fast (docs/performance-cpu.md §2). So for the slowest
kernels of one step this times a grid of register tiles (upcasts of two output axes), reduce unrolls and the thread
split, re-times the best few against the recorded opts in interleaved rounds (the box's speed drifts between minutes, so
only a comparison made in the same minutes counts) and keeps a candidate only if its median wins by a margin. Those
kernels' opts are replaced in the set; the others stay as recorded, and the set's match key does not change.

Every call is timed with the caches as the kernel meets them inside a step, not as a loop of calls leaves them: all
levels evicted, then the kernel's inputs read (the kernels before it just wrote them) and its output left cold. A loop
keeps the output hot, which ranks tiles differently, and the evicted time is the one that agrees with the step
(docs/performance-cpu.md §4).

  .venv/bin/python -m compile.tuning.record tune --size full --top 12
"""
from __future__ import annotations

import contextlib
import itertools
import math
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artifact import cpu_threads
from artifact.load import frame_tensor
from compile.checks import ort_check
from compile.cpu import search as cpu_search
from compile.cpu.search import opts_json, search_key
from compile.onnx_model import load_model_info
from compile.programs.driving import build_program
from compile.report import CompileReport
from modeld_msm.named_program import host_of, host_tensors
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import nv12_info

# a candidate must beat the recorded opts' median by this much: below it, the pick would follow the noise
MARGIN = 0.05
UPCASTS = (1, 2, 3, 4, 8, 16)   # tinygrad refuses one upcast over 16
TILE = (4, 64)                  # register tile sizes (product of the upcasts) worth timing on AVX2/AVX-512
WINDOW = 4                      # reduce axes this short are unrolled whole as a candidate (a 3x3 window)


@dataclass
class Kernel:
  key: str              # the AST key tinygrad's search cache uses (the table's "ast")
  name: str
  base: Any             # tinygrad Scheduler before any opt
  rawbufs: list
  recorded: tuple       # the set's opts
  ms: float = math.inf  # recorded opts, median of one call
  tuned: tuple | None = None
  tuned_ms: float = math.inf
  tried: int = 0
  seconds: float = 0.0


@contextlib.contextmanager
def _observing_searches(seen: dict[str, Kernel], entries: list[dict[str, Any]] | None) -> Iterator[None]:
  """Every kernel lowered under BEAM passes through tinygrad's beam_search (a cache hit for a recorded set): wrap it to
  keep each kernel's unoptimised scheduler and the opts it got. With `entries` (a set started from nothing) a miss takes
  tinygrad's heuristic opts instead of a search, and each kernel's entry is added. tinygrad imports the function at each
  call (codegen/opt/postrange.apply_opts), so the wrapper is seen for the duration of this block only."""
  from tinygrad.codegen.opt import search
  from tinygrad.codegen.opt.heuristic import hand_coded_optimizations
  from tinygrad.helpers import diskcache_get
  from tinygrad.uop.ops import Ops
  orig = search.beam_search

  def observe(s, rawbufs, var_vals, amt, allow_test_size=True, *a, **kw):
    device, suffix = s.ren.target.device, s.ren.suffix
    if entries is not None and diskcache_get("beam_search", search_key(s.ast.key, amt, allow_test_size, device, suffix)) is None:
      # as tinygrad's apply_opts without BEAM: its heuristic does not handle multi-block (STAGE) kernels, which keep no opts
      ret = s.copy() if any(u.op is Ops.STAGE for u in s.ast.backward_slice) else hand_coded_optimizations(s.copy())
      if s.ast.key.hex() not in seen:
        entries.append({"ast": s.ast.key.hex(), "allow_test_size": bool(allow_test_size), "device": device, "suffix": suffix,
                        "opts": opts_json(ret.applied_opts)})
    else:
      ret = orig(s, rawbufs, var_vals, amt, allow_test_size, *a, **kw)
    if not var_vals and (key := s.ast.key.hex()) not in seen:   # symbolic kernels (none here) would need their variables
      seen[key] = Kernel(key, _plain_name(ret.copy()), s.copy(), list(rawbufs), tuple(ret.applied_opts))
    return ret
  search.beam_search = observe
  try:
    yield
  finally:
    search.beam_search = orig


def _plain_name(s) -> str:
  name = s.get_optimized_ast().arg.name
  return re.sub(r"\x1b\[[0-9;]*m", "", name)


def step_kernels(recorded: dict[str, Any], models: dict[str, Path], camera: tuple[int, int], precision: str,
                 layout: bool) -> list[Kernel]:
  """Every kernel a compile of these models lowers (the step, the warp alone, each model alone as its onnxruntime check
  feeds it), each once, as the set lowers it. A set without entries is filled with tinygrad's heuristic opts."""

  import numpy as np
  from tinygrad.helpers import Context

  cpu_threads.install("CPU")
  cpu_search.install(recorded)
  nv = nv12_info(*camera)
  seen: dict[str, Kernel] = {}
  vinfo, pinfo = load_model_info(models["vision"], "vision"), load_model_info(models["policy"], "policy")
  fill = recorded["entries"] if not recorded["entries"] else None
  with Context(BEAM=recorded["beam"]), _observing_searches(seen, fill), tempfile.TemporaryDirectory() as td:
    prog = build_program(vinfo, pinfo, nv, "CPU", precision, layout=layout)
    rng = np.random.default_rng(0)
    ort_check(vinfo, prog.vision, rng, CompileReport(Path(td)))
    ort_check(pinfo, prog.policy, rng, CompileReport(Path(td)))
    pixels = rng.integers(0, 256, nv.size, dtype=np.uint8)   # the frame tensor is a view of it (frame_tensor): keep it
    frame = frame_tensor(pixels, "CPU")
    ht = host_tensors(host_of())
    args = (frame, frame, ht["desire"], ht["traffic_convention"], ht["tfm"], ht["big_tfm"])
    prog.run_warp(*args).numpy()
    [t.numpy() for t in prog.run_policy(*args)]
  return list(seen.values())


def _cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
  """Bytes that evict every cache level: twice the largest cache sysfs reports for cpu0, at least 64 MiB."""
  sizes = [64 << 20]
  for f in root.glob("index*/size"):
    text = f.read_text().strip()
    with contextlib.suppress(ValueError):
      sizes.append(2 * int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1))
  return max(sizes)


class _StepCaches:
  """Puts the caches where a step leaves them before a kernel: nothing cached but the kernel's inputs."""

  def __init__(self) -> None:
    import numpy as np
    self.junk = np.zeros(_cache_bytes(), np.uint8)

  def prepare(self, k: Kernel, outs: set[int]) -> None:
    # the inputs in the order of the kernel's buffer slots
    self.evict([b.ensure_allocated() for i, b in enumerate(k.rawbufs) if i not in outs])

  def evict(self, inputs: list[Any]) -> None:
    """Every cache level emptied, then the `inputs` (tinygrad Buffers) read back in."""
    self.junk += 1   # reads and writes every line: whatever was cached is gone
    for b in inputs:
      bytes(b.as_memoryview(allow_zero_copy=True))


_caches: _StepCaches | None = None


def _program(k: Kernel, opts: tuple):
  from tinygrad import Device
  from tinygrad.codegen import to_program
  from tinygrad.uop.ops import KernelInfo
  ast = k.base.ast
  # KernelInfo.opts_to_apply: tinygrad's own way to lower an AST with given opts (no search, no heuristic)
  return to_program(ast.replace(arg=KernelInfo(name=ast.arg.name if ast.arg else "test", opts_to_apply=tuple(opts))),
                    Device["CPU"].renderer)


def time_opts(k: Kernel, opts: tuple, reps: int) -> float:
  """Fastest of `reps` calls of the kernel lowered with `opts`, each with the caches as in a step, in ms (inf if tinygrad
  refuses or fails to build it)."""
  global _caches
  from tinygrad.codegen.opt.search import _time_program
  try:
    prg = _program(k, opts)
  except Exception:   # an opt list the grid proposes may be refused anywhere in lowering: that candidate just drops out
    return math.inf
  for b in k.rawbufs:
    b.ensure_allocated()
  if _caches is None:
    _caches = _StepCaches()
  best, outs = math.inf, set(prg.arg.outs)
  for _ in range(reps):
    _caches.prepare(k, outs)
    best = min(best, _time_program(prg, {}, k.rawbufs, allow_test_size=False, max_global_size=None, cnt=1)[0])
  return best * 1e3


def _legal(k: Kernel, opts: tuple) -> bool:
  from tinygrad.codegen.opt import KernelOptError
  s = k.base.copy()
  try:
    for o in opts:
      s.apply_opt(o)
  except (KernelOptError, AssertionError, ValueError):
    return False
  return True


def _window(k: Kernel) -> tuple:
  """Full unrolls of the short reduce axes (a convolution's 3x3 window), the last first so the others keep their index.
  The stems' 12-channel 3x3 convolution is much faster with its window unrolled, which BEAM=1 and the tile grid alone miss."""
  from tinygrad.codegen.opt import Opt, OptOps
  s = k.base
  short = [j for j, ax in enumerate(s.unrollable_dims) if s.full_shape[ax] <= WINDOW]
  return tuple(Opt(OptOps.UNROLL, j, 0) for j in reversed(short))


def tiles(k: Kernel, threads: int) -> list[tuple]:
  """Stage 1: register tiles over pairs of the innermost three output axes, each also with the window unrolled when the
  kernel has one (then the thread split, if any, on the first axis that takes it)."""
  from tinygrad.codegen.opt import Opt, OptOps
  from tinygrad.uop.ops import AxisType
  s = k.base
  outs = [i for i, t in enumerate(s.axis_types) if t in (AxisType.GLOBAL, AxisType.LOOP, AxisType.WEAK)][-3:]
  windows = ((), w) if (w := _window(k)) else ((),)
  out: list[tuple] = []
  for a, b in itertools.combinations(outs, 2) if len(outs) > 1 else [(outs[0], None)] if outs else []:
    for ua, ub in itertools.product(UPCASTS, UPCASTS if b is not None else (1,)):
      if not TILE[0] <= ua * ub <= TILE[1]:
        continue
      ups = tuple(Opt(OptOps.UPCAST, ax, amt) for ax, amt in ((a, ua), (b, ub)) if amt > 1)
      for window in windows:
        cand = _threaded(k, ups + window, threads)
        if cand is not None and cand not in out:
          out.append(cand)
  return out


def _threaded(k: Kernel, opts: tuple, threads: int, axes: tuple[int, ...] = (0, 1, 2)) -> tuple | None:
  from tinygrad.codegen.opt import Opt, OptOps
  if threads <= 1:
    return opts if _legal(k, opts) else None
  for ax in axes:
    if _legal(k, cand := opts + (Opt(OptOps.THREAD, ax, threads),)):
      return cand
  return None


def refinements(k: Kernel, best: tuple, threads: int) -> list[tuple]:
  """Stage 2, around a stage-1 tile: unroll the first reduce axis (whole if short, else by 2 or 4; a tile with its window
  unrolled keeps it as it is) and move the split."""
  from tinygrad.codegen.opt import Opt, OptOps
  ups = tuple(o for o in best if o.op is OptOps.UPCAST)
  window = tuple(o for o in best if o.op is OptOps.UNROLL)
  unrolls = ((),) if window else ((), (Opt(OptOps.UNROLL, 0, 0),), (Opt(OptOps.UNROLL, 0, 2),), (Opt(OptOps.UNROLL, 0, 4),))
  out = []
  for unroll in unrolls:
    for ax in ((0, 1, 2) if threads > 1 else (0,)):
      cand = _threaded(k, ups + window + unroll, threads, (ax,))
      if cand is not None and cand not in out:
        out.append(cand)
  return out


def compare(k: Kernel, cands: list[tuple], rounds: int = 5, reps: int = 5) -> list[float]:
  """Median over interleaved rounds of each candidate's fastest call (ms): every candidate sees the same minutes."""
  res: list[list[float]] = [[] for _ in cands]
  for _ in range(rounds):
    for i, c in enumerate(cands):
      res[i].append(time_opts(k, c, reps))
  return [statistics.median(r) for r in res]


def tune_kernel(k: Kernel, threads: int, keep: int = 4, budget: int | None = None) -> None:
  t = time.perf_counter()
  stage1 = tiles(k, threads)[:budget]
  screened = sorted(((time_opts(k, c, 2), c) for c in stage1), key=lambda x: x[0])
  seeds = [c for ms, c in screened[:2] if ms < math.inf]
  stage2 = [c for s in seeds for c in refinements(k, s, threads)][:budget]
  screened += sorted(((time_opts(k, c, 2), c) for c in stage2 if c not in stage1), key=lambda x: x[0])
  best = [c for ms, c in sorted(screened, key=lambda x: x[0]) if ms < math.inf and c != k.recorded][:keep]
  k.tried = len(screened)
  if best:
    meds = compare(k, [k.recorded, *best])
    k.ms = meds[0]
    i = min(range(len(best)), key=lambda j: meds[j + 1])
    if meds[i + 1] < k.ms * (1 - MARGIN):
      k.tuned, k.tuned_ms = best[i], meds[i + 1]
  k.seconds = time.perf_counter() - t


def tune(recorded: dict[str, Any], models: dict[str, Path], camera: tuple[int, int], precision: str, layout: bool, top: int,
         threads: int, log: Callable[[str], None] = print, budget: int | None = None) -> list[Kernel]:
  """Tunes the `top` slowest kernels of one step in place in `recorded` (its entries' opts; a set without entries gets one
  per kernel, tinygrad's heuristic opts, first); returns them, slowest first."""
  from tqdm import tqdm
  kernels = step_kernels(recorded, models, camera, precision, layout)
  by_key = {e["ast"]: e for e in recorded["entries"]}
  kernels = [k for k in kernels if k.key in by_key]
  if not kernels:
    raise UserError("none of the step's kernels is in the recorded set: record it first (python -m compile.tuning.record record)")
  for k in tqdm(kernels, desc="[tune] timing the recorded kernels", unit="kernel", leave=False):
    k.ms = statistics.median(time_opts(k, k.recorded, 3) for _ in range(3))
  kernels.sort(key=lambda k: -k.ms)
  chosen = kernels[:top]
  bar = tqdm(chosen, desc="[tune] searching tiles", unit="kernel")
  for k in bar:
    bar.set_postfix_str(k.name)
    tune_kernel(k, threads, budget=budget)
    if k.tuned is not None:
      by_key[k.key]["opts"] = opts_json(k.tuned)
    log(f"[tune] {k.name}: recorded {k.ms:.3f} ms -> "
        + (f"{k.tuned_ms:.3f} ms ({_fmt(k.tuned)})" if k.tuned else "kept") + f"; {k.tried} candidates in {k.seconds:.0f} s")
  # per kernel ever tuned: the search's own opts (kept from the first pass, for MODELD_CPU_SEARCH=untuned) and this pass's times
  prev = {t["ast"]: t for t in recorded.get("tuned", {}).get("kernels", [])}
  for k in chosen:
    t = prev.setdefault(k.key, {"ast": k.key, "name": k.name, "recorded_opts": opts_json(k.recorded)})
    t.update(ms_before=round(k.ms, 4), ms_after=round(k.tuned_ms, 4) if k.tuned else None)
  recorded["tuned"] = {"top": top, "margin": MARGIN, "kernels": sorted(prev.values(), key=lambda t: t["ast"])}
  return chosen


def _fmt(opts: tuple) -> str:
  return " ".join(f"{o.op.name}:{o.axis}:{o.arg}" for o in opts)
