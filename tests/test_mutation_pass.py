"""The mutation pass's drawing of mutants (testing/mutation_pass.py), on a small module written here: which points exist,
which are left alone, which count as equivalent without a run, and that a module's draw does not depend on the others."""
from __future__ import annotations

import random

from testing import mutation_pass as mp

SOURCE = '''from __future__ import annotations

def f(a: int | None, b: float = 2.5) -> int | str:
  """a docstring < with a comparison in words"""
  x: list[int] | None = None
  return a + 1 if a < b and b else f"{a + 3}"
'''


def _module(tmp_path, source=SOURCE):
  p = tmp_path / "m.py"
  p.write_text(source)
  return str(p)   # REPO / an absolute path is that path


def test_points_annotations_and_fstrings(tmp_path):
  ms = mp.mutants_of(_module(tmp_path), 100, random.Random(0))
  got = sorted((m.line, m.what, m.annotation) for m in ms)
  assert got == sorted([
    (3, "BitOr -> BitAnd", True), (3, "BitOr -> BitAnd", True),   # a's annotation and the return annotation
    (3, "2.5 -> 3.75", False),
    (5, "BitOr -> BitAnd", True),
    (6, "Add -> Sub", False), (6, "1 -> 2", False), (6, "Lt -> LtE", False), (6, "And -> Or", False),
  ]), got   # nothing of the docstring or of the f-string
  # a module without postponed annotations evaluates them: the same points are then real mutants
  plain = mp.mutants_of(_module(tmp_path, SOURCE.replace("from __future__ import annotations\n", "")), 100, random.Random(0))
  assert not any(m.annotation for m in plain) and len(plain) == len(ms)


def test_mutated_source_changes_the_one_point(tmp_path):
  (m,) = [m for m in mp.mutants_of(_module(tmp_path), 100, random.Random(0)) if m.what == "Lt -> LtE"]
  out = mp.mutated_source(m)
  assert "a <= b" in out and "a + 1" in out and out.count("<=") == 1


def test_a_modules_draw_is_the_same_whoever_runs_with_it(capsys):
  def listed(only):
    mp.main(["--only", only, "--per-module", "3", "--seed", "5", "--list"])
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("backend/emu/iova.py")]
  alone = listed("emu/iova")
  assert len(alone) == 3 and listed("emu/pm4,emu/iova") == alone
