"""testing/tinygrad_suites.py, without tinygrad's source (CI cannot fetch it): its pytest plugin refuses a run that would not
execute on the emulated a630, the junit results are read per test, and failures meet their verdicts or count unexplained."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "testing"))
import tinygrad_suites as ts  # noqa: E402

ONE_TEST = "def test_one():\n  assert 1 + 1 == 2\n"


def _pytest(tmp_path, env_extra, source=ONE_TEST):
  """pytest with the plugin over one test file of `source`."""
  (tmp_path / "test_one.py").write_text(source)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "testing"), str(REPO)]), **env_extra}
  return subprocess.run([sys.executable, "-m", "pytest", "-p", "tinygrad_emu_plugin", "-p", "no:cacheprovider", "-q", "test_one.py"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_the_plugin_refuses_a_run_that_would_not_execute_on_the_emulator(tmp_path):
  r = _pytest(tmp_path, {"DEV": "CPU"})
  assert r.returncode == 3 and "not QCOM on the executing emulator" in r.stdout + r.stderr, r.stdout + r.stderr
  r = _pytest(tmp_path, {"DEV": "EMU+QCOM:IR3", "EMU_EXEC": "0"})
  assert r.returncode == 3, r.stdout + r.stderr


def test_the_plugin_runs_tests_on_the_executing_emulator_and_counts_its_work(tmp_path):
  stats = tmp_path / "stats.json"
  r = _pytest(tmp_path, {"DEV": "EMU+QCOM:IR3", "EMU_EXEC": "1", "TG_SUITE_STATS": str(stats)},
              "from tinygrad import Tensor\ndef test_add():\n  assert (Tensor([1.0, 2.0]) + 1).tolist() == [2.0, 3.0]\n")
  assert r.returncode == 0, r.stdout + r.stderr
  s = json.loads(stats.read_text())
  assert s["dispatches"] >= 1 and s["fiber_instrs"] > 0 and s["faults"] == 0, s


def test_junit_cases_meet_their_verdicts(tmp_path):
  (tmp_path / "test" / "backend").mkdir(parents=True)
  (tmp_path / "test" / "__init__.py").write_text("")
  (tmp_path / "test" / "backend" / "__init__.py").write_text("")
  (tmp_path / "test" / "backend" / "test_ops.py").write_text(
    "import unittest\nclass TestOps(unittest.TestCase):\n  def test_sin(self): self.fail('forward pass failed')\n"
    "  def test_add(self): pass\n  def test_new(self): self.fail('boom')\n  @unittest.skip('no')\n  def test_skip(self): pass\n")
  xml = tmp_path / "j.xml"
  subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test/backend/test_ops.py", f"--junitxml={xml}",
                  "-o", "junit_family=xunit1"], cwd=tmp_path, capture_output=True, timeout=120)
  cases = {c.test: c for c in ts.read_junit(xml)}
  assert {t: c.outcome for t, c in cases.items()} == {
    "test/backend/test_ops.py::TestOps::test_sin": "failed", "test/backend/test_ops.py::TestOps::test_add": "passed",
    "test/backend/test_ops.py::TestOps::test_new": "failed", "test/backend/test_ops.py::TestOps::test_skip": "skipped"}
  assert "forward pass failed" in cases["test/backend/test_ops.py::TestOps::test_sin"].message
  verdicts = ts.load_verdicts(ts.VERDICTS)
  assert ts.verdict_for("test_ops", cases["test/backend/test_ops.py::TestOps::test_sin"], verdicts)["verdict"] == "compiler"
  assert ts.verdict_for("test_ops", cases["test/backend/test_ops.py::TestOps::test_new"], verdicts) is None
  assert all(v["verdict"] in ("compiler", "renderer", "interface", "hardware", "test", "emulator") and v["why"] for v in verdicts)


def test_a_folder_that_is_not_tinygrad_source_is_refused(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    ts.main(["--tinygrad-src", str(tmp_path)])
  assert e.value.code == 2 and "is not a tinygrad source checkout" in capsys.readouterr().err
