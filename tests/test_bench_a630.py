"""bench/bench_a630.py: every dispatch of a frame summed, a band around it, and its JSON in the issue's shape."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(tmp_path, *args):
  out, rows = tmp_path / "a630.json", tmp_path / "dispatches.json"
  r = subprocess.run([sys.executable, "bench/bench_a630.py", "--size", "tiny", "--top", "5", "--json", str(out), "--dispatches", str(rows), *args],
                     cwd=ROOT, capture_output=True, text=True, timeout=1800)
  assert r.returncode == 0, r.stdout + r.stderr
  return r.stdout, json.loads(out.read_text()), json.loads(rows.read_text())


def _check(report, rows, kinds):
  assert set(report) == {"models", "calibration"} and set(report["models"]) == set(kinds)
  for kind, m in report["models"].items():
    assert set(m) == {"ms", "band_ms", "dispatches", "dispatch_us"}
    mine = [r for r in rows if r["kind"] == kind]
    assert m["dispatch_us"] == pytest.approx([r["us"] for r in mine], abs=1e-3)   # the frame in ring order, for bench_gpu_shared
    # the frame is every dispatch summed, repeats included (not one value per distinct kernel name)
    assert m["dispatches"] == len(mine) > 0
    assert m["ms"] == pytest.approx(sum(r["us"] for r in mine) / 1e3, abs=1e-3)
    per_name = {}
    for r in mine:
      per_name.setdefault(r["kernel"], r["us"])
    if len(per_name) < len(mine):
      assert m["ms"] > sum(per_name.values()) / 1e3
    lo, hi = m["band_ms"]
    assert lo < m["ms"] < hi
    assert {r["bound"] for r in mine} <= {"ALU", "DRAM", "TEX", "launch"}
  for c in report["calibration"]:
    assert set(c) == {"source", "measured_ms", "estimated_ms"} and c["measured_ms"] > 0 and c["estimated_ms"] > 0


@pytest.mark.xdist_group("qcom_artifact")
def test_driving_frame_adds_up(qcom_artifact, tmp_path):
  out, report, rows = _bench(tmp_path, "--kinds", "driving", "--driving", str(qcom_artifact), "--calibrate-against", "artifacts")
  _check(report, rows, ["driving"])
  assert "bound by:" in out and "machine:" in out
  assert "our artifacts, levers on (biased low)" in out and re.search(r"\n  driving +[\d.]+ +[\d.]+ .*<= 20 (met|missed)", out), out[-1500:]
  # the wait-for-idle lever: dispatches independent of those in flight, from the ranges level B saw each one touch; a
  # model is mostly a chain, so some but far from all
  m = re.search(r"wait-for-idle lever.*driving (\d+) of (\d+) dispatches independent", out)
  assert m and 0 < int(m[1]) < int(m[2]) == report["models"]["driving"]["dispatches"], out[-800:]


@pytest.mark.slow
def test_every_kind_at_tiny_size_adds_up(tmp_path):
  out, report, rows = _bench(tmp_path, "--work", str(tmp_path / "work"))
  _check(report, rows, ["driving", "supercombo", "stateful", "dmonitoring"])   # every kind of the registry
  assert len(report["calibration"]) == 3 and "not comparable" in report["calibration"][0]["source"]
  # the calibration is fitted on the measured programs' stand-ins: the calibrated kinds compiled again without our levers,
  # whose frames are not our artifacts' (the DM's stem is rewritten for images in ours, not in its baseline)
  assert "compiled the tiny baseline dmonitoring model" in out and "the kinds compiled without our levers" in out, out[-3000:]
  assert {c["source"].split(":")[0] for c in report["calibration"]} == {"tinygrad CI", "openpilot#38399"}
  base_dm = next(c for c in report["calibration"] if "driverStateV2" in c["source"])["estimated_ms"]
  assert base_dm != pytest.approx(report["models"]["dmonitoring"]["ms"], abs=1e-3)
  for kind in ("driving", "supercombo", "stateful", "dmonitoring"):
    assert re.search(rf"\n  {kind} +[\d.]+ +[\d.]+ ", out), out[-1500:]
  # the combined model is the pair fused: pruned like the pair's, its frame replays no constant weight re-layouts (unpruned,
  # the tiny one dispatched 127 against the pair's 95)
  m = report["models"]
  assert m["supercombo"]["dispatches"] <= m["driving"]["dispatches"] + 8
  assert m["stateful"]["dispatches"] <= m["driving"]["dispatches"] + 8   # pruned the same way (states read per frame)


@pytest.mark.slow
def test_another_camera_is_compiled_for_and_the_calibration_is_not(tmp_path):
  work = tmp_path / "work"
  out, report, rows = _bench(tmp_path, "--kinds", "dmonitoring", "--camera", "1344x760", "--work", str(work))
  _check(report, rows, ["dmonitoring"])
  assert "cameras: dmonitoring 1344x760" in out, out[:800]
  meta = json.loads((work / "dmonitoring-1344x760" / "metadata.json").read_text())
  assert (meta["camera"]["width"], meta["camera"]["height"]) == (1344, 760)
  base = json.loads((work / "baseline" / "dmonitoring" / "metadata.json").read_text())["camera"]
  assert (base["width"], base["height"]) == (1928, 1208)   # the figures it is fitted to stay those of 1928x1208 programs


def test_an_unknown_camera_is_one_line_and_exit_2(tmp_path):
  r = subprocess.run([sys.executable, "bench/bench_a630.py", "--camera", "640x480", "--work", str(tmp_path / "w")], cwd=ROOT,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "unsupported camera size '640x480'" in r.stderr.splitlines()[-1] and not (tmp_path / "w").exists()
