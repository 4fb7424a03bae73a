"""Recording, tuning and re-keying the shipped kernel search sets, CPU and workstation GPU (compile/cpu/search.py holds the
table and how a compile uses it). Tools for us, run by hand on the machine a set is for; never by a user's compile.

  .venv/bin/python -m compile.tuning.record record --size full --beam 1   # minutes to an hour; appends/replaces one set
  .venv/bin/python -m compile.tuning.record tune --size full --top 12     # then a steadier look at the slowest kernels (cpu_tune.py)
  .venv/bin/python -m compile.tuning.record record --device CUDA          # a GPU's set, keyed by its arch
  .venv/bin/python -m compile.tuning.record rekey                         # after an edit of KERNEL_SOURCES meant to keep the kernels
"""
from __future__ import annotations

import argparse
import os
import pickle
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tinygrad.helpers import VERSION

from artifact import cpu_threads
from artifact.cpu_info import cpu_info
from artifact.format import verify_artifact
from compile import precision as precision_mod
from compile.cpu import layout as cpu_layout
from compile.cpu import search as cpu_search
from compile.cpu.search import TABLE, opts_json, tuned_count
from compile.refmodels.driving import write_models
from compile.tuning import run_tool
from compile.tuning import tune as cpu_tune
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import sha256_file, write_atomic
from selfdrive_glue.nv12 import parse_camera

REPO = Path(__file__).resolve().parents[2]


def export(db: Path, beam: int) -> list[dict[str, Any]]:
  """The BEAM=beam entries of a tinygrad search cache file (one written by our own recording run) as JSON-able rows."""
  con = sqlite3.connect(str(db))
  try:
    rows = con.execute(f"SELECT ast, amt, allow_test_size, device, suffix, val FROM 'beam_search_{VERSION}' WHERE amt=?", (beam,)).fetchall()
  finally:
    con.close()
  out = []
  for ast, _amt, ats, device, suffix, val in rows:
    opts = pickle.loads(val)   # our own recording run's cache file, written moments before by tinygrad
    out.append({"ast": ast.hex(), "allow_test_size": bool(ats), "device": device, "suffix": suffix, "opts": opts_json(opts)})
  return sorted(out, key=lambda e: e["ast"])


def record(size: str, camera: tuple[int, int], beam: int, precision: str, layout: str, table_path: Path = TABLE, seed: int = 0,
           device: str = "CPU") -> dict[str, Any]:
  """Search the reference models' kernels once (a compile in a child under BEAM with a fresh cache file) and store the
  result as one set of the table, replacing a set with the same match key."""
  with tempfile.TemporaryDirectory(prefix="modeld-msm-search-") as td:
    models = write_models(Path(td) / "models", size, seed)
    db = Path(td) / "search.db"
    paths = {"vision": str(models["vision"].path), "policy": str(models["policy"].path)}
    code = ("import sys; from compile.build import compile_artifact; "
            f"compile_artifact('driving', {paths!r}, {tuple(camera)!r}, {device!r}, "
            f"{str(Path(td) / 'artifact')!r}, precision={precision!r}, layout={layout!r}, search='off')")
    # the search times kernels split for, and run on, this machine's cores, their parts in parallel as the runtime runs them
    # (artifact/cpu_threads.py); the set only matches a compile with the same thread count
    env = {**os.environ, "BEAM": str(beam), "CACHEDB": str(db), "PARALLEL": str(os.cpu_count() or 1), "MODELD_CPU_PARTS": "parallel"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)
    compute, _ = precision_mod.choose(device, precision)
    use_layout, _ = cpu_layout.choose(device, layout)
    key = cpu_search.match_key(device=device, precision=compute, layout=use_layout, camera=camera,
                    model_sha256={k: sha256_file(m.path) for k, m in models.items()})
    entries = export(db, beam)
  recorded = {"match": key, "beam": beam, "recorded_on": _recorded_on(device), "size": size, "seed": seed, "entries": entries}
  cpu_search.store(recorded, table_path)
  return recorded


def _recorded_on(device: str) -> str:
  cpu = cpu_info()
  if device.split(":")[0] == "CPU":
    return f"{cpu.model} ({cpu.cores} cores)"
  name = ""
  if device in ("CUDA", "NV"):   # the GPU's marketing name is only for people reading the table; the key is its arch
    try:
      name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                            timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
      name = ""
  return f"{name or device} {cpu_search.device_isa(device)} ({cpu.model} host)"


def tune(size: str, camera: tuple[int, int], precision: str, layout: str, top: int, table_path: Path = TABLE, seed: int = 0,
         budget: int | None = None, new: bool = False, log=print) -> dict[str, Any]:
  """Re-search the slowest kernels of a recorded set's step (compile/tuning/tune.py) and store the set back. `new`: with no
  recorded set, start one from tinygrad's heuristic opts (minutes instead of a BEAM recording's tens of minutes)."""
  if cpu_threads.mode() != "parallel":
    raise UserError("tune times kernels as the runtime runs them: unset MODELD_CPU_PARTS (parallel)")
  compute, _ = precision_mod.choose("CPU", precision)
  use_layout, _ = cpu_layout.choose("CPU", layout)
  with tempfile.TemporaryDirectory(prefix="modeld-msm-tune-") as td:
    models = write_models(Path(td) / "models", size, seed)
    key = cpu_search.match_key(device="CPU", precision=compute, layout=use_layout, camera=camera,
                    model_sha256={k: sha256_file(m.path) for k, m in models.items()})
    recorded = next((s for s in cpu_search.load_table(table_path)["sets"] if s["match"] == key), None)
    if recorded is None and new:
      cpu = cpu_info()
      recorded = {"match": key, "beam": 1, "recorded_on": f"{cpu.model} ({cpu.cores} cores)", "size": size, "seed": seed,
                  "entries": [], "start": "heuristic"}
    if recorded is None:
      raise UserError(f"no recorded set for {size} models, {camera[0]}x{camera[1]}, {compute}, {key['threads']} threads: "
                      "record one first (python -m compile.tuning.record record), or start one with tune --new")
    cpu_tune.tune(recorded, {k: m.path for k, m in models.items()}, camera, compute, use_layout, top, key["threads"], log, budget)
  cpu_search.store(recorded, table_path)
  return recorded


