"""The artifact is refused before anything is unpickled when it is tampered with, incomplete, or for another tinygrad,
device or camera; `modeld-msm verify` reports that with its exit status and one line.

"Before unpickling" is proven with planted pickles: an artifact whose .pkl files would create a marker directory when
unpickled, sealed with a consistent manifest. With any one defect it must be refused by the checks before loading (not by
the restricted unpickler behind them, test_artifact_safety.py) and the marker must not exist.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clone_artifact, rewrite_file

from artifact.format import MANIFEST, METADATA, ArtifactError, verify_artifact
from artifact.kinds import POLICY_PKL, WARP_PKL
from artifact.load import load_programs
from modeld_msm.model_state import ModelState

pytestmark = pytest.mark.xdist_group("cpu_artifact_1928")
FILES = [MANIFEST, METADATA, POLICY_PKL, WARP_PKL]


def _sha(p: Path) -> str:
  return hashlib.sha256(p.read_bytes()).hexdigest()


def _reseal(d: Path) -> None:
  """Rewrite the manifest so it matches the files it lists, as someone editing the artifact consistently would."""
  m = json.loads((d / MANIFEST).read_text())
  m["files"] = {name: _sha(d / name) for name in m["files"]}
  rewrite_file(d / MANIFEST, json.dumps(m).encode())


def _edit_meta(d: Path, fn) -> None:
  meta = json.loads((d / METADATA).read_text())
  fn(meta)
  rewrite_file(d / METADATA, json.dumps(meta).encode())
  _reseal(d)


def _flip(path: Path, where: str) -> None:
  data = bytearray(path.read_bytes())
  i = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}[where]
  data[i] ^= 0x01
  rewrite_file(path, bytes(data))


class _Plant:
  """Unpickling this runs os.mkdir(marker): what a malicious pickle could do, made visible."""

  def __init__(self, marker: Path):
    self.marker = marker

  def __reduce__(self):
    return os.mkdir, (str(self.marker),)


@pytest.fixture
def planted(cpu_artifact_1928, tmp_path) -> tuple[Path, list[Path]]:
  d = tmp_path / "planted"
  d.mkdir()
  shutil.copy(cpu_artifact_1928 / METADATA, d / METADATA)
  markers = [tmp_path / f"UNPICKLED_{name}" for name in (POLICY_PKL, WARP_PKL)]
  for name, marker in zip((POLICY_PKL, WARP_PKL), markers):
    (d / name).write_bytes(pickle.dumps(_Plant(marker)))
  (d / MANIFEST).write_text(json.dumps({"format": 1, "files": {n: _sha(d / n) for n in (METADATA, POLICY_PKL, WARP_PKL)}}))
  return d, markers


def _try_load(d: Path, **kw) -> Exception | None:
  try:
    ModelState(d, **kw)
  except Exception as e:  # noqa: BLE001 - the control case fails after unpickling; we only record what happened
    return e
  return None


def test_planted_control_payload_is_real(planted):
  """The plant runs under plain pickle, so its marker's absence below means something."""
  d, markers = planted
  verify_artifact(d, device="CPU", camera=(1928, 1208))
  pickle.loads((d / POLICY_PKL).read_bytes())
  assert markers[0].is_dir(), "the planted pickles must run when unpickled plainly, or the tests below prove nothing"


TAMPER = {
  **{f"flip_{name}_{where}": (lambda d, n=name, w=where: _flip(d / n, w)) for name in FILES for where in ("first", "middle", "last")},
  "extra_file": lambda d: (d / "extra.pkl").write_bytes(b"x"),
  "missing_warp": lambda d: (d / WARP_PKL).unlink(),
  "missing_metadata": lambda d: (d / METADATA).unlink(),
  "missing_manifest": lambda d: (d / MANIFEST).unlink(),
  "other_tinygrad": lambda d: _edit_meta(d, lambda m: m["versions"].update(tinygrad="0.13.0")),
  "no_tinymesa": lambda d: _edit_meta(d, lambda m: m["versions"].update(tinymesa=None)),
  "other_device": lambda d: _edit_meta(d, lambda m: m.update(device="QCOM", target="QCOM:IR3", load_target="QCOM:IR3")),
  "other_camera": lambda d: _edit_meta(d, lambda m: m["camera"].update(width=1344, height=760)),
  "policy_not_listed": lambda d: (lambda m: (m["files"].pop(POLICY_PKL), rewrite_file(d / MANIFEST, json.dumps(m).encode())))(
    json.loads((d / MANIFEST).read_text())),
}


