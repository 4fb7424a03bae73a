"""Issue 40, the release and install path as an attacker would use it: install copies only what the signed manifests and
bundle.json list and refuses links and names that leave the bundle; smoke's verdict rests only on what the signature
covers, at the device's tolerance; JSON from disk is checked by shape; a writer stopped by SIGTERM leaves nothing behind."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli
from test_install import make_bundle, make_openpilot, make_prefixed_openpilot, tree_state

from release.install import INSTALL_REL, install
from selfdrive_glue.errors import UserError


def quiet(*_a) -> None:
  pass


@pytest.fixture(params=["0.11", "master"])
def op(tmp_path, request) -> Path:
  """Both layouts: the rules hold in 0.11's root-level tree and in master's openpilot/ package alike."""
  return (make_openpilot if request.param == "0.11" else make_prefixed_openpilot)(tmp_path / "openpilot")


def _base(op: Path) -> Path:
  from release.install import check_openpilot
  return check_openpilot(op)


def _one_line_error(r) -> str:
  err = r.stderr.strip()
  assert r.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, (r.returncode, r.stdout[-2000:], err)
  return err


def _installed(op: Path) -> set[str]:
  d = _base(op) / INSTALL_REL / "artifacts"
  return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() or p.is_symlink()}


def test_install_copies_only_the_listed_files_and_never_follows_a_link(op, tmp_path):
  b = make_bundle(tmp_path / "b")
  listed = {p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file()}
  secret = tmp_path / "secret"
  secret.write_text("host secret\n")
  (b / "NOTES.txt").symlink_to(secret)               # /etc/shadow in the report
  (b / "etc").symlink_to(tmp_path, target_is_directory=True)   # a link to a folder walked the host's /etc
  (b / "stray.bin").write_bytes(b"\0" * 100_000)     # a stray big file was copied silently
  (b / "notes").mkdir()
  (b / "notes" / "x.txt").write_text("release notes")
  log: list[str] = []
  assert install(op, b, log=log.append) == "installed"
  assert _installed(op) == listed
  assert not any("host secret" in p.read_text(errors="replace") for p in (_base(op) / INSTALL_REL).rglob("*") if p.is_file())
  assert any("left out" in m for m in log), log


@pytest.mark.parametrize("where", ["artifact file", "artifact folder", "bundle.json", "DM artifact file", "DM folder"])
def test_a_listed_file_reached_through_a_link_is_refused(op, tmp_path, where):
  """Either process's artifacts: the driver-monitoring ones live one folder deeper (dmonitoring/<camera>/)."""
  b = make_bundle(tmp_path / "b", dm=("1928x1208",) if where.startswith("DM") else ())
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  target = {"artifact file": b / "1928x1208" / "metadata.json", "artifact folder": b / "1344x760", "bundle.json": b / "bundle.json",
            "DM artifact file": b / "dmonitoring" / "1928x1208" / "metadata.json", "DM folder": b / "dmonitoring"}[where]
  moved = elsewhere / target.name
  os.replace(target, moved)
  target.symlink_to(moved, target_is_directory=moved.is_dir())
  before = tree_state(op)
  err = _one_line_error(run_cli("install", op, "--bundle", b, "--allow-cpu"))
  assert "symbolic link" in err, err
  assert tree_state(op) == before


