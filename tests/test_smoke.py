"""The release build's recorded smoke test and `modeld-msm smoke`, on a CPU bundle of the tiny models.

The bundle is built once per module by the release build itself (`python -m release.build`'s main, in this process),
with the compile step standing in: it hard-links the session's CPU artifact instead of compiling again (~30 s), so the
release code that runs is the real one (verify, smoke recording through ModelState, provenance, bundle.json, table).
The QCOM bundle on the emulated a630 is under `slow`.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import clone_artifact, rewrite_file, run_cli

from release.smoke import EXPECTED_FILE, META_FILE

pytestmark = pytest.mark.xdist_group("cpu_artifact_1928")
CAM = "1928x1208"


def _stand_in_compile(artifact: Path):
  from compile.report import CompileReport

  def compile_artifact(kind, models, camera, device, out_dir, log=print, precision="auto"):
    clone_artifact(artifact, Path(out_dir))
    report = CompileReport(Path(out_dir))
    report.checks = [tuple(c) for c in json.loads((artifact / "metadata.json").read_text())["validation"]["checks"]]
    return report
  return compile_artifact


@pytest.fixture(scope="module")
def cpu_bundle(tiny_models, cpu_artifact_1928, tmp_path_factory):
  """(bundle dir, what the release build printed)."""
  from release import build
  out = tmp_path_factory.mktemp("cpu_bundle") / "bundle"
  mp, printed = pytest.MonkeyPatch(), io.StringIO()
  try:
    mp.setattr(build, "compile_artifact", _stand_in_compile(cpu_artifact_1928))
    with contextlib.redirect_stdout(printed):
      rc = build.main(["--vision", str(tiny_models / "driving_vision.onnx"), "--policy", str(tiny_models / "driving_policy.onnx"),
                       "--device", "CPU", "--camera", CAM, "-o", str(out)])
  finally:
    mp.undo()
  assert rc == 0, printed.getvalue()
  return out, printed.getvalue()


def _copy(bundle: Path, dst: Path) -> Path:
  """A copy to tamper with: artifacts hard-linked (replace their files with rewrite_file), the rest copied."""
  dst.mkdir()
  for p in bundle.iterdir():
    if (p / "manifest.json").exists():
      clone_artifact(p, dst / p.name)
    elif p.is_dir():
      shutil.copytree(p, dst / p.name)
    else:
      shutil.copy(p, dst / p.name)
  return dst


def test_release_records_smoke_data_provenance_and_a_summary(cpu_bundle, tiny_models):
  bundle, printed = cpu_bundle
  index = json.loads((bundle / "bundle.json").read_text())
  e = index["artifacts"][CAM]
  prov = e["provenance"]
  for kind in ("vision", "policy"):
    assert prov["models"][kind]["sha256"] == hashlib.sha256((tiny_models / f"driving_{kind}.onnx").read_bytes()).hexdigest()
  assert prov["target"] == "CPU" and prov["camera"] == CAM and prov["versions"]["tinygrad"] == "0.14.0"
  assert "pickle reload" in prov["checks_passed"] and "smoke recorded (100 frames)" in e["checks"]
  assert index["build"]["python"] and "tinygrad_env" in index["build"]
  assert e["size_bytes"] == sum(p.stat().st_size for p in (bundle / CAM).iterdir())
  smoke = bundle / "smoke" / CAM
  assert set(e["smoke"]["files"]) == {p.name for p in smoke.iterdir()}
  assert e["smoke"]["frames"] == 100 and e["smoke"]["outputs"] == 90   # every 10th frame dropped (warp only)
  assert sum(p.stat().st_size for p in smoke.iterdir()) < 2_000_000   # 4 compressed frame pairs + 90 output vectors
  meta = json.loads((smoke / META_FILE).read_text())
  assert meta["producer"]["device"] == "CPU" and meta["tolerance"] == {"rtol": 1e-5, "atol": 1e-5}
  # progress lines with elapsed time, then the summary table
  assert "s] [release] 1/1 1928x1208 on CPU" in printed and "smoke frame 100/100" in printed
  header, rule, row = printed.split("\n\n")[1].splitlines()[:3]
  assert header.split() == ["camera", "target", "seconds", "size", "checks"] and set(rule) == {"-"}
  assert row.split()[:2] == [CAM, "CPU"] and "MB" in row and "8 passed" in row   # 7 compile checks (runtime parse included) + smoke


def test_smoke_passes_on_the_bundle_it_was_recorded_from(cpu_bundle):
  r = run_cli("smoke", "--bundle", cpu_bundle[0])
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"{CAM}: PASS  100 frames (90 outputs) on CPU" in r.stdout and "max |diff| 0" in r.stdout
  assert "[ok  ] tinygrad" in r.stdout and r.stdout.strip().splitlines()[-1].startswith("verdict: PASS")


def _tamper_expected(bundle: Path, frame_pos: int, index: int, delta: float, fix_hash: bool) -> None:
  f = bundle / "smoke" / CAM / EXPECTED_FILE
  with np.load(f) as z:
    raw, frames = z["raw"].copy(), z["frame"]
  raw[frame_pos, index] += delta
  b = io.BytesIO()
  np.savez_compressed(b, raw=raw, frame=frames)
  f.write_bytes(b.getvalue())
  if fix_hash:   # as if the build itself had recorded a wrong expectation
    idx = json.loads((bundle / "bundle.json").read_text())
    idx["artifacts"][CAM]["smoke"]["files"][EXPECTED_FILE] = hashlib.sha256(b.getvalue()).hexdigest()
    (bundle / "bundle.json").write_text(json.dumps(idx))


def _raw_index(bundle: Path, kind: str, name: str) -> int:
  """Where output slice `name` of `kind` starts in the raw outputs (vision ++ policy)."""
  meta = json.loads((bundle / CAM / "metadata.json").read_text())
  width = sum(int(np.prod(s)) for s in meta["models"]["vision"]["output_shapes"].values())
  return (width if kind == "policy" else 0) + meta["models"][kind]["output_slices"][name][0]


def test_a_wrong_expectation_fails_naming_the_output(cpu_bundle, tmp_path):
  b = _copy(cpu_bundle[0], tmp_path / "b")
  raw_index = _raw_index(b, "policy", "plan")
  _tamper_expected(b, 3, raw_index + 5, 0.5, fix_hash=True)   # 4th output = frame 3 (frames 9, 19, ... are dropped)
  r = run_cli("smoke", "--bundle", b, "--skip-doctor")
  assert r.returncode == 1, r.stdout + r.stderr
  assert f"{CAM}: FAIL at frame 3: first diverging output is policy 'plan'[5]" in r.stdout
  assert "verdict: FAIL (1928x1208)" in r.stdout


def test_modified_smoke_data_is_refused(cpu_bundle, tmp_path):
  b = _copy(cpu_bundle[0], tmp_path / "b")
  _tamper_expected(b, 0, 0, 1.0, fix_hash=False)
  r = run_cli("smoke", "--bundle", b)
  assert r.returncode == 2 and f"smoke file smoke/{CAM}/{EXPECTED_FILE} does not match the hash in bundle.json" in r.stderr, r.stderr


def test_corrupted_artifact_is_refused_naming_the_file(cpu_bundle, tmp_path):
  b = _copy(cpu_bundle[0], tmp_path / "b")
  pkl = b / CAM / "driving_policy.pkl"
  data = bytearray(pkl.read_bytes())
  data[len(data) // 2] ^= 0xFF
  rewrite_file(pkl, bytes(data))
  r = run_cli("smoke", "--bundle", b)
  assert r.returncode == 2 and "driving_policy.pkl does not match its manifest checksum" in r.stderr, r.stderr


def test_a_gpu_computing_wrong_numbers_fails_naming_the_output(cpu_bundle, monkeypatch):
  """What a device whose GPU miscomputes looks like: the artifact verifies and loads, one output drifts at frame 12."""
  from artifact.format import verify_artifact
  from modeld_msm.model_state import ModelState
  from release import smoke
  bundle = cpu_bundle[0]
  raw_index = _raw_index(bundle, "vision", "lead")
  run, calls = ModelState.run, []

  def drifting(self, *a, **kw):
    out, raw = run(self, *a, **kw)
    calls.append(1)
    if raw is not None and len(calls) == 13:
      raw[raw_index + 2] += 1e-3
    return out, raw
  monkeypatch.setattr(ModelState, "run", drifting)
  from tinygrad.helpers import DEV
  old = DEV.value
  try:
    res = smoke.check(verify_artifact(bundle / CAM), bundle / "smoke" / CAM, frames=20)
  finally:
    DEV.value = old
  assert not res.ok and res.frames == 13
  assert res.mismatch is not None and res.mismatch.startswith("at frame 12: first diverging output is vision 'lead'[2]"), res.mismatch


def test_smoke_refuses_what_it_cannot_check(cpu_bundle, tmp_path):
  r = run_cli("smoke", "--bundle", cpu_bundle[0], "--emu")
  assert r.returncode == 2 and "is a CPU bundle, run it without --emu" in r.stderr
  r = run_cli("smoke", "--bundle", cpu_bundle[0] / CAM)
  assert r.returncode == 2 and "no bundle.json (a single artifact)" in r.stderr
  r = run_cli("smoke", "--bundle", cpu_bundle[0], "--camera", "1344x760")
  assert r.returncode == 2 and "has no artifact for camera 1344x760" in r.stderr
  b = _copy(cpu_bundle[0], tmp_path / "b")
  idx = json.loads((b / "bundle.json").read_text())
  del idx["artifacts"][CAM]["smoke"]
  (b / "bundle.json").write_text(json.dumps(idx))
  r = run_cli("smoke", "--bundle", b)
  assert r.returncode == 2 and "carries no smoke data" in r.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("qcom_artifact")
def test_qcom_bundle_smoke_on_the_emulated_a630(tiny_models, qcom_artifact, tmp_path):
  """A QCOM bundle's expectation is recorded by the emulator executing the IR3 program; `smoke --emu` replays it there.
  The compile step stands in (the session's QCOM artifact), run in a subprocess so the emulated device opens as in a
  release build. 20 frames keep it to minutes."""
  import subprocess
  import sys
  out = tmp_path / "bundle"
  code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_smoke, compile.build as cb; from pathlib import Path; "
          f"cb.compile_artifact = test_smoke._stand_in_compile(Path({str(qcom_artifact)!r})); from release import build; "
          f"sys.exit(build.main(sys.argv[1:]))")
  env = {**os.environ, "MODELD_DEV": "EMU+QCOM:IR3", "EMU_EXEC": "1"}
  r = subprocess.run([sys.executable, "-c", code, "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx",
                      "--device", "QCOM", "--camera", CAM, "--smoke-frames", "20", "-o", out], capture_output=True, text=True, timeout=900, env=env)
  assert r.returncode == 0, r.stdout + r.stderr
  meta = json.loads((out / "smoke" / CAM / META_FILE).read_text())
  assert meta["producer"]["executes"] and "level B" in meta["producer"]["what"] and meta["tolerance"] == {"rtol": 2e-2, "atol": 2e-2}
  r = run_cli("smoke", "--bundle", out, "--emu")
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"{CAM}: PASS  20 frames (18 outputs) on EMU+QCOM:IR3" in r.stdout and "IR3 execution" in r.stdout


def _set_meta(bundle: Path, **fields) -> None:
  """Edit smoke.json and record its new hash in bundle.json, as a forger would."""
  f = bundle / "smoke" / CAM / META_FILE
  meta = {**json.loads(f.read_text()), **fields}
  f.write_text(json.dumps(meta))
  idx = json.loads((bundle / "bundle.json").read_text())
  idx["artifacts"][CAM]["smoke"]["files"][META_FILE] = hashlib.sha256(f.read_bytes()).hexdigest()
  (bundle / "bundle.json").write_text(json.dumps(idx))


def test_the_device_tolerance_holds_whatever_smoke_json_says(cpu_bundle, tmp_path):
  """Issue 40.5: the tolerance was read from smoke.json, so wrong expectations with a tolerance of 1e9 passed."""
  from artifact.format import verify_artifact
  from release import smoke
  b = _copy(cpu_bundle[0], tmp_path / "b")
  _tamper_expected(b, 0, _raw_index(b, "policy", "plan"), 0.5, fix_hash=True)
  _set_meta(b, tolerance={"rtol": 1e9, "atol": 1e9})
  res = smoke.check(verify_artifact(b / CAM), b / "smoke" / CAM, frames=3)
  assert not res.ok and "policy 'plan'[0]" in (res.mismatch or ""), res


def test_a_signed_bundles_smoke_data_is_covered_by_the_signature(cpu_bundle, tmp_path):
  """Issue 40.5: expected outputs, inputs and smoke.json were vouched for only by the unsigned bundle.json."""
  from artifact.signing import SignatureError, generate_keypair
  from release.bundle import SMOKE_SIGNATURE, sign_bundle, verify_bundle
  priv, pub = generate_keypair(tmp_path / "keys")
  b = _copy(cpu_bundle[0], tmp_path / "b")
  with pytest.raises(SignatureError, match="smoke data .* is not signed"):   # an artifact signature alone is not enough
    from artifact.format import sign_tree
    sign_tree(b, priv)
    verify_bundle(b, pubkey=pub)
  sign_bundle(b, priv)
  assert (b / "smoke" / CAM / SMOKE_SIGNATURE).is_file()
  verify_bundle(b, pubkey=pub)
  _tamper_expected(b, 0, 0, 1.0, fix_hash=True)   # bundle.json's hash follows the edit; the signature cannot
  verify_bundle(b)   # unsigned use still trusts bundle.json
  with pytest.raises(SignatureError, match="does not match"):
    verify_bundle(b, pubkey=pub)
  r = run_cli("smoke", "--bundle", b, "--pubkey", pub, "--skip-doctor")
  assert r.returncode == 2 and "Traceback" not in r.stderr and "does not match" in r.stderr, r.stderr
