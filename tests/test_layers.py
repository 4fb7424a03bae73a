"""Layers point down, with no import cycles. Read from the source (every import, also inside functions), so a lazy import
cannot hide an upward edge or a cycle; and checked in a fresh interpreter for what the car's process actually loads."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# top to bottom; a package imports itself and the floors below it, never its own floor's neighbours or anything above
FLOORS = (
  ("cli",),                          # the modeld-msm command
  ("bench", "testing"),              # benchmarks; test tools (fuzzers, the mutation pass, sweeps, fault matrix, soak)
  ("release", "offcar"),             # the release build and install; replay, regress, demo, training
  ("compile",),                      # ONNX -> artifact
  ("modeld_msm",),                   # the car runtime: the model processes
  ("artifact",),                     # the loader: verify, unpickle under the allowlist, run on the CPU device
  ("backend", "selfdrive_glue"),     # tinygrad's QCOM kernel interfaces; openpilot's messaging, cameras, logs
)
FLOOR = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}


def module_name(path: Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
  return {module_name(p): p for pkg in FLOOR for p in sorted((ROOT / pkg).rglob("*.py"))}


def project_imports(path: Path, known: set[str]) -> list[tuple[str, int]]:
  """(module imported, line) for every import of a project module in the file; `from pkg import sub` names pkg.sub."""
  def resolve(name: str) -> str | None:
    while name and name not in known:
      name = name.rpartition(".")[0]
    return name or None
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]
    else:
      continue
    found += [(m, node.lineno) for n in names if (m := resolve(n)) is not None]
  return found


def graph() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
  mods = modules()
  edges: dict[str, dict[str, int]] = {m: {} for m in mods}
  for m, p in mods.items():
    for t, line in project_imports(p, set(mods)):
      if t != m and not m.startswith(t + "."):   # a module's own packages run first anyway
        edges[m].setdefault(t, line)
  return mods, edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan, iterative)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on: set[str] = set()
  out = []
  for root in edges:
    if root in index:
      continue
    work = [(root, iter(edges[root]))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on.add(root)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on.add(w)
          work.append((w, iter(edges[w])))
        elif w in on:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          x = stack.pop()
          on.discard(x)
          comp.append(x)
          if x == v:
            break
        if len(comp) > 1:
          out.append(sorted(comp))
  return out


def test_every_import_points_down():
  mods, edges = graph()
  wrong = []
  for m, targets in edges.items():
    a = m.split(".")[0]
    for t, line in targets.items():
      b = t.split(".")[0]
      if a != b and FLOOR[b] <= FLOOR[a]:
        where = "above it" if FLOOR[b] < FLOOR[a] else "on its own floor"
        wrong.append(f"{mods[m].relative_to(ROOT)}:{line} imports {t} ({b} is {where})")
  assert not wrong, "\n".join(wrong)


def test_no_module_is_part_of_an_import_cycle():
  _, edges = graph()
  found = cycles(edges)
  assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_the_scan_sees_lazy_imports_and_cycles(tmp_path):
  f = tmp_path / "m.py"
  f.write_text("import os\ndef f():\n  from modeld_msm.constants import DT_MDL\n  import compile.build\n  from artifact import load\n")
  known = {"modeld_msm.constants", "compile", "compile.build", "artifact", "artifact.load"}
  assert project_imports(f, known) == [("modeld_msm.constants", 3), ("compile.build", 4), ("artifact.load", 5)]
  assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
  assert cycles({"a": {"b": 1}, "b": {}}) == []


# what only the tools need: the car's install does not have them (or must not pay for them on every start)
NOT_ON_THE_CAR = ("cli", "bench", "testing", "release", "offcar", "compile", "onnx", "onnxruntime", "tinygrad.nn.onnx", "matplotlib", "ray",
                  "torch", "tinymesa", "av")


@pytest.mark.parametrize("entry", ["modeld_msm.modeld", "modeld_msm.dmonitoringmodeld", "modeld_msm.runner", "modeld_msm.model_state",
                                   "modeld_msm.dm_core"])
def test_the_car_runtime_loads_no_tool(entry):
  code = f"import json, sys; import {entry}; print(json.dumps(sorted(sys.modules)))"
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  loaded = json.loads(r.stdout)
  bad = sorted(m for m in loaded if any(m == t or m.startswith(t + ".") for t in NOT_ON_THE_CAR))
  assert not bad, f"importing {entry} loads {bad}"
  assert "tinygrad" in loaded or entry == "modeld_msm.runner"   # the check sees real imports (model_state needs tinygrad)
