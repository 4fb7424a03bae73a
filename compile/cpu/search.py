"""Kernel search for CPU (and workstation GPU) artifacts, done once by us and shipped in the repository, so a user's compile
never pays it.

tinygrad picks each kernel's optimisations (upcasts, unrolls, ...) by a hand-written heuristic, or by timing candidates
(BEAM=n). The search finds much faster kernels than the heuristic for the models' fp32 matrix products, but a search of
the full models takes tens of minutes on a small box, far over the 3-minute compile budget (the figures:
docs/performance-cpu.md §2 and §6). So we search once
(`record`, below), export what tinygrad's search cache holds (per kernel: the AST's key and the chosen opts) into
search_table.json, and a compile whose kernels are those of a recorded set (same tinygrad, device, models, camera,
precision and layout) loads the set into tinygrad's own search cache (tinygrad.helpers.diskcache_put, the table beam
search reads first) and captures under BEAM: every kernel is then a cache hit, compiled once with the recorded opts.
A compile of anything else keeps the heuristic: a miss under BEAM would start the search the table exists to avoid.

A GPU set (CUDA/NV/AMD) works the same way and is keyed by the GPU's architecture (tinygrad's Device.arch, e.g. sm_90):
a search there would cost minutes of a user's compile and its result varies from run to run with the timings it sees
(what the shipped GPU set gains: docs/gpu.md). A GPU set is used only on the
architecture it was timed on (there is no "nearest" GPU to borrow from).

The table is JSON (op names and integers), not pickles: it is reviewed data, and loading it runs nothing.
The recorded set is recorded in the artifact's manifest ("search"). Recording, tuning and re-keying: compile/tuning/record.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.helpers import CACHELEVEL, IGNORE_BEAM_CACHE, diskcache_put

from artifact import cpu_threads
from artifact.cpu_info import cpu_info
from artifact.format import installed_versions
from compile import pinned
from selfdrive_glue.errors import UserError

TABLE = Path(__file__).with_name("search_table.json")
# sha256 of the shipped table, kept in this source file on purpose: cached artifacts (offcar/demo.py) are keyed by the
# bytes of compile/*.py, so a re-recorded table also retires artifacts compiled with the old one; and a table edited by hand
# is refused rather than replayed. `record` updates it.
TABLE_SHA256: str | None = "cdf3162ba5b5e609038bc0032d1694c459801cd1aabe9a082e2285ae905d9cee"
SEARCHES = ("auto", "off", "untuned")
# which level's set to borrow where none is shipped for this CPU's: the nearest first
ISA_PREFERENCE = ("avx2", "avx512", "neon", "base")
FORMAT = 1


TABLE_ENV = "MODELD_CPU_SEARCH_TABLE"   # a candidate table to compile with instead (compile/tuning/record.py rekey, A/B runs)


def load_table(path: Path | None = None) -> dict[str, Any]:
  path = path or Path(os.environ.get(TABLE_ENV) or TABLE)
  if (data := pinned.read(path, TABLE, TABLE_SHA256, Path(__file__),
                          "re-record it (python -m compile.tuning.record record) or remove it")) is None:
    return {"format": FORMAT, "sets": []}
  table = json.loads(data)
  if table.get("format") != FORMAT:
    raise UserError(f"{path.name}: search table format {table.get('format')!r}, expected {FORMAT}; "
                    "regenerate it (python -m compile.tuning.record record)")
  return table


# our code that shapes the step's kernels (queues, warp, lowering): an edit there retires every recorded set, so a compile
# falls back to the heuristic (as fast as before the search) instead of searching the kernels it no longer finds
KERNEL_SOURCES = ("programs/driving_step.py", "programs/warp.py", "cpu/layout.py", "cpu/pointwise.py")   # under compile/


def code_fingerprint() -> str:
  """Of the code, not its text: the syntax trees without docstrings, so fixing a comment or a docstring keeps the sets."""
  return fingerprint_of([(Path(__file__).parents[1] / name).read_text() for name in KERNEL_SOURCES])


def fingerprint_of(sources: list[str]) -> str:
  """Written by _dump, not ast.dump, whose text changes with the Python version (3.12 added type_params to every function
  and class): a set recorded on a 3.12 box (the GPU host, the car) must match on a 3.11 one. Uses nothing but ast and
  hashlib, so a test can run it under other Pythons."""
  import ast
  import hashlib
  h = hashlib.sha256()
  for src in sources:
    tree = ast.parse(src)
    for node in ast.walk(tree):
      body = getattr(node, "body", None)
      if (isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and isinstance(body, list) and body
          and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
        node.body = body[1:] or [ast.Pass()]
    h.update(_dump(tree).encode())
  return h.hexdigest()[:16]


def _dump(node: Any) -> str:
  """A syntax tree as text, leaving out fields that are empty or None (where newer Pythons add fields, they default so)."""
  import ast
  if isinstance(node, ast.AST):
    fields = (f"{f}={_dump(v)}" for f in node._fields if (v := getattr(node, f, None)) is not None and v != [])
    return f"{type(node).__name__}({','.join(fields)})"
  if isinstance(node, list):
    return "[" + ",".join(_dump(x) for x in node) + "]"
  return repr(node)


GPU_DEVICES = ("CUDA", "NV", "AMD")


def device_isa(device: str) -> str:
  """What a set's opts were timed on: the CPU's ISA level, a GPU's architecture (sm_90, gfx1100), else the device's name
  (QCOM: no shipped sets)."""
  base = device.split(":")[0]
  if base == "CPU":
    return cpu_info().isa
  if base in GPU_DEVICES:
    from tinygrad import Device
    return str(getattr(Device[device], "arch", None) or base)
  return base


def match_key(*, device: str, precision: str, layout: bool, camera: tuple[int, int], model_sha256: dict[str, str],
              threads: int | None = None, isa: str | None = None) -> dict[str, Any]:
  """What a recorded set must share with a compile for its kernels to be the same ones: a kernel missing from the set
  would be searched under BEAM, the wait the table exists to spare. The thread count is part of it: tinygrad splits
  kernels into that many parts (artifact/cpu_threads.py), so another count gives other kernels. The ISA level is part of it
  too: the kernels are the same, but opts timed on AVX-512 are not the best on AVX2 (choose() falls back to another level's
  set, and says so, where this one has none). A GPU's kernels are not split (threads 1); its "isa" is its architecture."""
  if threads is None:
    threads = cpu_threads.count() if device.split(":")[0] == "CPU" else 1
  return {"tinygrad": installed_versions()["tinygrad"], "device": device, "precision": precision, "layout": layout, "camera": list(camera),
          "threads": threads, "models": dict(sorted(model_sha256.items())), "code": code_fingerprint(),
          "isa": device_isa(device) if isa is None else isa}


