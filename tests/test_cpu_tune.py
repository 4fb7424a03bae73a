"""The tuner (compile/tuning/tune.py): its candidates are opts tinygrad accepts, a set it starts covers every kernel a compile
lowers (so the compile replays it without searching), and what it keeps is an artifact that passes the compile's checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from compile.cpu import search as cpu_search

REPO = Path(__file__).resolve().parents[1]


def _child(code: str, tmp_path: Path) -> dict:
  # own search cache file: what the tuner and the compile install stays out of the machine's tinygrad cache
  r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=REPO, timeout=600,
                     env={**os.environ, "CACHEDB": str(tmp_path / "cache.db")})
  assert r.returncode == 0, r.stderr[-4000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_candidates_are_legal_tiles_split_over_the_threads(tmp_path):
  out = _child("""
    import json
    from tinygrad import Device, Tensor
    from tinygrad.codegen.opt.postrange import Scheduler, args_from_ast
    from compile.tuning import tune as cpu_tune
    a, b = Tensor.empty(256, 192, device="CPU"), Tensor.empty(192, 512, device="CPU")
    calls = [c for c in (a @ b).schedule_linear().src if c.src[0].op.name == "SINK"]
    ast = calls[0].src[0]
    s = Scheduler(ast, Device["CPU"].renderer); s.convert_loop_to_global()
    bufs, _ = args_from_ast(ast, "CPU")
    k = cpu_tune.Kernel(s.ast.key.hex(), "matmul", s, bufs, ())
    res = {}
    for threads in (1, 2):
      tiles = cpu_tune.tiles(k, threads)
      refined = cpu_tune.refinements(k, tiles[0], threads)
      res[threads] = [[(o.op.name, o.axis, o.arg) for o in c] for c in tiles + refined]
      res[f"unique{threads}"] = len(set(tiles)) == len(tiles) and len(set(refined)) == len(refined) and tiles[0] in refined
      res[f"legal{threads}"] = all(cpu_tune._legal(k, c) for c in tiles + refined)
    res["refused"] = cpu_tune.time_opts(k, tiles[0] + tiles[0], 1)   # the same upcasts twice: tinygrad refuses, inf
    res["timed"] = cpu_tune.time_opts(k, tiles[0], 2)
    print(json.dumps(res))
  """, tmp_path)
  assert out["legal1"] and out["legal2"] and out["refused"] == float("inf") and 0 < out["timed"] < float("inf")
  for threads in ("1", "2"):
    cands = out[threads]
    assert len(cands) > 5 and out[f"unique{threads}"]
    for c in cands:
      ups = [arg for op, _, arg in c if op == "UPCAST"]
      tile = 1
      for u in ups:
        tile *= u
      assert ups and tile <= 64
      assert [op for op, _, _ in c if op == "THREAD"] == (["THREAD"] if threads == "2" else [])
      assert c[-1][0] == "THREAD" or threads == "1"   # the split comes last: it divides what the tile leaves
    assert any(op == "UNROLL" for c in cands for op, _, _ in c)


@pytest.mark.slow
def test_a_set_started_by_the_tuner_compiles_without_a_search(tmp_path):
  """tune --new on the tiny models: one entry per kernel the compile lowers, the slowest two re-searched; then a compile
  with that table replays it (any search would time kernels: here that raises) and passes its numerics checks."""
  out = _child(f"""
    import json
    from pathlib import Path
    import os
    from compile.tuning import record as cpu_record
    from compile.cpu import search as cpu_search
    table = Path({str(tmp_path / "table.json")!r})
    s = cpu_record.tune("tiny", (1928, 1208), "fp32", "auto", 2, table_path=table, new=True, budget=4, log=lambda *_: None)

    import tinygrad.codegen.opt.search as search
    def no_search(*a, **k):
      raise AssertionError("the compile searched a kernel the set does not have")
    search._time_program = no_search
    os.environ[cpu_search.TABLE_ENV] = str(table)
    from compile.build import compile_artifact
    from compile.refmodels.driving import write_models
    m = write_models(Path({str(tmp_path / "models")!r}), "tiny", 0)
    models = {{"vision": m["vision"].path, "policy": m["policy"].path}}
    compile_artifact("driving", models, (1928, 1208), "CPU", Path({str(tmp_path / "art")!r}), log=lambda *_: None)
    meta = json.loads((Path({str(tmp_path / "art")!r}) / "metadata.json").read_text())
    print(json.dumps({{"set": s, "search": meta["search"], "stored": json.loads(table.read_text())}}))
  """, tmp_path)
  s, stored = out["set"], out["stored"]
  assert stored["sets"] == [s] and s["start"] == "heuristic" and s["match"]["models"]
  keys = [e["ast"] for e in s["entries"]]
  assert len(keys) == len(set(keys)) > 10
  tuned = s["tuned"]["kernels"]
  assert len(tuned) == 2 and all(k["ast"] in keys and k["ms_before"] > 0 for k in tuned)
  entries = {e["ast"]: e["opts"] for e in s["entries"]}
  for k in tuned:   # changed only with a margin over the starting opts, measured in the same rounds
    assert (entries[k["ast"]] != k["recorded_opts"]) == (k["ms_after"] is not None)
    assert k["ms_after"] is None or k["ms_after"] < k["ms_before"] * (1 - s["tuned"]["margin"])
  assert out["search"]["used"] and out["search"]["kernels"] == len(keys) and out["search"]["tuned"] == sum(k["ms_after"] is not None for k in tuned)
  # the A/B switch gives back the opts the set started with
  plain = cpu_search.untuned(s)
  assert {e["ast"]: e["opts"] for e in plain["entries"]} == {**entries, **{k["ast"]: k["recorded_opts"] for k in tuned}}
  assert cpu_search.tuned_count(plain) == 0

  # rekey: the set, as if recorded for older kernel code, is carried over (every kernel a cache hit); with one kernel
  # missing it is not (the compile had to search one)
  from compile.tuning import record as cpu_record
  whole = {**s, "match": {**s["match"], "code": "0" * 16}}
  holed = {**whole, "match": {**whole["match"], "threads": whole["match"]["threads"]}, "entries": s["entries"][1:]}
  for sets, carried in (([whole], 1), ([holed], 0)):
    table = tmp_path / f"rekey{carried}.json"
    table.write_text(json.dumps({"format": cpu_search.FORMAT, "sets": sets}))
    lines: list[str] = []
    assert cpu_record.rekey(table, log=lines.append) == carried, lines
    after = json.loads(table.read_text())["sets"]
    assert after == ([{**s, "match": {**s["match"], "code": cpu_search.code_fingerprint()}}] if carried else []), lines


def test_eviction_buffer_is_twice_the_largest_cache(tmp_path):
  from compile.tuning.tune import _cache_bytes
  for i, size in enumerate(("32K", "1024K", "256M", "bogus")):
    (tmp_path / f"index{i}").mkdir()
    (tmp_path / f"index{i}" / "size").write_text(size + "\n")
  assert _cache_bytes(tmp_path) == 512 << 20
  assert _cache_bytes(tmp_path / "absent") == 64 << 20   # no sysfs: still more than any cache a 2-core box has


def test_window_of_a_3x3_convolution_is_a_candidate_unrolled(tmp_path):
  """A 3x3 convolution's window (two reduce axes of 3) is offered fully unrolled beside each tile, last axis first; the
  channel reduction (12) is not; refinements of such a tile keep the window. A matmul gets no window."""
  out = _child("""
    import json
    from tinygrad import Device, Tensor
    from tinygrad.codegen.opt.postrange import Scheduler, args_from_ast
    from compile.tuning import tune as cpu_tune
    def kernel(t):
      ast = [c for c in t.schedule_linear().src if c.src[0].op.name == "SINK"][-1].src[0]
      s = Scheduler(ast, Device["CPU"].renderer); s.convert_loop_to_global()
      return cpu_tune.Kernel(s.ast.key.hex(), "k", s, args_from_ast(ast, "CPU")[0], ())
    conv = kernel(Tensor.empty(1, 12, 32, 64, device="CPU").conv2d(Tensor.empty(24, 12, 3, 3, device="CPU"), stride=2, padding=1))
    mm = kernel(Tensor.empty(64, 96, device="CPU") @ Tensor.empty(96, 128, device="CPU"))
    tiles = cpu_tune.tiles(conv, 2)
    windowed = [c for c in tiles if any(o.op.name == "UNROLL" for o in c)]
    refined = cpu_tune.refinements(conv, windowed[0], 2)
    fmt = lambda c: [(o.op.name, o.axis, o.arg) for o in c]
    print(json.dumps({"window": fmt(cpu_tune._window(conv)), "mm_window": fmt(cpu_tune._window(mm)),
                      "n": len(tiles), "windowed": len(windowed), "legal": all(cpu_tune._legal(conv, c) for c in tiles + refined),
                      "refined_keep": all(fmt(cpu_tune._window(conv))[0] in fmt(c) for c in refined),
                      "timed": cpu_tune.time_opts(conv, windowed[0], 1)}))
  """, tmp_path)
  assert out["window"] == [["UNROLL", 2, 0], ["UNROLL", 1, 0]] and out["mm_window"] == []
  assert 0 < out["windowed"] < out["n"] and out["legal"] and out["refined_keep"]
  assert 0 < out["timed"] < float("inf")
