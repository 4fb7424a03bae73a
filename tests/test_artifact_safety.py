"""Artifacts that cannot run code: a pickle carrying a payload, sealed with a manifest rewritten to match, is refused by
name by every command that loads artifacts, and the payload never runs; signed bundles and a configured public key.

The payloads are real (`os.system` creating a marker file): test_artifact.py's control shows such a plant runs under plain
pickle. Here a marker's absence after the refusal is the proof that nothing ran.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clone_artifact, rewrite_file, stop_process

from artifact.format import MANIFEST, METADATA, ArtifactError, verify_artifact
from artifact.jit_pickle import ALLOWLIST, PickleRefused, allowed_classes, unpickle_programs
from artifact.kinds import POLICY_PKL, WARP_PKL
from artifact.load import load_programs

pytestmark = pytest.mark.xdist_group("cpu_artifact_1928")


def _str(s: str) -> bytes:
  b = s.encode()
  return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _global_call(module: str, name: str, arg: str) -> bytes:
  """A protocol-4 pickle of `module.name(arg)`: what a hand-edited artifact would carry."""
  return b"\x80\x04" + _str(module) + _str(name) + b"\x93" + _str(arg) + b"\x85R."  # STACK_GLOBAL, TUPLE1, REDUCE, STOP


def _reseal(d: Path) -> None:
  m = json.loads((d / MANIFEST).read_text())
  m["files"] = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in m["files"]}
  rewrite_file(d / MANIFEST, json.dumps(m).encode())


def _payloads(marker: Path) -> dict[str, bytes]:
  cmd = f"touch {marker}"
  return {
    "os.system": _global_call("os", "system", cmd),
    "posix.system": _global_call("posix", "system", cmd),
    "builtins.eval": _global_call("builtins", "eval", f"__import__('os').system({cmd!r})"),
    "subprocess.getoutput": _global_call("subprocess", "getoutput", cmd),
    # protocol 4 resolves dotted names attribute by attribute: a walk from an allowed class to os
    "dotted walk from an allowed class": _global_call("tinygrad.tensor", "Tensor.__init__.__globals__.os.system", cmd),
    # a real JIT with a payload appended where the unpickler meets it first
    "payload before a real jit": b"",
  }


@pytest.fixture
def tampered(cpu_artifact_1928, tmp_path):
  """-> make(case): a clone whose policy pickle carries the case's payload, the manifest rewritten to match; and the marker."""
  marker = tmp_path / "PAYLOAD_RAN"

  def make(case: str) -> Path:
    d = clone_artifact(cpu_artifact_1928, tmp_path / case.replace(" ", "_"))
    payload = _payloads(marker)[case]
    if not payload:  # a tuple (payload, jit): the payload is constructed first
      jit = (d / POLICY_PKL).read_bytes()
      payload = pickle.dumps((_Plant(str(marker)), _Raw(jit)))
    rewrite_file(d / POLICY_PKL, payload)
    _reseal(d)
    verify_artifact(d, device="CPU", camera=(1928, 1208))  # integrity passes: the manifest matches the tampered files
    return d
  return make, marker


class _Plant:
  def __init__(self, marker: str):
    self.marker = marker

  def __reduce__(self):
    return os.system, (f"touch {self.marker}",)


class _Raw:
  """Pickles as the already-pickled bytes of a real object (spliced in without its PROTO/STOP framing)."""

  def __init__(self, data: bytes):
    self.data = data

  def __reduce__(self):
    return pickle.loads, (self.data,)


@pytest.mark.parametrize("case", list(_payloads(Path("x"))))
def test_tampered_pickle_refused_by_name_and_payload_never_runs(case, tampered):
  make, marker = tampered
  d = make(case)
  with pytest.raises(ArtifactError) as e:
    load_programs(verify_artifact(d))
  msg = str(e.value)
  assert POLICY_PKL in msg and "asks for" in msg and "\n" not in msg and "compile" in msg, msg
  named = {"payload before a real jit": "posix.system", "dotted walk from an allowed class": "Tensor.__init__.__globals__"}.get(case, case)
  assert named in msg, msg
  assert not marker.exists(), f"{case}: the payload ran"


def test_allowlisted_classes_that_are_not_a_jit_are_refused():
  with pytest.raises(PickleRefused, match="holds a bytearray, not a TinyJit"):
    unpickle_programs(pickle.dumps(bytearray(b"abc")), names=("x.pkl",))
  with pytest.raises(PickleRefused, match="x.pkl is not a loadable TinyJit"):
    unpickle_programs(b"\x80\x04garbage", names=("x.pkl",))