def _with_smoke(b: Path, names: dict[str, str]) -> None:
  idx = json.loads((b / "bundle.json").read_text())
  idx["artifacts"]["1928x1208"]["smoke"] = {"files": names}
  (b / "bundle.json").write_text(json.dumps(idx))


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd", "frames.nv12.zst\n\x1b[31mred"])
def test_smoke_file_names_that_leave_the_bundle_are_refused(tmp_path, name):
  from release.bundle import verify_bundle
  SMOKE_FILES = ("frames.nv12.zst", "inputs.npz", "expected.npz", "smoke.json")
  b = make_bundle(tmp_path / "b")
  names = {n: "0" * 64 for n in SMOKE_FILES[1:]}
  names[name] = "0" * 64
  _with_smoke(b, names)
  with pytest.raises(UserError, match="lists smoke files") as e:
    verify_bundle(b, smoke=True)
  assert "\n" not in str(e.value) and "\x1b" not in str(e.value)


# ---- item 8: SIGTERM is handled as SIGINT wherever a command writes ----

_SIGTERM_DURING = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import {module} as m
def stop(*a, **k):
  os.kill(os.getpid(), signal.SIGTERM)
  signal.pthread_sigmask(signal.SIG_BLOCK, [])   # the handler runs here, as it would inside the copy
  raise AssertionError("SIGTERM did not stop it")
setattr(m, {name!r}, stop)
from {entry_module} import main
sys.exit(main({argv!r}))
"""


def _stopped_by_sigterm(module: str, name: str, entry_module: str, argv: list[str], cwd: Path):
  import subprocess
  import sys

  from conftest import REPO
  code = _SIGTERM_DURING.format(repo=str(REPO), module=module, name=name, entry_module=entry_module, argv=[str(a) for a in argv])
  return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_sigterm_during_the_install_copy_leaves_the_checkout_as_it_was(op, tmp_path):
  b = make_bundle(tmp_path / "b")
  before = tree_state(op)
  r = _stopped_by_sigterm("release.install", "copy_files", "cli.main", ["install", op, "--bundle", b], tmp_path)
  assert r.returncode == 143 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
  assert tree_state(op) == before   # no .modeld_msm.tmp-* with a partial bundle, no third_party/ made


def test_sigterm_during_a_release_build_leaves_no_temp_folder(tmp_path):
  from compile.refmodels.driving import write_models
  write_models(tmp_path / "m", "tiny", 0)
  out = tmp_path / "out"
  r = _stopped_by_sigterm("release.build", "compile_artifact", "release.build",
                          ["--vision", tmp_path / "m" / "driving_vision.onnx", "--policy", tmp_path / "m" / "driving_policy.onnx",
                           "--device", "CPU", "--camera", "1928x1208", "-o", out], tmp_path)
  assert r.returncode == 143 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]   # no .out.tmp-*


def test_leftovers_of_a_killed_install_go_with_the_next_install_and_uninstall(op, tmp_path):
  from release.install import uninstall
  b = make_bundle(tmp_path / "b")
  left = _base(op) / "third_party" / ".modeld_msm.tmp-abc123" / "artifacts"
  left.mkdir(parents=True)
  (left / "bundle.json").write_text("{}")
  install(op, b, log=quiet)
  assert not left.parent.exists()
  left.mkdir(parents=True)
  uninstall(op, log=quiet)
  assert list((_base(op) / "third_party").iterdir()) == []   # third_party itself was there before install (the leftover's)


# ---- item 9: signing ----

@pytest.fixture
def keys(tmp_path):
  from artifact.signing import generate_keypair
  return generate_keypair(tmp_path / "keys")


def test_sign_refuses_an_artifact_this_key_signed_and_someone_edited_since(tmp_path, keys):
  import hashlib

  from artifact.format import sign_tree
  priv, _ = keys
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",))
  sign_tree(b, priv)
  art = b / "1928x1208"
  meta = json.loads((art / "metadata.json").read_text())
  meta["target"] = "edited"
  (art / "metadata.json").write_text(json.dumps(meta))
  manifest = json.loads((art / "manifest.json").read_text())   # the editor fixes the manifest: only the signature knows
  manifest["files"]["metadata.json"] = hashlib.sha256((art / "metadata.json").read_bytes()).hexdigest()
  (art / "manifest.json").write_text(json.dumps(manifest))
  sig = (art / "manifest.sig").read_bytes()
  err = _one_line_error(run_cli("sign", b, "--key", priv))
  assert "edited since" in err, err
  assert (art / "manifest.sig").read_bytes() == sig


def test_signing_a_bundles_dm_artifact_records_the_signer_in_bundle_json(tmp_path, keys):
  from artifact.signing import key_id, load_public
  from release.bundle import sign_bundle
  priv, pub = keys
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",), dm=("1928x1208",))
  sign_bundle(b / "dmonitoring" / "1928x1208", priv)
  idx = json.loads((b / "bundle.json").read_text())
  assert idx["dmonitoring"]["1928x1208"]["signed_by"] == key_id(load_public(pub))
  assert "signed_by" not in idx["artifacts"]["1928x1208"]


# ---- item 10: JSON from disk is checked by shape; verify reads a bundle ----

@pytest.mark.parametrize("edit", [
  lambda i: i["artifacts"].__setitem__("1928x1208", "x"),
  lambda i: i["artifacts"]["1928x1208"].__setitem__("smoke", [1]),
  lambda i: i["artifacts"]["1928x1208"].__setitem__("smoke", {"files": "x"}),
  lambda i: i["artifacts"]["1928x1208"].__setitem__("signed_by", 7),
  lambda i: i.__setitem__("device", ["QCOM"]),
  lambda i: i.__setitem__("dmonitoring", {"1928x1208": 3}),
  lambda i: i.__setitem__("dmonitoring", ["1928x1208"]),   # the table itself of the wrong shape, not only an entry
])
def test_bundle_json_of_the_wrong_shape_is_one_line(op, tmp_path, edit):
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",))
  idx = json.loads((b / "bundle.json").read_text())
  edit(idx)
  (b / "bundle.json").write_text(json.dumps(idx))
  for cmd in (["install", op, "--bundle", b], ["verify", b]):
    _one_line_error(run_cli(*cmd))


@pytest.mark.parametrize("edit", [
  lambda s: s.__setitem__("process_config", []),
  lambda s: s["process_config"].__setitem__("replaced", {"modeld": "x"}),
  lambda s: s["bundle"].__setitem__("bytes", "many"),
  lambda s: s.__setitem__("created_dirs", ["../../home"]),
  lambda s: s.__setitem__("pubkey", 5),
  lambda s: s.__setitem__("bundle", None),
  lambda s: s["process_config"].__setitem__("original_sha256", None),
])
def test_install_json_of_the_wrong_shape_is_one_line(op, tmp_path, edit):
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",))
  install(op, b, log=quiet)
  f = _base(op) / INSTALL_REL / "install.json"
  state = json.loads(f.read_text())
  edit(state)
  f.write_text(json.dumps(state))
  before = tree_state(op)
  for cmd in (["install", op, "--bundle", b], ["uninstall", op]):
    assert "not of the shape" in _one_line_error(run_cli(*cmd))
  assert tree_state(op) == before


def test_verify_reads_a_bundle(tmp_path):
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",), dm=("1928x1208",))
  r = run_cli("verify", b)
  assert r.returncode == 0 and "no manifest.json" not in r.stdout + r.stderr, r.stdout + r.stderr
  assert r.stdout.count(": OK") == 3, r.stdout


def test_serve_dm_on_a_bundle_without_dm_refuses_before_any_camera(tmp_path, prefix):
  b = make_bundle(tmp_path / "b", device="CPU", cameras=("1928x1208",))
  err = _one_line_error(run_cli("serve-dm", "--artifact", b, "--no-realtime", timeout=60))
  assert "has no dmonitoring artifacts" in err, err


# ---- item 7: user files are never lost ----

def test_replacing_an_artifact_or_bundle_of_ours_keeps_the_users_files(tmp_path):
  from compile.build import check_out_dir
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",))
  check_out_dir(b / "1928x1208")   # ours, nothing else: may be replaced
  (b / "1928x1208" / "notes.txt").write_text("mine")
  with pytest.raises(UserError, match="also holds notes.txt"):
    check_out_dir(b / "1928x1208")
  (b / "1928x1208" / "notes.txt").unlink()
  (b / "RELEASE_NOTES.txt").write_text("mine")
  (b / "modeld-msm.pub").write_text("ed25519 00")
  err = _one_line_error(run_cli("release", "--vision", tmp_path / "v.onnx", "--policy", tmp_path / "p.onnx", "-o", b))
  assert "also holds RELEASE_NOTES.txt, modeld-msm.pub" in err, err
  assert (b / "RELEASE_NOTES.txt").read_text() == "mine"


def test_models_and_train_dm_do_not_overwrite_model_files_without_force(tmp_path):
  out = tmp_path / "m"
  out.mkdir()
  (out / "dmonitoring_model.onnx").write_bytes(b"the user's own model")
  for cmd in (["models", "--contract", "dmonitoring", "-o", out], ["train-dm", "-o", out, "--steps", "1"]):
    err = _one_line_error(run_cli(*cmd))
    assert "--force" in err, err
  assert (out / "dmonitoring_model.onnx").read_bytes() == b"the user's own model"
  assert run_cli("models", "--contract", "dmonitoring", "-o", out, "--force").returncode == 0
  assert (out / "dmonitoring_model.onnx").read_bytes() != b"the user's own model"


def test_compile_dmonitoring_with_model_is_refused(tmp_path):
  err = _one_line_error(run_cli("compile", "--model", tmp_path / "a.onnx", "--dmonitoring", tmp_path / "b.onnx", "-o", tmp_path / "o"))
  assert "--model" in err, err


# ---- item 10: -o a link; writers racing for one -o; install onto a full disk ----

def test_o_a_link_is_refused_before_any_work(tmp_path):
  from compile.build import check_out_dir
  real = make_bundle(tmp_path / "real", cameras=("1928x1208",)) / "1928x1208"
  link = tmp_path / "link"
  link.symlink_to(real)
  with pytest.raises(UserError, match="symbolic link"):
    check_out_dir(link)


def test_a_writer_whose_old_tree_another_moved_first_still_swaps_in(tmp_path, monkeypatch):
  """Two writers to one -o: the other one moved the old tree away between our look and our move (FileNotFoundError
  before), and its tree landed before ours (a rename onto a non-empty folder)."""
  import artifact.format as fmt
  out = tmp_path / "out"
  out.mkdir()
  (out / "old").write_text("old")
  theirs, ours = tmp_path / ".out.tmp-theirs", tmp_path / ".out.tmp-ours"
  for d, tag in ((theirs, "theirs"), (ours, "ours")):
    d.mkdir()
    (d / "f").write_text(tag)
  real_replace, calls = os.replace, []

  def racing(src, dst):
    calls.append((Path(src).name, Path(dst).name))
    if len(calls) == 1:   # the other writer, first: moves the old tree away and swaps its own in
      real_replace(out, tmp_path / ".out.old-other")
      real_replace(theirs, out)
      raise FileNotFoundError(2, "No such file or directory", str(src))
    return real_replace(src, dst)
  monkeypatch.setattr(fmt.os, "replace", racing)
  fmt.swap_in_dir(ours, out)
  assert (out / "f").read_text() == "ours"   # the last one in wins
  assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old-other", "out"]   # none of ours left behind


def test_install_onto_a_full_disk_is_one_line_and_rolls_back(op, tmp_path):
  import resource
  import signal
  import subprocess
  import sys

  from conftest import REPO
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",))
  (b / "1928x1208" / "driving_policy.pkl").write_bytes(b"x" * 300_000)   # bigger than the limit below
  m = json.loads((b / "1928x1208" / "manifest.json").read_text())
  import hashlib
  m["files"]["driving_policy.pkl"] = hashlib.sha256(b"x" * 300_000).hexdigest()
  (b / "1928x1208" / "manifest.json").write_text(json.dumps(m))
  before = tree_state(op)

  def limit():   # a full disk, as the sweep makes one: writes past 200 kB fail with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
  r = subprocess.run([sys.executable, "-m", "cli.main", "install", str(op), "--bundle", str(b)], cwd=REPO, capture_output=True, text=True,
                     timeout=300, preexec_fn=limit)
  assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
  assert tree_state(op) == before


# ---- what the mutation pass found unpinned ----

def test_printable_shows_control_characters_escaped():
  from release.bundle import printable
  assert printable("a\nb\x1b[31m") == "a\\nb\\x1b[31m"
  assert printable("x" * 100, limit=10) == "x" * 10 + "..."


def test_the_key_id_is_16_hex_digits_of_the_keys_sha256():
  from artifact.signing import key_id
  assert key_id(bytes(32)) == "66687aadf862bd77"   # sha256 of 32 zero bytes, first 16 hex digits


def test_modeld_pubkey_from_the_environment_is_required(tmp_path, keys, monkeypatch):
  from release.bundle import verify_bundle
  _, pub = keys
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",))
  verify_bundle(b, smoke=False)
  monkeypatch.setenv("MODELD_PUBKEY", str(pub))
  with pytest.raises(UserError, match="is not signed"):
    verify_bundle(b, smoke=False)


def _add_smoke(b: Path, cam: str = "1928x1208") -> Path:
  """Smoke files (placeholder bytes) listed by their hashes in bundle.json, as the release build records them."""
  import hashlib
  d = b / "smoke" / cam
  d.mkdir(parents=True)
  files = {}
  for n in ("frames.nv12.zst", "inputs.npz", "expected.npz", "smoke.json"):
    (d / n).write_bytes(n.encode())
    files[n] = hashlib.sha256(n.encode()).hexdigest()
  idx = json.loads((b / "bundle.json").read_text())
  idx["artifacts"][cam]["smoke"] = {"files": files}
  (b / "bundle.json").write_text(json.dumps(idx))
  return d


def test_sign_refuses_smoke_files_that_do_not_match_their_hashes(tmp_path, keys):
  from release.bundle import sign_bundle, verify_bundle
  priv, pub = keys
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",))
  d = _add_smoke(b)
  sign_bundle(b, priv)
  verify_bundle(b, pubkey=pub)   # the control: signed as it is
  (d / "expected.npz").write_bytes(b"edited")
  with pytest.raises(UserError, match="expected.npz does not match the hash"):
    sign_bundle(b, priv)   # a signature vouches for what is there, never for an edit


def test_missing_dm_smoke_data_names_the_driver_monitoring_artifact(tmp_path):
  from release.bundle import Bundle, check_smoke_files
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",), dm=("1928x1208",))
  bundle = Bundle(b, json.loads((b / "bundle.json").read_text()))
  with pytest.raises(UserError, match="no smoke data for dmonitoring 1928x1208"):
    check_smoke_files(bundle, "1928x1208", "dmonitoring")
  with pytest.raises(UserError, match="no smoke data for 1928x1208 \\("):
    check_smoke_files(bundle, "1928x1208")


def test_human_size():
  from release.bundle import human_size
  assert [human_size(n) for n in (5, 1500, 2_500_000, 3e12)] == ["5 B", "1.5 kB", "2.5 MB", "3000.0 GB"]
  assert [human_size(n) for n in (999, 1000, 999_999, 1_000_000, 1e9)] == ["999 B", "1.0 kB", "1000.0 kB", "1.0 MB", "1.0 GB"]


def test_the_copy_never_follows_a_link_swapped_in_after_the_check(tmp_path):
  """check_no_links runs first; a file replaced by a link between that check and the copy is refused by the open itself."""
  import errno

  from release.install import copy_files
  src, dst, secret = tmp_path / "src", tmp_path / "dst", tmp_path / "secret"
  (src / "a").mkdir(parents=True)
  (src / "a" / "f").write_bytes(b"bundle file")
  secret.write_text("host secret\n")
  (src / "a" / "swapped").symlink_to(secret)
  copy_files(src, ["a/f"], dst)
  assert (dst / "a" / "f").read_bytes() == b"bundle file"
  with pytest.raises(OSError) as e:
    copy_files(src, ["a/swapped"], dst)
  assert e.value.errno == errno.ELOOP and not (dst / "a" / "swapped").exists()


@pytest.mark.parametrize("how", ["a link to a copy", "missing"])
def test_a_smoke_file_that_is_a_link_or_missing_is_refused_in_one_line(tmp_path, how):
  """The hash would match through the link: the file itself must be the bundle's own."""
  from release.bundle import verify_bundle
  b = make_bundle(tmp_path / "b", cameras=("1928x1208",))
  d = _add_smoke(b)
  verify_bundle(b)   # the control
  copy = tmp_path / "inputs.npz"
  os.replace(d / "inputs.npz", copy)
  if how == "a link to a copy":
    (d / "inputs.npz").symlink_to(copy)
  with pytest.raises(UserError, match="smoke file smoke/1928x1208/inputs.npz is missing"):
    verify_bundle(b)