@pytest.mark.parametrize("case", list(TAMPER))
def test_defective_artifact_refused_before_unpickling(case, planted):
  d, markers = planted
  TAMPER[case](d)
  err = _try_load(d, device="CPU", camera=(1928, 1208))
  assert isinstance(err, ArtifactError), f"{case}: got {err!r}"
  assert "asks for" not in str(err), f"{case}: passed the checks and was stopped only by the restricted unpickler: {err}"
  assert not any(m.exists() for m in markers), f"{case}: a pickle was unpickled before the artifact was refused"
  assert "\n" not in str(err) and "compile" in str(err)  # one line that says how to fix it (rebuild with `modeld-msm compile`)


@pytest.mark.parametrize("name", FILES)
def test_flipped_byte_in_real_artifact_is_refused(name, cpu_artifact_1928, tmp_path, cli, monkeypatch):
  d = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  _flip(d / name, "middle")
  with pytest.raises(ArtifactError, match=name.replace(".", r"\.") + "|corrupt|manifest"):
    verify_artifact(d)
  monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
  monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
  with pytest.raises(ArtifactError):
    ModelState(d)
  r = cli("verify", d)
  assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
  assert r.stderr.startswith("modeld-msm verify: error: ")
  verify_artifact(cpu_artifact_1928)  # the shared artifact is untouched


def test_file_swapped_after_verification_is_refused(cpu_artifact_1928, tmp_path):
  d = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  art = verify_artifact(d, device="CPU", camera=(1928, 1208))
  marker = tmp_path / "UNPICKLED"
  rewrite_file(d / WARP_PKL, pickle.dumps(_Plant(marker)))
  with pytest.raises(ArtifactError, match="changed after verification"):
    load_programs(art)
  assert not marker.exists()


def test_a_cpu_artifact_of_another_machine_type_is_refused_not_run(cpu_artifact_1928, tmp_path, cli):
  """Its programs are the build machine's code: an x86_64 artifact loaded on the car (aarch64) died of an illegal instruction
  (testing/aarch64_car.sh). A QCOM artifact holds a630 code, wherever it was built, and is not affected."""
  import platform
  other = "aarch64" if platform.machine() != "aarch64" else "x86_64"
  d = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  _edit_meta(d, lambda m: m.update(host=other))
  with pytest.raises(ArtifactError, match=rf"holds {other} machine code .* this machine is {platform.machine()}"):
    verify_artifact(d)
  r = cli("verify", d)
  assert r.returncode == 2 and "compile one here" in r.stderr and r.stderr.count("\n") == 1


def test_a_cpu_artifact_using_an_extension_this_cpu_lacks_is_refused(cpu_artifact_1928, tmp_path, cli):
  """-march=native code from a CPU with more extensions (AVX-512 on the build box, AVX2 here) would stop at an illegal
  instruction: verify names what is missing instead. The artifact as built here verifies (its flags are this CPU's)."""
  from artifact.cpu_info import cpu_info
  meta = verify_artifact(cpu_artifact_1928).meta
  assert set(meta["build_cpu"]["flags"]) <= cpu_info().flags and meta["build_cpu"]["model"] == cpu_info().model
  d = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  _edit_meta(d, lambda m: m["build_cpu"].update(flags=[*m["build_cpu"]["flags"], "avx1024_imaginary"]))
  with pytest.raises(ArtifactError, match="may use avx1024_imaginary, which this CPU .* lacks"):
    verify_artifact(d)
  r = cli("verify", d)
  assert r.returncode == 2 and "illegal instruction" in r.stderr and r.stderr.count("\n") == 1