def rekey(table_path: Path = TABLE, log=print) -> int:
  """Carry the sets recorded for older kernel code over to the current code, each only where it still covers every kernel:
  its entries are put into a fresh search cache and the reference models it was recorded for are compiled under BEAM, as a
  user's compile replays it; if that compile searched nothing (the cache holds exactly the set's kernels afterwards), the
  kernels are the recorded ones and the set is stored under the new fingerprint. A set that misses is left out, to be
  recorded again. Returns how many sets were carried over."""
  table = cpu_search.load_table(table_path)
  code = cpu_search.code_fingerprint()
  kept, carried = [s for s in table["sets"] if s["match"]["code"] == code], []
  for s in (s for s in table["sets"] if s["match"]["code"] != code):
    m = s["match"]
    label = f"{s['size']} {m['camera'][0]}x{m['camera'][1]} {m['precision']} {m['device']} {m['isa']} {m['threads']} thread(s)"
    if m["device"] != "CPU" and not _can_run(m["device"], m["isa"]):
      log(f"[rekey] {label}: needs a {m['device']} {m['isa']} GPU to replay; left out, record it again on one")
      continue
    with tempfile.TemporaryDirectory(prefix="modeld-msm-rekey-") as td:
      models = write_models(Path(td) / "models", s["size"], s.get("seed", 0))
      if {k: sha256_file(v.path) for k, v in models.items()} != m["models"]:
        log(f"[rekey] {label}: recorded for other models than today's reference {s['size']} models; left out")
        continue
      candidate = {**s, "match": {**m, "code": code}}
      cand_path, db = Path(td) / "candidate.json", Path(td) / "search.db"
      write_atomic(cand_path, cpu_search.table_bytes({"format": cpu_search.FORMAT, "sets": [candidate]}))
      out = Path(td) / "artifact"
      paths = {"vision": str(models["vision"].path), "policy": str(models["policy"].path)}
      child = ("from compile.build import compile_artifact; "
               f"compile_artifact('driving', {paths!r}, {tuple(m['camera'])!r}, {m['device']!r}, "
               f"{str(out)!r}, precision={m['precision']!r}, layout={'on' if m['layout'] else 'off'!r}, search='auto', log=lambda *_: None)")
      env = {**os.environ, "CACHEDB": str(db), "NUM_CPU_THREADS": str(m["threads"]), "MODELD_CPU_PARTS": "parallel",
             cpu_search.TABLE_ENV: str(cand_path)}
      env.pop("BEAM", None)
      log(f"[rekey] {label}: compiling with the set installed")
      subprocess.run([sys.executable, "-c", child], check=True, env=env, cwd=REPO)
      used = verify_artifact(out).meta["search"]
      found = export(db, s["beam"])
    if not used["used"]:
      log(f"[rekey] {label}: the compile did not use the set ({used['why']}); left out")
    elif {e["ast"] for e in found} != {e["ast"] for e in s["entries"]}:
      log(f"[rekey] {label}: {len(found) - len(s['entries'])} kernel(s) differ from the recorded ones; left out, record it again")
    else:
      log(f"[rekey] {label}: all {len(s['entries'])} kernels were cache hits; carried over")
      carried.append(candidate)
  cpu_search.write_table({**table, "sets": kept + carried}, table_path)
  return len(carried)


def _can_run(device: str, isa: str) -> bool:
  try:
    return cpu_search.device_isa(device) == isa
  except Exception:   # tinygrad raises whatever its interfaces raise where that GPU is absent
    return False


def main() -> int:
  ap = argparse.ArgumentParser(description="record, tune or re-key the shipped CPU kernel search for the reference models")
  ap.add_argument("cmd", choices=("record", "tune", "rekey"))
  ap.add_argument("--size", default="full")
  ap.add_argument("--camera", default="1928x1208")
  ap.add_argument("--beam", type=int, default=1)
  ap.add_argument("--precision", default="auto", help="auto: fp32 on a CPU, fp16 on a GPU (as compile)")
  ap.add_argument("--layout", default="auto")
  ap.add_argument("--device", default="CPU", help="record: CPU, or a workstation GPU (CUDA, NV, AMD) this machine has")
  ap.add_argument("--top", type=int, default=12, help="tune: how many of the step's slowest kernels to re-search")
  ap.add_argument("--new", action="store_true", help="tune: with no recorded set, start one from tinygrad's heuristic opts")
  a = ap.parse_args()
  if a.cmd == "rekey":
    print(f"{rekey()} set(s) carried over to the current kernel code in {TABLE}")
  elif a.cmd == "tune":
    r = tune(a.size, parse_camera(a.camera), a.precision, a.layout, a.top, new=a.new)
    print(f"{tuned_count(r)} kernels of the set differ from its search ({a.top} re-searched this pass) in {TABLE}")
  else:
    r = record(a.size, parse_camera(a.camera), a.beam, a.precision, a.layout, device=a.device)
    print(f"recorded {len(r['entries'])} kernels into {TABLE}")
  return 0


if __name__ == "__main__":
  run_tool(main)
