"""A mutation pass over core modules: plant one plausible one-token bug at a time and see whether the tests notice.

  python testing/mutation_pass.py [--per-module N] [--seed S] [--only MODULE] [--list]

The mutants are not picked by hand (hand-picked mutants are the ones the tests were written for): every comparison,
arithmetic operator, boolean operator and numeric constant in a module is a mutation point (`<` <-> `<=`, `>` <-> `>=`,
`==` <-> `!=`, `+` <-> `-`, `*` -> `/`, `and` <-> `or`, an integer n -> n + 1, a float x -> 1.5 x; 0.0 becomes 1.0), and N
of them per module are drawn with a generator seeded by (seed, module), so a module's draw is the same whichever other
modules run with it; an N above a module's count of points takes them all. Each mutant is written into a copy of the
working tree and the module's tests run there (`-m "not slow"`, stopping at the first failure); a mutant is killed when
they fail or time out. Prints a table per module, the surviving mutants (line, what changed) and the kill rate.
"""
from __future__ import annotations

import argparse
import ast
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from artifact.cpu_info import cpu_info

REPO = Path(__file__).resolve().parents[1]

# module -> the tests that own its behaviour
TARGETS = {
  "offcar/replay.py": ["tests/test_replay.py"],
  "offcar/frame_map.py": ["tests/test_replay.py"],
  "modeld_msm/parse_outputs.py": ["tests/test_parse_outputs.py"],
  "modeld_msm/actions.py": ["tests/test_actions.py"],
  "modeld_msm/fill_msg.py": ["tests/test_fill_msg.py"],
  "selfdrive_glue/desire_helper.py": ["tests/test_desire_helper.py"],
  "selfdrive_glue/msgq.py": ["tests/test_msgq.py", "tests/test_ipc_golden.py"],
  "selfdrive_glue/camera.py": ["tests/test_camera_geometry.py"],
  "backend/chunking.py": ["tests/test_backend_chunking.py"],
  "backend/msm.py": ["tests/test_backend_qcom.py", "tests/test_emu_kernel_rules.py"],
  "release/install.py": ["tests/test_install_table.py", "tests/test_hostile_install.py", "tests/test_install.py"],
  "selfdrive_glue/files.py": ["tests/test_bad_input_cli.py", "tests/test_artifact.py"],
  # issue 40: the checks of message values, the DM's parse, the combined model's runtime parse, install's bundle reading,
  # signatures, and the emulator's command stream
  "modeld_msm/inputs_check.py": ["tests/test_inputs_check.py"],
  # the DM's parse against hand-computed values (test_dmonitoring.py compiles the DM per run and checks the parse through itself)
  "modeld_msm/dm_outputs.py": ["tests/test_dm_outputs.py"],
  "compile/runtime_parse.py": ["tests/test_runtime_parse.py", "tests/test_supercombo_model.py"],
  "release/bundle.py": ["tests/test_hostile_install.py", "tests/test_install.py"],
  "artifact/signing.py": ["tests/test_hostile_install.py", "tests/test_bad_input_install.py"],
  "backend/emu/pm4.py": ["tests/test_emu_pm4.py", "tests/test_backend_emu.py"],
  "backend/emu/iova.py": ["tests/test_emu_iova.py", "tests/test_backend_emu.py"],
}

SWAP_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
SWAP_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.FloorDiv: ast.Mult, ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr}


@dataclass
class Mutant:
  module: str
  index: int        # the mutation point's place in an ast.walk of the module
  line: int
  what: str
  annotation: bool = False   # inside a type annotation: never evaluated (the modules use `from __future__ import annotations`)


def _bumped(v: int | float) -> int | float:
  """n -> n + 1; x -> 1.5 x, and 0.0 -> 1.0 (1.5 * 0.0 would be the same program: an equivalent mutant, not a bug)."""
  return v + 1 if isinstance(v, int) else (v * 1.5 if v else 1.0)


def _points(tree: ast.AST) -> list[tuple[int, ast.AST, str]]:
  """(walk index, node, description) for every mutation point; docstrings and f-string parts are left alone."""
  out = []
  for i, node in enumerate(ast.walk(tree)):
    if isinstance(node, ast.Compare) and type(node.ops[0]) in SWAP_CMP:
      out.append((i, node, f"{type(node.ops[0]).__name__} -> {SWAP_CMP[type(node.ops[0])].__name__}"))
    elif isinstance(node, ast.BinOp) and type(node.op) in SWAP_BIN:
      out.append((i, node, f"{type(node.op).__name__} -> {SWAP_BIN[type(node.op)].__name__}"))
    elif isinstance(node, ast.BoolOp):
      out.append((i, node, f"{type(node.op).__name__} -> {'Or' if isinstance(node.op, ast.And) else 'And'}"))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float) and not isinstance(node.value, bool):
      out.append((i, node, f"{node.value!r} -> {_bumped(node.value)!r}"))
  return out


def _parents_in_fstring(tree: ast.AST) -> set[int]:
  inside = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.JoinedStr):
      inside.update(id(n) for n in ast.walk(node))
  return inside