def test_version_mismatch_names_both_versions(cpu_artifact_1928, tmp_path, cli):
  from importlib.metadata import version
  d = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  _edit_meta(d, lambda m: m["versions"].update(tinygrad="0.13.0"))
  with pytest.raises(ArtifactError, match=rf"tinygrad 0\.13\.0, this install has {version('tinygrad')}"):
    verify_artifact(d)
  r = cli("verify", d)
  assert r.returncode == 2 and "0.13.0" in r.stderr and r.stderr.count("\n") == 1


def test_wrong_device_and_camera_are_refused(cpu_artifact_1928, cli):
  with pytest.raises(ArtifactError, match="for device CPU .*not QCOM.*--device QCOM"):
    verify_artifact(cpu_artifact_1928, device="QCOM")
  with pytest.raises(ArtifactError, match="camera 1928x1208, the stream is 1344x760.*--camera 1344x760"):
    verify_artifact(cpu_artifact_1928, camera=(1344, 760))
  for args, word in ((("--device", "QCOM"), "QCOM"), (("--camera", "1344x760"), "1344x760")):
    r = cli("verify", cpu_artifact_1928, *args)
    assert r.returncode == 2 and word in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_verify_cli_exit_codes(cpu_artifact_1928, tmp_path, cli):
  good = cli("verify", cpu_artifact_1928)
  assert good.returncode == 0 and good.stderr == "" and "OK" in good.stdout
  for bad in (tmp_path / "does-not-exist", tmp_path):  # missing; an empty directory (no manifest)
    r = cli("verify", bad)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(bad) in r.stderr
  d = clone_artifact(cpu_artifact_1928, tmp_path / "extra")
  (d / "notes.txt").write_text("hi")
  r = cli("verify", d)
  assert r.returncode == 2 and "notes.txt" in r.stderr


def test_verify_never_imports_tinygrad_or_unpickles(cpu_artifact_1928, cli):
  """verify is what the car runs before loading: it must stay a JSON + hash check."""
  code = ("import sys, pickle; pickle.loads = pickle.load = None; from artifact.format import verify_artifact; "
          f"verify_artifact({str(cpu_artifact_1928)!r}); print(sorted(m for m in sys.modules if m.split('.')[0] in ('tinygrad', 'onnx')))")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == "[]"


_CAPTURE = """
import pickle, sys
from tinygrad import Tensor, TinyJit
w = Tensor.ones(4).contiguous().realize()
jit = TinyJit(lambda x: (x + w).realize())
for i in range(3):
  jit(Tensor.full((4,), 10.0 * i).contiguous().realize())
open(sys.argv[1], "wb").write(pickle.dumps(jit))
"""
_LOAD = """
import pickle, sys
from tinygrad import Tensor
from artifact.jit_pickle import unpickle_programs
z = Tensor.ones(4).contiguous().realize()  # this process's own tensor, made exactly like the capture's weight
data = open(sys.argv[1], "rb").read()
jit = pickle.loads(data) if sys.argv[2] == "plain" else unpickle_programs(data)[0]
z.assign(Tensor.full((4,), 100.0)).realize()  # must not touch the loaded JIT's weight
print(jit(Tensor([1.0, 2.0, 3.0, 4.0]).contiguous().realize()).numpy().tolist(), z.numpy().tolist())
"""


def test_unpickled_jit_gets_its_own_buffers(tmp_path):
  """tinygrad issue #15682 in two real processes: a JIT pickled in one and loaded in another, next to tensors of that
  process, must compute x + 1 -- with plain pickle it reads or clobbers the wrong buffers."""
  blob = tmp_path / "jit.pkl"
  r = subprocess.run([sys.executable, "-c", _CAPTURE, blob], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  results = {}
  for mode in ("fresh", "plain"):
    r = subprocess.run([sys.executable, "-c", _LOAD, blob, mode], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr
    results[mode] = r.stdout.strip()
  assert results["fresh"] == "[2.0, 3.0, 4.0, 5.0] [100.0, 100.0, 100.0, 100.0]"
  assert results["plain"] != results["fresh"], "plain pickle no longer collides: tinygrad fixed #15682, unpickle_programs may go"