def test_enum_members_pickle_by_value_whatever_the_python(monkeypatch):
  """Debian bookworm's Python 3.11.2 (an aarch64 build box's) reduces IntEnum members, tinygrad's Ops among them, to
  builtins.getattr(Ops, 'NAME'): the loader rightly refuses getattr, so such an artifact could not be loaded anywhere.
  The compile's pickler writes every enum member by value instead, as other Pythons do; here that Python is imitated."""
  from tinygrad import Tensor, TinyJit
  from tinygrad.uop import Ops

  from artifact.jit_pickle import pickle_programs
  @TinyJit
  def f(x):
    return (x * 2 + 1).realize()
  for _ in range(3):
    f(Tensor.rand(16).realize())
  monkeypatch.setattr(Ops, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self._name_)))
  assert b"getattr" in pickle.dumps(Ops.BUFFER, 4)   # the imitation holds
  blob, = pickle_programs(f)
  assert b"getattr" not in blob
  jit, = unpickle_programs(blob, names=("f.pkl",))
  x = Tensor.rand(16).realize()
  assert (jit(x).numpy() == x.numpy() * 2 + 1).all()


def test_allowlist_is_exactly_what_a_real_artifact_needs(cpu_artifact_1928):
  """The list is data reviewed like code: no entry a real artifact does not use, none missing."""
  import io

  from artifact.jit_pickle import _JitUnpickler
  asked: set[str] = set()

  class Recording(_JitUnpickler):
    def find_class(self, module, name):
      asked.add(f"{module}.{name}")
      return super().find_class(module, name)
  fresh: dict = {}
  for name in (POLICY_PKL, WARP_PKL):
    Recording(io.BytesIO((cpu_artifact_1928 / name).read_bytes()), fresh, name).load()
  assert asked == set(allowed_classes()), f"unused: {set(allowed_classes()) - asked}, missing: {asked - set(allowed_classes())}"
  assert all(why for why in json.loads(ALLOWLIST.read_text())["classes"].values())


def test_compile_reload_check_uses_the_restricted_unpickler(tmp_path):
  from compile.build import reload_programs
  marker = tmp_path / "PAYLOAD_RAN"
  bad = _global_call("os", "system", f"touch {marker}")
  with pytest.raises(PickleRefused, match=r"os\.system"):
    reload_programs({"driving_policy.pkl": bad, "driving_warp.pkl": bad})
  assert not marker.exists()


def _camera_server():
  from selfdrive_glue.nv12 import nv12_info
  from selfdrive_glue.visionipc import VisionIpcServer, VisionStreamType
  nv = nv12_info(1928, 1208)
  srv = VisionIpcServer("camerad")
  for stream in (VisionStreamType.ROAD, VisionStreamType.WIDE_ROAD):
    srv.create_buffers_with_sizes(stream, 2, 1928, 1208, nv.size, nv.stride, nv.uv_offset)
  srv.start_listener()
  return srv


def test_serve_refuses_tampered_artifact(tampered, prefix):
  make, marker = tampered
  d = make("os.system")
  srv = _camera_server()
  p = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--artifact", str(d), "--no-realtime"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
  try:
    rc = p.wait(120)
  finally:
    out = stop_process(p)
    srv.close()
  assert rc == 2 and "os.system" in out and "Traceback" not in out, out
  assert not marker.exists()


def test_replay_refuses_tampered_artifact(tampered, tmp_path, cli):
  from selfdrive_glue.synth import synth_segment
  make, marker = tampered
  d = make("os.system")
  seg = tmp_path / "00000001--abcdef0123--0"
  synth_segment(seg, 0.25, 5, "1928x1208", progress=False, qcamera=False)
  r = cli("replay", seg, "--artifact", d, "-o", tmp_path / "out", "--quiet")
  assert r.returncode == 2 and "os.system" in r.stderr and "Traceback" not in r.stderr, r.stderr
  assert not marker.exists()
  assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half-written


# ---- signatures ----

@pytest.fixture
def keys(tmp_path, cli):
  r = cli("keygen", "-o", tmp_path / "keys")
  assert r.returncode == 0, r.stderr
  r2 = cli("keygen", "-o", tmp_path / "keys", "--name", "other")
  assert r2.returncode == 0, r2.stderr
  k = tmp_path / "keys"
  assert (k / "modeld-msm.key").stat().st_mode & 0o777 == 0o600
  return k / "modeld-msm.key", k / "modeld-msm.pub", k / "other.pub"


def test_keygen_refuses_to_replace_a_key(keys, cli):
  priv, _, _ = keys
  before = priv.read_bytes()
  r = cli("keygen", "-o", priv.parent)
  assert r.returncode == 2 and "refusing" in r.stderr and priv.read_bytes() == before