def _in_annotations(tree: ast.Module) -> set[int]:
  """Nodes inside annotations, where the module postpones their evaluation (PEP 563); none otherwise."""
  inside: set[int] = set()
  if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names) for n in tree.body):
    return inside
  for node in ast.walk(tree):
    if isinstance(node, ast.arg | ast.AnnAssign | ast.FunctionDef | ast.AsyncFunctionDef):
      ann = node.returns if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else node.annotation
      if ann is not None:
        inside.update(id(n) for n in ast.walk(ann))
  return inside


def mutants_of(module: str, per_module: int, rng: random.Random) -> list[Mutant]:
  """N points drawn from all of them; those inside annotations stay in the draw (so adding the rule kept earlier draws)
  and are reported as equivalent without a test run."""
  tree = ast.parse((REPO / module).read_text())
  skip, ann = _parents_in_fstring(tree), _in_annotations(tree)
  pts = [(i, n, w) for i, n, w in _points(tree) if id(n) not in skip]
  picked = sorted(rng.sample(pts, min(per_module, len(pts))), key=lambda p: p[0])
  return [Mutant(module, i, getattr(n, "lineno", 0), w, id(n) in ann) for i, n, w in picked]


def mutated_source(m: Mutant) -> str:
  tree = ast.parse((REPO / m.module).read_text())
  for i, node in enumerate(ast.walk(tree)):
    if i != m.index:
      continue
    if isinstance(node, ast.Compare):
      node.ops[0] = SWAP_CMP[type(node.ops[0])]()
    elif isinstance(node, ast.BinOp):
      node.op = SWAP_BIN[type(node.op)]()
    elif isinstance(node, ast.BoolOp):
      node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif isinstance(node, ast.Constant):
      node.value = _bumped(node.value)
    break
  return ast.unparse(tree) + "\n"


def _copy_tree(dst: Path) -> None:
  files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
  for f in files:
    src = REPO / f
    if src.is_file():
      (dst / f).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, dst / f)


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[str, float]:
  t0 = time.perf_counter()
  try:
    r = subprocess.run([sys.executable, "-m", "pytest", *tests, "-x", "-q", "-m", "not slow", "-p", "no:cacheprovider", "-o", "addopts="],
                       cwd=tree, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return "killed (timeout)", time.perf_counter() - t0
  if r.returncode == 0:
    return "survived", time.perf_counter() - t0
  if r.returncode in (1, 3):   # tests failed / an internal error the mutant caused (e.g. an import-time crash)
    return "killed", time.perf_counter() - t0
  return f"error (pytest exit {r.returncode})", time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--per-module", type=int, default=4)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--only", help="only modules whose path contains one of these (comma-separated)")
  ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's test run (default 600)")
  ap.add_argument("--list", action="store_true", help="list the drawn mutants and exit")
  a = ap.parse_args(argv)
  only = a.only.split(",") if a.only else None
  modules = [mod for mod in TARGETS if only is None or any(w in mod for w in only)]
  mutants = [m for mod in modules for m in mutants_of(mod, a.per_module, random.Random(f"{a.seed}:{mod}"))]
  if a.list:
    for m in mutants:
      print(f"{m.module}:{m.line}  {m.what}{'  (annotation)' if m.annotation else ''}")
    return 0
  work = Path(tempfile.mkdtemp(prefix="mutation-pass-"))
  results: list[tuple[Mutant, str, float]] = []
  t0 = time.perf_counter()
  try:
    _copy_tree(work)
    for k, m in enumerate(mutants, 1):
      if m.annotation:
        results.append((m, "equivalent", 0.0))
        print(f"[{k:3d}/{len(mutants)}] equivalent (annotation) {m.module}:{m.line}  {m.what}", file=sys.stderr, flush=True)
        continue
      original = (work / m.module).read_text()
      (work / m.module).write_text(mutated_source(m))
      try:
        verdict, dt = run_tests(work, TARGETS[m.module], a.timeout)
      finally:
        (work / m.module).write_text(original)
      results.append((m, verdict, dt))
      eta = (time.perf_counter() - t0) / k * (len(mutants) - k)
      print(f"[{k:3d}/{len(mutants)} ETA {eta:5.0f} s] {verdict:18s} {m.module}:{m.line}  {m.what}  ({dt:.0f} s)", file=sys.stderr, flush=True)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  print("\n| module | mutants | in annotations | killed | survived |\n| --- | --- | --- | --- | --- |")
  for mod in dict.fromkeys(m.module for m, _, _ in results):
    rs = [v for m, v, _ in results if m.module == mod]
    print(f"| {mod} | {len(rs)} | {rs.count('equivalent')} | {sum(v.startswith('killed') for v in rs)} | {rs.count('survived')} |")
  killed = sum(v.startswith("killed") for _, v, _ in results)
  counted = sum(v.startswith("killed") or v == "survived" for _, v, _ in results)
  for m, v, _ in results:
    if not v.startswith("killed") and v != "equivalent":
      print(f"  {v}: {m.module}:{m.line}  {m.what}")
  print(f"\nkill rate {killed}/{counted} (annotations left out) = {100 * killed / max(counted, 1):.0f} % (seed {a.seed}, "
        f"{a.per_module} per module, {time.perf_counter() - t0:.0f} s)\nCPU: {cpu_info().summary()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
