"""Master's stateful model through the rest of the tool chain, as a user runs it: release (bundle contract `stateful`), smoke
on the bundle, replay of a synthetic segment through it, and install's dry run into master's package layout naming it."""
from __future__ import annotations

import json

import pytest
from conftest import run_cli
from test_install import make_prefixed_openpilot

pytestmark = pytest.mark.slow   # one CPU compile of the tiny stateful model and a 2 s replay


def test_stateful_model_releases_smokes_replays_and_installs(tmp_path):
  models, bundle = tmp_path / "models", tmp_path / "bundle"
  assert run_cli("models", "--kind", "stateful", "--stand-in", "-o", models, timeout=300).returncode == 0
  r = run_cli("release", "--model", models / "driving_supercombo.onnx", "--device", "CPU", "--camera", "1344x760", "--smoke-frames", "10",
              "-o", bundle, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  index = json.loads((bundle / "bundle.json").read_text())
  assert index["contract"] == "stateful" and list(index["artifacts"]) == ["1344x760"]
  assert "runtime parse" in index["artifacts"]["1344x760"]["checks"]
  s = run_cli("smoke", "--bundle", bundle, timeout=600)
  assert s.returncode == 0 and "1344x760: PASS" in s.stdout, s.stdout + s.stderr
  seg = tmp_path / "seg"
  assert run_cli("synth", "-o", seg, "--seconds", "2", "--camera", "1344x760", "--quiet", timeout=300).returncode == 0
  out = tmp_path / "replay" / "seg.zst"
  rp = run_cli("replay", seg, "--artifact", bundle / "1344x760", "-o", out.parent, "--quiet", timeout=600)
  assert rp.returncode == 0, rp.stderr[-3000:]
  acc = json.loads(out.with_name("seg.zst.accuracy.json").read_text())
  assert acc["frames"] >= 20, acc
  op = make_prefixed_openpilot(tmp_path / "op")
  d = run_cli("install", op, "--bundle", bundle, "--dry-run", "--allow-cpu", timeout=120)
  assert d.returncode == 0 and "master's stateful model" in d.stdout, d.stdout + d.stderr
