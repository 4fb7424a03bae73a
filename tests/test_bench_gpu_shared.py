"""bench/bench_gpu_shared.py follows the a630 estimates it is given (bench_a630's --json) and says so; a file that is not
that JSON is one line and a non-zero exit, nothing written."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def bench(*args):
  return subprocess.run([sys.executable, "bench/bench_gpu_shared.py", "--seconds", "1", "--phases", "1", *map(str, args)],
                        cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_bench_follows_the_estimates_and_models_both_ui_rates_and_camera_phases(tmp_path):
  est = tmp_path / "a630.json"
  est.write_text(json.dumps({"models": {"driving": {"ms": 12.0, "dispatches": 40}, "dmonitoring": {"ms": 6.0, "dispatches": 20}}}))
  r = bench("--a630-json", est, "--json", tmp_path / "rows.json")
  assert r.returncode == 0, r.stderr
  assert "modeld: 40 dispatches, 12.00 ms" in r.stdout and "dmonitoringmodeld: 20 dispatches, 6.00 ms" in r.stdout
  rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
  assert {(x["ui_hz"], x["phase"]) for x in rows} == {(60.0, "in phase"), (60.0, "DM half a frame later"), (20.0, "in phase"),
                                                       (20.0, "DM half a frame later")}
  shipped = [x for x in rows if x["policy"].startswith("after:") and x["phase"] == "in phase"]
  free = [x for x in rows if x["policy"].startswith("before:") and x["phase"] == "in phase"]
  assert len(shipped) == len(free) == 2
  for s, f in zip(shipped, free):   # yielding: modeld closer to its time alone, the DM pays
    assert s["modeld"]["p99_ms"] < f["modeld"]["p99_ms"] and s["dmonitoringmodeld"]["p50_ms"] > f["dmonitoringmodeld"]["p50_ms"]


def test_a_file_that_is_not_bench_a630s_json_is_one_line(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps({"models": {"driving": {"ms": 12.0}}}))
  r = bench("--a630-json", bad, "--json", tmp_path / "rows.json")
  assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "bench_a630" in r.stderr
  assert not (tmp_path / "rows.json").exists()


def test_bench_a630s_executed_dispatches_are_played_as_they_are(tmp_path):
  est = tmp_path / "a630.json"
  frame = [3000.0] + [225.0] * 40   # 12 ms: one long convolution, then short kernels, in ring order
  est.write_text(json.dumps({"models": {"driving": {"ms": 12.0, "dispatches": 41, "dispatch_us": frame},
                                        # a list that is not this frame's (19 of 20 dispatches): spread as before
                                        "dmonitoring": {"ms": 6.0, "dispatches": 20, "dispatch_us": [300.0] * 19}}}))
  r = bench("--a630-json", est)
  assert r.returncode == 0, r.stderr
  assert "driving's executed dispatches, dmonitoring spread" in r.stdout
  assert "modeld: 41 dispatches, 12.00 ms of a630 time per frame (largest 3.00 ms)" in r.stdout
  # the what-if frame times scale the same sequence
  r = bench("--a630-json", est, "--frame-ms", "6", "3")
  assert r.returncode == 0 and "modeld: 41 dispatches, 6.00 ms of a630 time per frame (largest 1.50 ms)" in r.stdout, r.stdout + r.stderr
