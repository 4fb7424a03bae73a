"""The car's base install: what `pip install modeld-msm` brings without extras is enough to verify, serve and report, and a
tool that needs an extra says which one. Checked with the extras' modules hidden from a child Python (the car has no
tinymesa at all: its wheel is x86_64 only; onnx, onnxruntime, av, matplotlib and ray are left out of the base install)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.xdist_group("cpu_artifact_1928")
EXTRAS_ONLY = ("tinymesa", "onnx", "onnxruntime", "av", "matplotlib", "ray", "torch")

_HIDE = '''
import os, sys
from importlib.abc import MetaPathFinder
HIDDEN = set(os.environ["HIDE_MODULES"].split(","))
class _Hidden(MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in HIDDEN:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Hidden())
import importlib.metadata as md
_version = md.version
def _version_unless_hidden(name):
  if name in HIDDEN:
    raise md.PackageNotFoundError(name)
  return _version(name)
md.version = _version_unless_hidden
if "tinymesa" in HIDDEN:   # tinygrad finds the Mesa library by path, not by import: as if the wheel were absent
  import tinygrad.runtime.support.c as c
  _find = c.DLL.findlib
  c.DLL.findlib = staticmethod(lambda nm, paths, extra_paths=[]: None if nm == "mesa" else _find(nm, paths, extra_paths))
'''


def _python_without(tmp_path, hidden: tuple[str, ...]):
  """Run `python -m cli.main ...` (or any module) as on a Python where the `hidden` distributions are not installed."""
  (tmp_path / "site").mkdir()
  (tmp_path / "site" / "sitecustomize.py").write_text(_HIDE)
  env = {**os.environ, "HIDE_MODULES": ",".join(hidden), "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"}

  def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  return run


@pytest.fixture
def car_python(tmp_path):
  """The car: only the base install."""
  return _python_without(tmp_path, EXTRAS_ONLY)


@pytest.fixture
def arm_build_python(tmp_path):
  """An aarch64 build box: the [build] extra installed, which there brings onnx and onnxruntime but no tinymesa."""
  return _python_without(tmp_path, ("tinymesa",))


def test_the_hiding_works(car_python):
  r = car_python("-c", "import onnx")
  assert r.returncode == 1 and "No module named 'onnx'" in r.stderr
  r = car_python("-c", "import tinygrad.runtime.autogen.mesa as m, tinygrad.runtime.support.c as c; print('mesa' in c.DLL._loaded_)")
  assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_the_car_commands_need_no_extra(car_python, cpu_artifact_1928):
  for args in (["-m", "cli.main", "verify", str(cpu_artifact_1928)], ["-m", "cli.main", "doctor", "--emu", "--rounds", "2"],
               ["-m", "cli.main", "serve", "--help"], ["-m", "modeld_msm.modeld", "--help"], ["-m", "cli.main", "install", "--help"],
               ["-m", "modeld_msm.dmonitoringmodeld", "--help"], ["-m", "cli.main", "serve-dm", "--help"],
               ["-m", "cli.main", "smoke", "--help"]):
    r = car_python(*args)
    assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stdout[-2000:], r.stderr[-2000:])
    if "doctor" in args:   # the car's doctor: no compiler is not a failure, and the node round trip runs
      assert "tinymesa" in r.stdout and "[build] extra" in r.stdout and "submit/fence" in r.stdout, r.stdout


def test_a_tool_names_the_extra_it_needs(car_python, tmp_path):
  r = car_python("-m", "cli.main", "models", "--size", "tiny", "-o", str(tmp_path / "m"))
  assert r.returncode == 2 and "[build] extra" in r.stderr and "pip install 'modeld-msm[build]'" in r.stderr, r.stderr
  assert "Traceback" not in r.stderr and not (tmp_path / "m").exists()
  r = car_python("-m", "cli.main", "synth", "-o", str(tmp_path / "seg"), "--seconds", "1")
  assert r.returncode == 2 and "[replay] extra" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_qcom_compile_without_the_ir3_compiler_is_refused(arm_build_python, tiny_models, tmp_path):
  """Where tinymesa cannot be installed (aarch64) the [build] extra still compiles CPU artifacts; a QCOM compile is refused
  in one line before any model is loaded, instead of tinygrad's traceback from the first kernel it tries to compile."""
  out = tmp_path / "q"
  r = arm_build_python("-m", "cli.main", "compile", "--vision", str(tiny_models / "driving_vision.onnx"),
                       "--policy", str(tiny_models / "driving_policy.onnx"), "--device", "QCOM", "-o", str(out))
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert "Mesa's IR3 compiler (the tinymesa wheel, x86_64 only) is not installed" in r.stderr and "loading models" not in r.stderr
  assert not out.exists() and not any(p.name.startswith(".q.") for p in tmp_path.iterdir())
