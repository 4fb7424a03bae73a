"""The release build: both camera sizes compiled, verified and bundled; serve picks by camera size."""
import json
import subprocess
import sys

import pytest

from artifact.format import ArtifactError, resolve_artifact, verify_artifact


@pytest.mark.slow
def test_bundle_both_cameras(tiny_models, tmp_path):
  out = tmp_path / "artifacts"
  r = subprocess.run([sys.executable, "-m", "release.build", "--vision", tiny_models / "driving_vision.onnx", "--policy",
                      tiny_models / "driving_policy.onnx", "--device", "CPU", "-o", out], capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr
  bundle = json.loads((out / "bundle.json").read_text())
  assert set(bundle["artifacts"]) == {"1928x1208", "1344x760"} and bundle["device"] == "CPU"
  for cam, size in (("1928x1208", (1928, 1208)), ("1344x760", (1344, 760))):
    art = resolve_artifact(out, size)
    assert art == out / cam
    assert verify_artifact(art, device="CPU", camera=size).camera == size
    assert bundle["artifacts"][cam]["smoke"]["outputs"] == 90 and bundle["artifacts"][cam]["provenance"]["camera"] == cam
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".artifacts")]   # no temp dirs left
  assert ["camera", "target", "seconds", "size", "checks"] in [ln.split() for ln in r.stdout.splitlines()]   # the summary table
  r = subprocess.run([sys.executable, "-m", "cli.main", "smoke", "--bundle", out], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "verdict: PASS: 2 of 2 camera size(s)" in r.stdout, r.stdout + r.stderr


def test_bad_model_leaves_no_bundle(tmp_path):
  bad = tmp_path / "v.onnx"
  bad.write_bytes(b"not an onnx file")
  out = tmp_path / "artifacts"
  r = subprocess.run([sys.executable, "-m", "release.build", "--vision", bad, "--policy", bad, "--device", "CPU", "-o", out],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and "not a readable ONNX file" in r.stderr and "Traceback" not in r.stderr
  assert not out.exists() and list(tmp_path.iterdir()) == [bad]


def test_resolve_reports_missing_camera(tmp_path):
  (tmp_path / "1928x1208").mkdir()
  with pytest.raises(ArtifactError, match="no artifact for camera 1344x760"):
    resolve_artifact(tmp_path, (1344, 760))