def choose(requested: str, key: dict[str, Any], table: dict[str, Any] | None = None) -> tuple[dict[str, Any] | None, str]:
  """-> (the recorded set to use or None, why)."""
  if requested not in SEARCHES:
    raise UserError(f"unknown search {requested!r}: use one of {', '.join(SEARCHES)}")
  if requested == "off":
    return None, "requested"
  if key["device"] not in ("CPU", *GPU_DEVICES):
    return None, f"no shipped search for {key['device']}"
  if CACHELEVEL.value < 1 or IGNORE_BEAM_CACHE.value:
    return None, "tinygrad's search cache is disabled (CACHELEVEL/IGNORE_BEAM_CACHE): a shipped search could not be replayed"
  table = load_table() if table is None else table
  exact = [s for s in table["sets"] if s["match"] == key]
  if key["device"] != "CPU" and not exact:
    others = sorted({f"{s['match']['isa']} {s['match']['precision']}" for s in table["sets"] if s["match"]["device"] == key["device"]})
    return None, (f"no shipped search for {key['device']} {key['isa']} {key['precision']} with these models/camera"
                  + (f" (shipped: {', '.join(others)}, for the reference models)" if others else "") + ": tinygrad's heuristic opts; "
                  f"record one with `python -m compile.tuning.record record --device {key['device']}` on such a GPU")
  # another ISA level's set: the same kernels, with opts timed elsewhere; still far better than the heuristic on the full models
  other = [s for s in table["sets"] if {**s["match"], "isa": key.get("isa")} == key]
  for s in exact or sorted(other, key=lambda s: ISA_PREFERENCE.index(s["match"].get("isa")) if s["match"].get("isa") in ISA_PREFERENCE else 99):
    why = f"shipped BEAM={s['beam']} search for these models ({len(s['entries'])} kernels, recorded on {s['recorded_on']}"
    why += ")" if exact else (f" for ISA level {s['match'].get('isa')}; none is shipped for this CPU's {key.get('isa')}, so its opts are "
                              "used as they are: record one with `python -m compile.tuning.record record` on such a CPU)")
    if requested == "untuned":
      return untuned(s), why + ", without the tuner's changes"
    return s, why + (f", {n} tuned" if (n := tuned_count(s)) else "")
  return None, "no shipped search for these models/camera/precision/layout (tinygrad's heuristic opts)"