def test_signed_bundle_accepted_and_refused_as_configured(keys, cpu_artifact_1928, tmp_path, cli):
  priv, pub, other = keys
  bundle = tmp_path / "bundle"
  bundle.mkdir()
  art = clone_artifact(cpu_artifact_1928, bundle / "1928x1208")
  # unsigned, with a configured key: refused by verify (flag and environment) and by serve before any camera wait
  for how in (("--pubkey", pub), ()):
    r = cli("verify", art, *how, env={"MODELD_PUBKEY": str(pub)} if not how else None)
    assert r.returncode == 2 and "not signed" in r.stderr and r.stderr.count("\n") == 1, r.stderr
  r = cli("serve", "--artifact", art, "--no-realtime", timeout=60, env={"MODELD_PUBKEY": str(pub)})
  assert r.returncode == 2 and "not signed" in r.stderr, r.stderr
  # no key configured: unsigned is fine, and verify says the signature was not checked
  r = cli("verify", art, env={"MODELD_PUBKEY": ""})
  assert r.returncode == 0 and "signature not checked" in r.stdout
  # sign the bundle: the right key accepts it, another key refuses it
  r = cli("sign", bundle, "--key", priv)
  assert r.returncode == 0 and "signed by key" in r.stdout, r.stderr
  r = cli("verify", art, "--pubkey", pub)
  assert r.returncode == 0 and "signed by key" in r.stdout, r.stderr
  r = cli("verify", art, "--pubkey", other)
  assert r.returncode == 2 and "not by the configured key" in r.stderr
  # tampered after signing, manifest rewritten to match: integrity passes, the signature does not
  rewrite_file(art / WARP_PKL, _global_call("os", "system", f"touch {tmp_path / 'RAN'}"))
  _reseal(art)
  assert cli("verify", art).returncode == 0
  r = cli("verify", art, "--pubkey", pub)
  assert r.returncode == 2 and "does not match its manifest" in r.stderr, r.stderr
  # signing refuses an artifact whose files do not match its manifest
  m = json.loads((art / MANIFEST).read_text())
  m["files"][METADATA] = "0" * 64
  rewrite_file(art / MANIFEST, json.dumps(m).encode())
  r = cli("sign", art, "--key", priv)
  assert r.returncode == 2 and "checksum" in r.stderr


def test_signature_file_edits_are_refused(keys, cpu_artifact_1928, tmp_path):
  from artifact.signing import SIGNATURE, SignatureError, sign_artifact
  priv, pub, _ = keys
  art = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  sign_artifact(art, priv, MANIFEST)
  assert verify_artifact(art, pubkey=pub).signed_by
  good = (art / SIGNATURE).read_text()
  lines = good.splitlines()
  sig = bytearray(bytes.fromhex(lines[1].split()[1]))
  sig[5] ^= 1
  for bad in (f"{lines[0]}\nsig {sig.hex()}\n", f"{lines[0]}\n", "garbage", ""):
    (art / SIGNATURE).write_text(bad)
    with pytest.raises(SignatureError):
      verify_artifact(art, pubkey=pub)
  shutil.copy(pub, tmp_path / "bad.pub")
  (tmp_path / "bad.pub").write_text("ed25519 abcd\n")
  with pytest.raises(SignatureError, match="not a modeld-msm public key"):
    verify_artifact(art, pubkey=tmp_path / "bad.pub")


@pytest.mark.slow
def test_release_build_signs_every_artifact(tiny_models, keys, tmp_path):
  from release.build import main
  priv, pub, _ = keys
  out = tmp_path / "rel"
  rc = main(["--vision", str(tiny_models / "driving_vision.onnx"), "--policy", str(tiny_models / "driving_policy.onnx"),
             "--device", "CPU", "--camera", "1344x760", "-o", str(out), "--sign-key", str(priv)])
  assert rc == 0
  assert verify_artifact(out / "1344x760", pubkey=pub).signed_by
  assert json.loads((out / "bundle.json").read_text())["artifacts"]["1344x760"]["signed_by"]


def test_release_build_checks_the_key_before_compiling(tiny_models, tmp_path, capsys):
  from release.build import main
  bad = tmp_path / "not-a-key"
  bad.write_bytes(struct.pack("<I", 7))
  rc = main(["--vision", str(tiny_models / "driving_vision.onnx"), "--policy", str(tiny_models / "driving_policy.onnx"),
             "--device", "CPU", "--camera", "1344x760", "-o", str(tmp_path / "rel"), "--sign-key", str(bad)])
  assert rc == 2 and "not an unencrypted PEM private key" in capsys.readouterr().err
  assert not (tmp_path / "rel").exists()
