"""The bad-input sweep (testing/bad_input_sweep.py --quick) in CI: every command against the catalogue's cases that need no
compiled artifact; any traceback, hang, silent success, lost file or half-written output fails the suite."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow   # ~3-4 min: ~75 CLI runs, each a fresh interpreter
def test_quick_sweep_finds_no_defect():
  r = subprocess.run([sys.executable, "testing/bad_input_sweep.py", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
  table = r.stdout[r.stdout.find("| command |"):]
  assert r.returncode == 0, table + "\n" + r.stderr[-4000:]
  assert "| **all** |" in table and " 0 not " in r.stdout, table


def test_sweep_classifies_what_it_sees(tmp_path):
  """The classifier itself: a traceback, a silent success and a clear error are told apart (a sweep that calls everything
  clear would pass CI while finding nothing)."""
  sys.path.insert(0, str(ROOT / "testing"))
  try:
    import bad_input_sweep as sw
  finally:
    sys.path.pop(0)
  ws = sw.Workspace(tmp_path, quick=True)
  ws.scratch.mkdir(parents=True)
  verdicts = {}
  for name, argv, expect in (("bad camera", ["verify", tmp_path, "--camera", "abc"], "error"),
                             ("help", ["verify", "--help"], "error"),
                             ("ok", ["verify", "--help"], "ok")):
    verdicts[name] = sw.run_case(sw.Case(name, lambda ws, a=argv: a, expect=expect), ws).verdict
  assert verdicts == {"bad camera": "clear", "help": "silent", "ok": "ok"}
  crash = sw.Case("crash", lambda ws: ["verify", tmp_path])
  orig = sw._cli
  sw._cli = lambda *a: [sys.executable, "-c", "raise RuntimeError('boom')"]
  try:
    assert sw.run_case(crash, ws).verdict == "traceback"
  finally:
    sw._cli = orig