def tuned_count(recorded: dict[str, Any]) -> int:
  """Kernels whose opts the tuner (compile/tuning/tune.py) changed from what the search recorded."""
  now = {e["ast"]: e["opts"] for e in recorded["entries"]}
  return sum(now.get(t["ast"]) != t["recorded_opts"] for t in recorded.get("tuned", {}).get("kernels", []))


def untuned(recorded: dict[str, Any]) -> dict[str, Any]:
  """The set as its search recorded it, before the tuner: for A/B runs (MODELD_CPU_SEARCH=untuned)."""
  orig = {t["ast"]: t["recorded_opts"] for t in recorded.get("tuned", {}).get("kernels", [])}
  return {**recorded, "entries": [{**e, "opts": orig.get(e["ast"], e["opts"])} for e in recorded["entries"]], "tuned": {}}


def search_key(ast: bytes, amt: int, allow_test_size: bool, device: str, suffix: str) -> dict[str, Any]:
  """The key tinygrad's beam search reads and writes its cache under (codegen/opt/search.py, beam_search)."""
  return {"ast": ast, "amt": amt, "allow_test_size": allow_test_size, "device": device, "suffix": suffix}


def opts_json(opts) -> list[list[Any]]:
  """tinygrad Opts as a table entry stores them: [op name, axis, arg] (a tuple arg as a list)."""
  return [[o.op.name, o.axis, list(o.arg) if isinstance(o.arg, tuple) else o.arg] for o in opts]


def install(recorded: dict[str, Any]) -> int:
  """Put a recorded set into tinygrad's search cache, keyed exactly as its beam search looks kernels up."""
  for e in recorded["entries"]:
    key = search_key(bytes.fromhex(e["ast"]), recorded["beam"], e["allow_test_size"], e["device"], e["suffix"])
    diskcache_put("beam_search", key, [Opt(OptOps[op], axis, tuple(arg) if isinstance(arg, list) else arg) for op, axis, arg in e["opts"]])
  return len(recorded["entries"])


def table_bytes(table: dict[str, Any]) -> bytes:
  return (json.dumps(table, indent=1, sort_keys=True) + "\n").encode()


def store(recorded: dict[str, Any], table_path: Path = TABLE) -> None:
  """Add one recorded set to the table, replacing a set with the same match key and dropping sets recorded for other kernel
  code (they can never match again)."""
  table = load_table(table_path)
  code = recorded["match"]["code"]
  table["sets"] = [s for s in table["sets"] if s["match"] != recorded["match"] and s["match"]["code"] == code] + [recorded]
  write_table(table, table_path)


def write_table(table: dict[str, Any], table_path: Path = TABLE) -> None:
  """For the shipped table, also its sha256 here (in this file, and in this process: a second store in the same run reads
  the table back against it)."""
  global TABLE_SHA256
  TABLE_SHA256 = pinned.store(table_path, table_bytes(table), TABLE, TABLE_SHA256, Path(__file__))
