"""Bad input through the real CLI: the tools refuse with one line and exit 2, and never destroy what they were not asked to.

Each case runs `modeld-msm` in a subprocess, as a user would, and checks the exit status, that stderr holds no traceback,
and what is left on disk.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli


def _tree(d: Path) -> dict[str, str]:
  return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def _refused(r, *words: str) -> str:
  err = r.stderr.strip()
  assert r.returncode == 2, (r.returncode, r.stdout[-2000:], err[-2000:])
  assert "Traceback" not in err and len(err.splitlines()) == 1, err
  for w in words:
    assert w in err, (w, err)
  return err


@pytest.fixture
def victim(tiny_models, tmp_path) -> Path:
  """A user's folder: the two models and a notes file."""
  d = tmp_path / "victim"
  d.mkdir()
  for name in ("driving_vision.onnx", "driving_policy.onnx"):
    shutil.copy(tiny_models / name, d / name)
  (d / "notes.txt").write_text("my notes\n")
  return d


@pytest.mark.parametrize("command", ["compile", "release"])
def test_output_folder_holding_the_inputs_is_never_replaced(victim, command):
  before = _tree(victim)
  extra = ["--camera", "1928x1208"] + (["--device", "CPU", "--smoke-frames", "0"] if command == "release" else ["--device", "CPU"])
  r = run_cli(command, "--vision", victim / "driving_vision.onnx", "--policy", victim / "driving_policy.onnx", *extra, "-o", victim)
  _refused(r, str(victim), "-o")
  assert _tree(victim) == before


@pytest.mark.parametrize("command", ["compile", "release"])
def test_output_folder_of_someone_elses_files_is_never_replaced(tiny_models, tmp_path, command):
  """Not the inputs, but not ours either: a folder with a notes file and a JSON that is not our manifest."""
  d = tmp_path / "theirs"
  d.mkdir()
  (d / "notes.txt").write_text("keep me\n")
  (d / "manifest.json").write_text('{"files": {}}')    # some other tool's manifest: no "format"
  (d / "bundle.json").write_text('["not", "ours"]')
  before = _tree(d)
  extra = ["--device", "CPU", "--camera", "1928x1208"] + (["--smoke-frames", "0"] if command == "release" else [])
  r = run_cli(command, "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx", *extra, "-o", d)
  _refused(r, "not empty", "-o")
  assert _tree(d) == before


def test_output_folder_that_is_a_file(tiny_models, tmp_path):
  f = tmp_path / "out"
  f.write_text("a file")
  r = run_cli("compile", "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx",
              "--device", "CPU", "-o", f)
  _refused(r, "not a folder")
  assert f.read_text() == "a file"


def test_an_artifact_of_ours_and_an_empty_folder_are_replaceable(cpu_artifact_1928, tmp_path):
  from selfdrive_glue.errors import UserError
  from selfdrive_glue.files import check_replaceable
  markers = {"manifest.json": "format"}
  check_replaceable(cpu_artifact_1928, markers, "artifact")        # ours: no error
  (tmp_path / "empty").mkdir()
  check_replaceable(tmp_path / "empty", markers, "artifact")
  check_replaceable(tmp_path / "absent", markers, "artifact")
  os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
  with pytest.raises(UserError, match="not a folder"):
    check_replaceable(tmp_path / "dangling", markers, "artifact")


def _under_a_file_size_limit(tmp_path, *args: str):
  """`modeld-msm ARGS` under a 20 KB file-size limit (a full disk): tinygrad can open no device, its caches unwritable."""
  import resource
  import signal
  import subprocess
  import sys

  def limited() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, 20 * 1024))
  env = {**os.environ, "CACHEDB": str(tmp_path / "cache.db"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
  env.pop("DEV", None)
  return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], capture_output=True, text=True, timeout=300,
                        cwd=Path(__file__).resolve().parents[1], env=env, preexec_fn=limited)


@pytest.mark.parametrize("command", ["replay", "compile"])
def test_a_commands_help_opens_no_device(tmp_path, command):
  """The command modules load no model code (tinygrad.nn.onnx opens its default device at import): --help works even
  where no device can be opened."""
  r = _under_a_file_size_limit(tmp_path, command, "--help")
  assert r.returncode == 0 and "usage:" in r.stdout, r.stderr


def test_no_device_while_compiling_is_one_line(tmp_path, tiny_models):
  """Under a file-size limit tinygrad opens no device once the compile loads the models: one line, exit 2, nothing written."""
  r = _under_a_file_size_limit(tmp_path, "compile", "--vision", tiny_models / "driving_vision.onnx", "--policy",
                               tiny_models / "driving_policy.onnx", "-o", tmp_path / "out")
  _refused(r, "tinygrad could open no device", "free space")
  assert not (tmp_path / "out").exists()


def test_output_into_a_closed_pipe_is_a_quiet_stop(cpu_artifact_1928):
  """`modeld-msm verify ART | head -1`: the reader leaves; no traceback, the exit status a shell gives a SIGPIPE'd tool."""
  import subprocess
  import sys
  r, w = os.pipe()
  os.close(r)   # the reader is gone before the first line is written
  try:
    p = subprocess.run([sys.executable, "-m", "cli.main", "verify", str(cpu_artifact_1928)], stdout=w, stderr=subprocess.PIPE, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[1])
  finally:
    os.close(w)
  assert p.returncode == 141 and p.stderr == "", (p.returncode, p.stderr[-2000:])
