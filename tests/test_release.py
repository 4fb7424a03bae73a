"""The release build: both camera sizes compiled, verified and bundled; serve picks by camera size."""
import json
import subprocess
import sys

import pytest

from artifact.format import ArtifactError, resolve_artifact, verify_artifact


@pytest.mark.slow
def test_bundle_both_cameras_and_both_models(tiny_models, dm_model, tmp_path):
  """Both camera sizes, the driving pair's artifacts and the driver-monitoring ones; smoke checks all four; install puts
  both processes into an openpilot-shaped tree and uninstall restores it byte for byte."""
  out = tmp_path / "artifacts"
  r = subprocess.run([sys.executable, "-m", "release.build", "--vision", tiny_models / "driving_vision.onnx", "--policy",
                      tiny_models / "driving_policy.onnx", "--dmonitoring", dm_model, "--device", "CPU", "-o", out],
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr
  bundle = json.loads((out / "bundle.json").read_text())
  assert set(bundle["artifacts"]) == set(bundle["dmonitoring"]) == {"1928x1208", "1344x760"} and bundle["device"] == "CPU"
  for cam, size in (("1928x1208", (1928, 1208)), ("1344x760", (1344, 760))):
    art = resolve_artifact(out, size)
    assert art == out / cam
    assert verify_artifact(art, device="CPU", camera=size).camera == size
    assert bundle["artifacts"][cam]["smoke"]["outputs"] == 90 and bundle["artifacts"][cam]["provenance"]["camera"] == cam
    dm = resolve_artifact(out, size, "dmonitoringmodeld")
    assert dm == out / "dmonitoring" / cam and verify_artifact(dm, camera=size, process="dmonitoringmodeld").kind == "dmonitoring"
    assert bundle["dmonitoring"][cam]["smoke"]["outputs"] == 20 and "dmonitoring vs onnxruntime" in bundle["dmonitoring"][cam]["checks"]
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".artifacts")]   # no temp dirs left
  table = [ln.split() for ln in r.stdout.splitlines()]
  assert ["camera", "target", "seconds", "size", "checks"] in table and sum(ln[:2] == ["dmonitoring", "1344x760"] for ln in table) == 1
  r = subprocess.run([sys.executable, "-m", "cli.main", "smoke", "--bundle", out], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "verdict: PASS: 4 of 4 artifact(s)" in r.stdout and "dmonitoring 1344x760: PASS" in r.stdout, r.stdout + r.stderr

  from release.install import install, uninstall
  from tests.test_install import load_table, make_openpilot, tree_state
  op = make_openpilot(tmp_path / "openpilot")
  before = tree_state(op)
  assert install(op, out, allow_cpu=True, log=lambda *_: None) == "installed"
  procs = load_table(op)
  assert procs["modeld"][1] == ["third_party/modeld_msm", ["./modeld"]]
  assert procs["dmonitoringmodeld"][:3] == ["NativeProcess", ["third_party/modeld_msm", ["./dmonitoringmodeld"]], "driverview"]
  assert uninstall(op, log=lambda *_: None) == "removed" and tree_state(op) == before

  # a driver-monitoring smoke file that changed after the build: the bundle is refused, naming it
  (out / "smoke" / "dmonitoring" / "1344x760" / "expected.npz").write_bytes(b"x")
  r = subprocess.run([sys.executable, "-m", "cli.main", "smoke", "--bundle", out], capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and "smoke/dmonitoring/1344x760/expected.npz does not match the hash" in r.stderr, r.stdout + r.stderr


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
