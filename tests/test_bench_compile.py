"""bench/bench_compile.py (and bench/bench_gpu.py, which runs its tinygrad worker on a GPU) compiles the reference pair
and times the artifact through the programs as modeld binds them: run end to end on the tiny models on the CPU."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_the_compile_bench_times_a_tiny_cpu_artifact(tmp_path):
  r = subprocess.run([sys.executable, "bench/bench_compile.py", "--size", "tiny", "--configs", "CPU@fp16", "--iters", "3",
                      "--json", str(tmp_path / "rows.json")], cwd=REPO, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-2000:]
  (row,) = json.loads((tmp_path / "rows.json").read_text())
  assert "error" not in row, row.get("error")
  assert row["precision"] == "fp16" and row["fused"]["p50"] > 0 and row["warp"]["p50"] > 0
  # the per-model TinyJits the bench times beside the artifact are checked against onnxruntime on the same inputs
  assert 0 <= row["maxdiff_vision"] < 0.1 and 0 <= row["maxdiff_policy"] < 0.1
