"""Register tiles for the QCOM image convolutions: a kernel search scored by the a630 cost model, recorded once by us and
shipped in qcom_tiles_table.json, like the CPU and CUDA sets of compile/cpu/search.py.

The image convolutions of a QCOM capture (IMAGE=2 FLOAT16=1 NOLOCALS=1) are texture-bound in the model, and their register
tile (how many outputs one fiber computes: tinygrad's UPCAST of output axes, UNROLL of the reduce) decides how often each
fetched texel is reused. tinygrad's heuristic picks one tile; a larger one fetches less per multiply-add but holds more
registers, so fewer waves fit on an SP to hide the fetches. Nobody has timed that on an a630, so the search scores each
variant with backend/a630_cost.py on the work emulator level B executed: each variant is compiled by IR3, run on the
emulated render node on seeded inputs, its counts, launch and register footprint costed. A variant is only eligible if
its outputs are bit-exact with the heuristic kernel's on those inputs (the program the compile would otherwise build).

How a compile uses it: the compile captures QCOM under BEAM=1 with `Tiles.hooked()` standing in for tinygrad's
beam_search (codegen/opt/search.py), so no kernel is ever timed at compile time: a kernel whose AST the shipped set holds
gets the recorded opts; every other kernel gets tinygrad's heuristic, exactly what it gets without BEAM. A big image
convolution missing from the set is counted as a miss and the compile report says so. The recording also searches the
big elementwise kernels over images (`is_elementwise_target`), where the heuristic's tile can spill registers. Sets are
recorded for one kind's reference models, camera and flags, but a kernel is looked up by its AST in every set of the same
tinygrad, tinymesa and capture flags: the AST names the kernel whole (shapes, dtypes, image layout, ops and constants;
weights are buffers), so another camera (the 1344x760 one, whose model kernels are the same) or another model with the
same layers gets the recorded tile, and only kernels no set holds keep the heuristic. A tile was checked bit-exact with
the heuristic kernel on the recording's seeded inputs; with other weights the kernel is the same code, and the compile's
own checks (onnxruntime, jit == unjitted, the pickle replayed) run with the tiles it took.

Recording (a compile under the hook in search mode, in a child process; tools for us, never a user's compile):
  .venv/bin/python -m compile.tuning.qcom_tiles record --kind driving --size tiny
  .venv/bin/python -m compile.tuning.qcom_tiles record --kind dmonitoring --size full [--openpilot master]   # minutes here
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from artifact import kinds
from artifact.format import installed_versions
from backend import a630_cost as ac
from compile import pinned
from compile.cpu.search import opts_json
from compile.tuning import run_tool
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import write_atomic

TABLE = Path(__file__).with_name("qcom_tiles_table.json")
# sha256 of the shipped table (compile/pinned.py): calibrate-a630 runs the IR3 binaries it holds on a device
TABLE_SHA256: str | None = "98e5f4e16927b046864e542d29b2c072514d0ad81cca62eb3018adadb08405e2"
FORMAT = 1
TABLE_ENV = "MODELD_QCOM_TILES_TABLE"    # a candidate table to compile with instead (A/B runs, tests)
MODE_ENV = "MODELD_QCOM_TILES"           # auto (the shipped sets' tile wherever one holds the kernel) or off (tinygrad's heuristic everywhere)
RECORD_ENV = "MODELD_QCOM_TILES_RECORD"  # set by `record` for its child compile: search, and write what was found there
# a "big" image convolution: a reduce over images of at least this many multiply-adds (the full models' big convolutions
# are 50-300 M; the tiny models' a few M, so a tiny recording passes a lower floor)
MIN_MACS = 20_000_000
ELEMENTWISE_SHARE = 128   # an elementwise kernel over images is big from min_macs / 128 outputs (156 K at the full size)
TILE_OPS = ("UPCAST", "UNROLL")
MAX_UP = 512   # the largest upcast x unroll product tried: twice tinygrad's own cap (larger ones take minutes to lower)
COMPILE_TIMEOUT_S = 120   # a variant that takes longer to lower and compile is left out (recorded as such)
SEED = 7
# what a tile is scored under: the lever trades texel fetches (tex_rate) against resident waves (hide_waves), two constants
# no source gives (backend/a630_cost.UNSOURCED), so a tile is judged at the shipped values and at the corners of both
_D, _TEX, _HIDE = ac.DEFAULT, ac.UNSOURCED["tex_rate"], ac.UNSOURCED["hide_waves"]
SCORE_CASES = (_D, *(replace(_D, tex_rate=t, hide_waves=h) for t in (_TEX[0], _D.tex_rate, _TEX[1]) for h in (_D.hide_waves, _HIDE[1])))


# *** the table ***

def match_key(kind: str, camera: tuple[int, int], model_sha256: dict[str, str], flags: dict[str, int]) -> dict[str, Any]:
  """What a recorded set must share with a compile for its kernels to be the same: the kernels' ASTs follow from the
  models, camera and flags; the IR3 code (and so the variant's registers and work) from tinygrad and tinymesa."""
  v = installed_versions()
  return {"tinygrad": v["tinygrad"], "tinymesa": v["tinymesa"], "device": "QCOM", "kind": kind, "camera": list(camera),
          "flags": dict(sorted(flags.items())), "models": dict(sorted(model_sha256.items()))}


def load_table(path: Path | None = None) -> dict[str, Any]:
  path = path or Path(os.environ.get(TABLE_ENV) or TABLE)
  if (data := pinned.read(path, TABLE, TABLE_SHA256, Path(__file__),
                          "record it again (python -m compile.tuning.qcom_tiles record) or restore it")) is None:
    return {"format": FORMAT, "sets": []}
  try:
    table = json.loads(data)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserError(f"{path}: not a QCOM register-tile table ({e})") from None
  if not isinstance(table, dict) or table.get("format") != FORMAT or not isinstance(table.get("sets"), list):
    raise UserError(f"{path}: QCOM register-tile table format {table.get('format') if isinstance(table, dict) else None!r}, "
                    f"expected {FORMAT}; record it again (python -m compile.tuning.qcom_tiles record)")
  return table


def store(recorded: dict[str, Any], table_path: Path = TABLE) -> None:
  """Add one recorded set, replacing the set with the same match key."""
  global TABLE_SHA256
  table = load_table(table_path)
  table["sets"] = [s for s in table["sets"] if s["match"] != recorded["match"]] + [recorded]
  TABLE_SHA256 = pinned.store(table_path, (json.dumps(table, indent=1, sort_keys=True) + "\n").encode(), TABLE, TABLE_SHA256, Path(__file__))


def calibration_launches(table: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
  """For calibrate-a630: the compiled register-tile variants of every recorded convolution, keyed by the IR3 binary of each
  of them (backend/a630_timing.lib_key), so a kernel of any artifact that is one of them finds its siblings. The
  elementwise entries are left out: their tiles fetch the same texels, so they say nothing of the texture rate and the
  occupancy the variants are there to fit (and the warps' kernels are the same binaries in every model size)."""
  from backend.a630_timing import lib_key
  table = load_table() if table is None else table
  out: dict[str, list[dict[str, Any]]] = {}
  for s in table["sets"]:
    for e in s["entries"]:
      if not e["macs"]:
        continue
      launches = [{**c, "lib_key": lib_key(bytes.fromhex(c["lib"]))} for c in e.get("calibration", []) if c.get("lib")]
      for c in launches:
        out[c["lib_key"]] = launches
  return out


def _opts(rows: list[list[Any]]) -> list:
  from tinygrad.codegen.opt import Opt, OptOps
  return [Opt(OptOps[op], axis, tuple(arg) if isinstance(arg, list) else arg) for op, axis, arg in rows]


# *** what a kernel is and how it is scored ***

def macs_of(s) -> int:
  """Multiply-adds of a reduce kernel: every point of its full shape (outputs x reduce) is one."""
  return math.prod(int(x) for x in s.full_shape) if s.reduceop is not None else 0


def is_target(s, min_macs: int) -> bool:
  """A big image convolution: a reduce over a buffer IMAGE turns into a texture (the test tinygrad's heuristic makes for
  its image upcast), with at least min_macs multiply-adds. Only these count as misses where a set lacks them."""
  return s.reduceop is not None and macs_of(s) >= min_macs and _on_images(s)


def is_elementwise_target(s, min_macs: int) -> bool:
  """A big elementwise kernel over images, searched too (never counted as a miss): its heuristic tile upcasts every
  image axis, and with a long expression (a normalisation and an Elu) IR3 spills registers to private memory, which the
  cost model prices as the memory traffic it is. Nothing is summed, yet a variant is still checked bit-exact: some
  tiles tinygrad lowers over images write other bytes, or fault."""
  return s.reduceop is None and math.prod(int(x) for x in s.full_shape) >= min_macs // ELEMENTWISE_SHARE and _on_images(s)


def _on_images(s) -> bool:
  from tinygrad.codegen.late.coalesce import image_valid_dims
  from tinygrad.helpers import IMAGE
  return bool(IMAGE) and any(image_valid_dims(b.src[0].dtype, b.src[0].max_numel(), s.ren.target.arch) for b in s.bufs)


def heuristic(s):
  """What tinygrad 0.14.0's apply_opts does for this scheduler without BEAM (codegen/__init__.py)."""
  from tinygrad.helpers import NOOPT
  from tinygrad.uop.ops import Ops
  if NOOPT or (s.ast.arg is not None and s.ast.arg.applied_opts != ()) or any(u.op is Ops.STAGE for u in s.ast.backward_slice):
    return s
  from tinygrad.codegen.opt.heuristic import hand_coded_optimizations
  return hand_coded_optimizations(s)


@dataclass
class Variant:
  opts: list[list[Any]]       # tinygrad Opts as the table stores them
  name: str = ""
  work: dict[str, Any] | None = None
  us: float = math.inf        # the cost model's time under the shipped constants
  bit_exact: bool = False
  why: str = ""               # why it was not eligible (compile failed, outputs differ)
  launch: dict[str, Any] | None = None   # its compiled program: IR3 binary (hex), names, groups and local size


def calibration_variants(f: Searched) -> list[Variant]:
  """The register-tile sizes calibrate-a630 times for one kernel: the heuristic's, the chosen one, and the eligible variant
  with the fewest texel fetches (the largest tile tried) where it is neither; else the one with the most (the smallest).
  Only variants that bind their buffers as the chosen one does (the same parameter signature): calibrate-a630 runs them
  in place of the artifact's kernel, on its buffers."""
  best = f.best()
  sig = (best.launch or {}).get("sig")
  ok = [v for v in f.variants if v.bit_exact and v.work is not None and v.launch is not None and v.launch.get("sig") == sig]
  heur = f.variants[0]
  out = ([heur] if any(v is heur for v in ok) and heur is not best else []) + [best]
  rest = [v for v in ok if all(v is not o for o in out)]

  def tex(v: Variant) -> float:
    return float((v.work or {})["tex"])
  if rest:
    out.append(min(rest, key=tex) if min(map(tex, rest)) < min(map(tex, out)) else max(rest, key=tex))
  return out


@dataclass
class Searched:
  ast: str
  heuristic: str              # the kernel's name under the heuristic opts
  macs: int
  variants: list[Variant] = field(default_factory=list)

  def best(self) -> Variant:
    """The eligible variant with the smallest worst-case ratio to the heuristic kernel over the corners of the two
    constants the lever depends on (SCORE_CASES), then the fastest under the shipped constants: a tile the model says
    could lose somewhere in that range is not chosen over one that cannot (the heuristic itself scores 1)."""
    ok = [v for v in self.variants if v.bit_exact and v.work is not None]
    ref = ac.Work(**(ok[0].work or {}))
    base = [ac.dispatch_us([ref], c)[0] for c in SCORE_CASES]

    def worst(v: Variant) -> float:
      w = ac.Work(**(v.work or {}))
      return max(ac.dispatch_us([w], c)[0] / b for c, b in zip(SCORE_CASES, base))
    return min(ok, key=lambda v: (round(worst(v), 6), round(v.us, 6), len(v.opts)))


class Searcher:
  """Runs each variant of one kernel on the emulated node and costs it (the node must be the capture device)."""

  def __init__(self, device: str, rounds: int = 2, seed: int = SEED, log=print):
    self.device, self.rounds, self.seed, self.log = device, rounds, seed, log

  def _candidates(self, base) -> list:
    """One more UPCAST or UNROLL on top of `base`, and `base` with one of its UPCASTs taken away (a smaller tile). Taking
    an UNROLL away reorders the reduce's additions: never bit-exact, so not tried."""
    from tinygrad.codegen.opt import KernelOptError
    from tinygrad.codegen.opt.search import get_kernel_actions
    # past tinygrad's own cap on upcast x unroll (BEAM_UPCAST_MAX, 256), which the heuristic's image tiles already reach:
    # the registers decide, and the variant's footprint is costed
    out = [k for k in get_kernel_actions(base, include_0=False, max_up=MAX_UP).values() if k.applied_opts[-1].op.name in TILE_OPS]
    applied = list(base.applied_opts)
    for i, o in enumerate(applied):
      if o.op.name != "UPCAST":
        continue
      k = self._root.copy()
      try:
        for p in applied[:i] + applied[i + 1:]:
          k.apply_opt(p)
      except KernelOptError:
        continue
      out.append(k)
    return out

  def _run(self, k, rawbufs, var_vals, inputs: list[bytes]) -> tuple[Variant, list[bytes] | None]:
    """Compile one variant with IR3, run it once on the node over the seeded inputs: (its Variant, every buffer after)."""
    from tinygrad import Device
    from tinygrad.device import Buffer
    from tinygrad.engine.realize import time_call
    from tinygrad.helpers import ansistrip
    from tinygrad.uop.ops import Ops, UOp

    from backend.a630_timing import params_sig, work_of
    from compile.capture import emu_node
    v = Variant(opts_json(k.applied_opts))
    try:
      name = k.ast.arg.name if k.ast.arg is not None and k.ast.arg.name != "test" else None
      ast = k.copy().get_optimized_ast(name_override=name)
      prg = _to_program(ast.substitute({p: p.replace(arg=replace(p.arg, device=self.device)) for p in ast.toposort() if p.op is Ops.PARAM}), k.ren)
    except (Exception, _Timeout) as e:   # an opt tinygrad accepts but cannot lower or IR3 cannot compile: not eligible
      v.why = f"compile: {type(e).__name__}: {e}"[:200]
      return v, None
    node, dev = emu_node(self.device), Device[self.device]
    seen: list = []
    for b, data in zip(rawbufs, inputs):
      b.copy_from(Buffer("PYTHON", b.size, b.dtype, opaque=memoryview(bytearray(data))))
    old_exec, old_hook, kept = node.execute, node.on_dispatch, node.counts
    node.counts, node.on_dispatch = collections.deque(), seen.append
    node.set_execute(True)
    try:
      next(time_call(prg.call(*[UOp.from_buffer(b) for b in rawbufs]), var_vals))
      dev.synchronize()
      executed = list(node.counts)
    except Exception as e:
      v.why = f"run: {type(e).__name__}: {e}"[:200]
      return v, None
    finally:
      node.counts, node.on_dispatch = kept, old_hook
      node.set_execute(old_exec)
    if len(seen) != 1 or len(executed) != 1:
      v.why = f"expected one dispatch, saw {len(seen)}"
      return v, None
    v.name = ansistrip(str(prg.arg.function_name))   # tinygrad colours kernel names for its own logs
    d = seen[0]
    v.launch = {"lib": bytes(prg.src[3].arg).hex(), "name": v.name, "function_name": str(prg.arg.function_name),
                "groups": [int(x) for x in d.groups], "local": [int(x) for x in d.local_size], "sig": params_sig(prg)}
    w = work_of(v.name, executed[0][1], d)
    v.work, v.us = asdict(w), ac.dispatch_us([w])[0]
    return v, [bytes(b.as_memoryview()) for b in rawbufs]

  def search(self, s, rawbufs, var_vals) -> Searched:
    import numpy as np
    rawbufs = [b.ensure_allocated() for b in rawbufs]
    rng = np.random.default_rng(self.seed)
    # seeded inputs in [-1, 1): finite halves everywhere, so outputs compare bit for bit
    inputs = [rng.uniform(-1, 1, b.nbytes // 2).astype(np.float16).tobytes() + b"\0" * (b.nbytes % 2) for b in rawbufs]
    self._root = s
    base = heuristic(s.copy())
    found = Searched(s.ast.key.hex(), "", macs_of(s))
    ref_v, ref_out = self._run(base, rawbufs, var_vals, inputs)
    if ref_out is None:
      raise RuntimeError(f"the heuristic kernel does not run on the emulated node: {ref_v.why}")
    ref_v.bit_exact, found.heuristic = True, ref_v.name
    found.variants.append(ref_v)
    tried = {json.dumps(ref_v.opts)}
    frontier = base
    for _ in range(self.rounds):   # greedy: one more step from the best so far, while it keeps getting better
      best_before, step_k = found.best(), None
      for k in self._candidates(frontier):
        key = json.dumps(opts_json(k.applied_opts))
        if key in tried:
          continue
        tried.add(key)
        v, out = self._run(k, rawbufs, var_vals, inputs)
        if out is not None:
          v.bit_exact = out == ref_out
          if not v.bit_exact:
            v.why = "outputs differ from the heuristic kernel's"
        found.variants.append(v)
        if found.best() is v:
          step_k = k
      if step_k is None or found.best() is best_before:
        break
      frontier = step_k
    for v in found.variants:
      self.log(f"[tiles]   {v.name or '-':32s} {v.us:9.1f} us regs {(v.work or {}).get('regs', '-')} {v.opts} {v.why}")
    b = found.best()
    self.log(f"[tiles] {found.heuristic}: {len(found.variants)} variants, heuristic {ref_v.us:.1f} us -> {b.name} {b.us:.1f} us "
             f"({sum(not v.bit_exact for v in found.variants)} not eligible)")
    return found


class _Timeout(Exception):
  pass


def _to_program(ast, ren):
  import signal

  from tinygrad.codegen import to_program

  def expired(signum, frame):
    raise _Timeout(f"lowering took over {COMPILE_TIMEOUT_S} s")
  kept = signal.signal(signal.SIGALRM, expired)
  signal.alarm(COMPILE_TIMEOUT_S)
  try:
    return to_program(ast, ren)
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, kept)


# *** the hook a QCOM compile runs under ***

def _applied(s, rows: list[list[Any]]):
  """s with recorded opts applied (those past what it already has, as tinygrad's own cache hit does)."""
  k = s.copy()
  for o in _opts(rows)[len(s.applied_opts):]:
    k.apply_opt(o)
  return k


class Tiles:
  """Stands in for tinygrad's beam_search during a QCOM capture: recorded opts for the kernels of the shipped set,
  tinygrad's heuristic for every other kernel; in search mode (recording) it searches the big image convolutions and
  the big elementwise kernels over images."""

  def __init__(self, recorded: dict[str, Any] | None, why: str, searcher: Searcher | None = None, min_macs: int = MIN_MACS):
    self.recorded, self.why, self.searcher = recorded, why, searcher
    self.min_macs = int(recorded.get("min_macs", min_macs)) if recorded else min_macs
    self.entries = {e["ast"]: e for e in (recorded or {}).get("entries", [])}
    self.hits: dict[str, str] = {}      # ast -> the chosen kernel's heuristic name
    self.misses: dict[str, str] = {}    # ast -> heuristic name of a big image convolution the set does not hold
    self.searched: dict[str, Searched] = {}

  def __call__(self, s, rawbufs, var_vals, amt, allow_test_size=True, disable_cache=False):
    key = s.ast.key.hex()
    if (e := self.entries.get(key)) is not None:
      self.hits[key] = e["heuristic"]
      return _applied(s, e["opts"])
    convolution = is_target(s, self.min_macs)
    if self.searcher is not None and (convolution or is_elementwise_target(s, self.min_macs)):
      if key not in self.searched:
        self.searched[key] = self.searcher.search(s, rawbufs, var_vals)
      return _applied(s, self.searched[key].best().opts)
    if not convolution:
      return heuristic(s)
    k = heuristic(s)
    self.misses[key] = ""
    return k

  @contextlib.contextmanager
  def hooked(self):
    """BEAM=1 routes every kernel through beam_search (and compiles them in this process, where the hook is); the hook
    answers without timing anything."""
    from tinygrad.codegen.opt import search
    from tinygrad.helpers import Context
    if self.recorded is None and self.searcher is None:
      yield self
      return
    kept = search.beam_search
    search.beam_search = self
    try:
      with Context(BEAM=1):
        yield self
    finally:
      search.beam_search = kept

  def summary(self) -> str:
    if self.searcher is not None:
      return f"searched {len(self.searched)} big image kernels (recording)"
    if self.recorded is None:
      return f"tinygrad's heuristic opts ({self.why})"
    if not self.hits:
      return "tinygrad's heuristic opts (no shipped register-tile set holds these kernels)"
    line = f"{len(self.hits)} of the big image kernels from the shipped sets ({self.why})"
    if self.misses:
      line += f"; {len(self.misses)} not in them, on tinygrad's heuristic opts"
    return line

  def meta(self) -> dict[str, Any]:
    return {"used": bool(self.hits), "why": self.why, "kernels": len(self.hits), "misses": len(self.misses)}

  def finish(self) -> None:
    """Recording: what the search found, for `record` to store."""
    if self.searcher is not None and (path := os.environ.get(RECORD_ENV)):
      rows = [{"ast": f.ast, "heuristic": f.heuristic, "macs": f.macs, "opts": f.best().opts, "name": f.best().name,
               "variants": [{**asdict(v), "launch": None} for v in f.variants],
               "calibration": [{"opts": v.opts, **(v.launch or {})} for v in calibration_variants(f)]} for f in self.searched.values()]
      write_atomic(path, json.dumps({"min_macs": self.min_macs, "entries": sorted(rows, key=lambda r: r["ast"])}))


def choose(device: str, kind: str, camera: tuple[int, int], model_sha256: dict[str, str], flags: dict[str, int], dev_name: str = "") -> Tiles:
  """The hook a compile for `device` runs its capture under."""
  if device != "QCOM":
    return Tiles(None, "not a QCOM compile")
  if os.environ.get(RECORD_ENV):
    min_macs = int(os.environ.get(RECORD_ENV + "_MIN_MACS", MIN_MACS))
    return Tiles(None, "recording", Searcher(dev_name or "QCOM", log=lambda m: print(m, file=sys.stderr)), min_macs=min_macs)
  mode = os.environ.get(MODE_ENV, "auto")
  if mode not in ("auto", "off"):
    raise UserError(f"{MODE_ENV}={mode}: use auto or off")
  if mode == "off":
    return Tiles(None, f"{MODE_ENV}=off")
  key = match_key(kind, camera, model_sha256, flags)
  same_build = [s for s in load_table()["sets"] if all(s["match"][k] == key[k] for k in BUILD_KEYS)]
  if not same_build:
    return Tiles(None, "no shipped register-tile set for this tinygrad, tinymesa and these flags")
  # the set recorded for this compile's own models wins where two sets hold one kernel (the same AST: the same tile either way)
  same_build.sort(key=lambda s: s["match"] == key)
  own = same_build[-1] if same_build[-1]["match"] == key else None
  # a big convolution none holds is a miss from the size its own set searched down to, else from the largest any searched
  min_macs = int(own["min_macs"]) if own else max(int(s["min_macs"]) for s in same_build)
  merged = {"entries": [e for s in same_build for e in s["entries"]], "min_macs": min_macs}
  if own:
    return Tiles(merged, f"recorded {own['recorded']} for the {own['size']} {kind} models")
  return Tiles(merged, "kernels matched by AST in the sets recorded for " + ", ".join(sorted({_label(s) for s in same_build})))


BUILD_KEYS = ("tinygrad", "tinymesa", "device", "flags")   # what a kernel's IR3 code follows from besides its AST


def _label(s: dict[str, Any]) -> str:
  return f"the {s['size']} {s['match']['kind']} models at {s['match']['camera'][0]}x{s['match']['camera'][1]}"


# *** recording ***

REPO = Path(__file__).resolve().parents[2]


def record(kind: str, size: str, camera: tuple[int, int], seed: int = 0, openpilot: str | None = None, min_macs: int = MIN_MACS,
           table_path: Path = TABLE, keep: Path | None = None, log=print) -> dict[str, Any]:
  """Compile the reference models of `kind` for QCOM in a child under the hook in search mode (the compile's own checks
  then run with the chosen tiles: jit == unjitted, pickle replay on the emulated node), and store what it found. keep: a
  directory to write that artifact to (bench/bench_a630_tiles.py compares it with a heuristic one)."""
  import subprocess
  import tempfile

  from compile.capture import QCOM_FLAGS_OF
  from compile.programs import recipe_of
  from selfdrive_glue.files import sha256_file
  k = kinds.get(kind)
  with tempfile.TemporaryDirectory(prefix="modeld-msm-tiles-") as td:
    models = recipe_of(k).write_models(Path(td) / "models", size, seed)
    paths = {m: str(w.path) for m, w in models.items()}
    found = Path(td) / "found.json"
    code = ("from compile.build import compile_artifact; "
            f"r = compile_artifact({kind!r}, {paths!r}, {tuple(camera)!r}, 'QCOM', {str(keep or Path(td) / 'artifact')!r}, openpilot={openpilot!r}); "
            "print(r.table())")
    env = {**os.environ, RECORD_ENV: str(found), RECORD_ENV + "_MIN_MACS": str(min_macs), "MODELD_DEV": ""}
    env.pop(TABLE_ENV, None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)
    rows = json.loads(found.read_text())
    key = match_key(kind, camera, {m: sha256_file(w.path) for m, w in models.items()}, QCOM_FLAGS_OF[openpilot or k.openpilot])
  import platform
  recorded = {"match": key, "size": size, "seed": seed, "min_macs": rows["min_macs"], "entries": rows["entries"],
              "recorded": f"on the emulated a630 ({platform.machine()} host), scored by backend/a630_cost.py at the corners of "
                          "tex_rate and hide_waves"}
  store(recorded, table_path)
  changed = sum(e["name"] != e["heuristic"] for e in rows["entries"])
  log(f"[tiles] {kind} {size}: {len(rows['entries'])} big image kernels searched, {changed} on other tiles than the heuristic's")
  return recorded


def main() -> int:
  import argparse

  from selfdrive_glue.nv12 import parse_camera
  ap = argparse.ArgumentParser(description="record the QCOM register-tile set of a kind's reference models")
  ap.add_argument("cmd", choices=("record",))
  ap.add_argument("--kind", default="driving", choices=kinds.choices())
  ap.add_argument("--size", default="tiny")
  ap.add_argument("--camera", default="1928x1208")
  ap.add_argument("--openpilot", choices=("0.11", "master"), default=None,
                  help="the release whose capture flags to record under (a kind that serves both, as the DM; default: the kind's)")
  ap.add_argument("--keep", type=Path, help="write the recording compile's artifact here")
  ap.add_argument("--min-macs", type=int, default=None, help=f"smallest convolution searched (default {MIN_MACS}; tiny: 1/16 of it)")
  a = ap.parse_args()
  min_macs = a.min_macs if a.min_macs is not None else (MIN_MACS if a.size == "full" else MIN_MACS // 16)
  record(a.kind, a.size, parse_camera(a.camera), openpilot=a.openpilot, min_macs=min_macs, keep=a.keep)
  return 0


if __name__ == "__main__":
  run_tool(main)
