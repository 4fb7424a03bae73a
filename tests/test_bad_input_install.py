"""Bad input around `install`, `sign` and the modeld process (issue 24, items 3, 14 and 15): an install without --pubkey
must not turn signature checking off, `sign` must say in bundle.json who signed, the launcher and `serve` must be one
entry point, and the process table is never left half written."""
from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from test_install import make_bundle, make_openpilot, tree_state

from artifact.signing import generate_keypair, key_id, load_public
from release.install import INSTALL_REL, PROCESS_CONFIG, install, uninstall
from selfdrive_glue.errors import UserError


def quiet(*_a) -> None:
  pass


@pytest.fixture
def op(tmp_path) -> Path:
  return make_openpilot(tmp_path / "openpilot")


@pytest.fixture
def keys(tmp_path):
  return generate_keypair(tmp_path / "keys")


def _one_line_error(r) -> str:
  err = r.stderr.strip()
  assert r.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, (r.returncode, r.stdout[-2000:], err)
  return err


# ---- item 3: the installed public key stays unless dropped by name ----

def test_install_without_pubkey_keeps_the_installed_key(op, tmp_path, keys):
  from artifact.format import sign_tree
  priv, pub = keys
  signed = make_bundle(tmp_path / "signed")
  sign_tree(signed, priv)
  assert install(op, signed, pubkey=pub, log=quiet) == "installed"
  d = op / INSTALL_REL
  assert install(op, signed, log=quiet) == "unchanged"   # same bundle, no --pubkey: the key stays, so nothing changes
  assert (d / "modeld-msm.pub").read_bytes() == pub.read_bytes() and "MODELD_PUBKEY" in (d / "modeld").read_text()

  unsigned = make_bundle(tmp_path / "unsigned", tag=b"v2")
  before = tree_state(op)
  r = run_cli("install", op, "--bundle", unsigned)
  err = _one_line_error(r)
  assert f"signed by key {key_id(load_public(pub))}" in err and "is not signed" in err and "--drop-pubkey" in err, err
  assert "MODELD_PUBKEY" not in err   # not the env-var advice of a plain verify: here the key is the installed one
  assert tree_state(op) == before

  sign_tree(unsigned, priv)   # a new bundle signed by the same key goes in without retyping --pubkey
  log: list[str] = []
  assert install(op, unsigned, log=log.append) == "updated"
  assert (d / "modeld-msm.pub").read_bytes() == pub.read_bytes() and "MODELD_PUBKEY" in (d / "modeld").read_text()
  assert json.loads((d / "install.json").read_text())["pubkey"] == "modeld-msm.pub"
  assert any("kept the installed public key" in m for m in log)


def test_drop_pubkey_removes_signature_checking_on_purpose_with_a_warning(op, tmp_path, keys):
  from artifact.format import sign_tree
  priv, pub = keys
  b = make_bundle(tmp_path / "b")
  sign_tree(b, priv)
  install(op, b, pubkey=pub, log=quiet)
  d = op / INSTALL_REL
  r = run_cli("install", op, "--bundle", b, "--pubkey", pub, "--drop-pubkey")
  assert r.returncode == 2 and "not allowed with argument" in r.stderr and (d / "modeld-msm.pub").exists(), r.stderr
  r = run_cli("install", op, "--bundle", b, "--drop-pubkey", "--dry-run")
  assert r.returncode == 0 and "REMOVE the installed public key" in r.stdout and (d / "modeld-msm.pub").exists(), r.stdout + r.stderr
  r = run_cli("install", op, "--bundle", b, "--drop-pubkey")
  assert r.returncode == 0 and "warning: --drop-pubkey" in r.stdout and "modeld-msm updated" in r.stdout, r.stdout + r.stderr
  assert not (d / "modeld-msm.pub").exists() and "MODELD_PUBKEY" not in (d / "modeld").read_text()
  assert json.loads((d / "install.json").read_text())["pubkey"] is None
  # with no key installed any more, an unsigned bundle is what the user asked for
  assert install(op, make_bundle(tmp_path / "unsigned", tag=b"v2"), log=quiet) == "updated"


def test_a_lost_installed_key_is_refused_not_ignored(op, tmp_path, keys):
  from artifact.format import sign_tree
  priv, pub = keys
  b = make_bundle(tmp_path / "b")
  sign_tree(b, priv)
  install(op, b, pubkey=pub, log=quiet)
  (op / INSTALL_REL / "modeld-msm.pub").unlink()
  with pytest.raises(UserError, match="that file is gone; pass --pubkey KEY .* or --drop-pubkey"):
    install(op, b, log=quiet)


def test_sign_records_the_new_signer_in_bundle_json(tmp_path, keys):
  b = make_bundle(tmp_path / "b")
  index = json.loads((b / "bundle.json").read_text())
  first = key_id(load_public(keys[1]))
  other_priv, other_pub = generate_keypair(tmp_path / "keys", name="other")
  other = key_id(load_public(other_pub))

  assert run_cli("sign", b, "--key", keys[0]).returncode == 0
  signers = {c: e.get("signed_by") for c, e in json.loads((b / "bundle.json").read_text())["artifacts"].items()}
  assert signers == {"1928x1208": first, "1344x760": first}
  r = run_cli("sign", b, "--key", other_priv)
  assert r.returncode == 0, r.stderr
  after = json.loads((b / "bundle.json").read_text())
  assert {c: e["signed_by"] for c, e in after["artifacts"].items()} == {"1928x1208": other, "1344x760": other}
  # nothing else in the index changed
  for e in after["artifacts"].values():
    e.pop("signed_by")
  assert after == index

  # one artifact of a bundle signed on its own: the bundle's index says so for that camera only
  assert run_cli("sign", b / "1344x760", "--key", keys[0]).returncode == 0
  signers = {c: e["signed_by"] for c, e in json.loads((b / "bundle.json").read_text())["artifacts"].items()}
  assert signers == {"1928x1208": other, "1344x760": first}


def test_sign_refuses_an_unreadable_bundle_index_before_signing(tmp_path, keys):
  b = make_bundle(tmp_path / "b")
  (b / "bundle.json").write_text("{not json")
  err = _one_line_error(run_cli("sign", b, "--key", keys[0]))
  assert "bundle.json is unreadable" in err
  assert not list(b.rglob("manifest.sig"))


# ---- item 14: one entry point, one set of options ----

def _options_block(help_text: str) -> str:
  return help_text[help_text.index("\noptions:"):]


def test_launcher_module_and_serve_share_their_options():
  env = {**os.environ, "COLUMNS": "100"}
  mod = subprocess.run([sys.executable, "-m", "modeld_msm.modeld", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
  cli = run_cli("serve", "--help", env={"COLUMNS": "100"})
  assert mod.returncode == 0 and cli.returncode == 0, mod.stderr + cli.stderr
  opts = lambda t: set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", t))  # noqa: E731
  assert opts(mod.stdout) == opts(cli.stdout)
  assert {"--artifact", "--car-params", "--demo", "--server", "--max-frames", "--no-realtime"} <= opts(mod.stdout)
  assert _options_block(mod.stdout) == _options_block(cli.stdout)


def _start_until(cmd: list[str], cwd: Path, log: Path, want: str, env: dict[str, str]) -> tuple[str, int]:
  """Start cmd, wait until its output shows `want` (or it exits), stop it with SIGINT as the manager does."""
  with open(log, "w") as out:
    p = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
      end = time.monotonic() + 120
      while want not in log.read_text() and p.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
      p.send_signal(signal.SIGINT)
      rc = p.wait(30)
    finally:
      if p.poll() is None:
        p.kill()
        p.wait()
  return log.read_text(), rc


def test_installed_launcher_starts_with_the_options_it_passes(op, tmp_path, prefix):
  install(op, make_bundle(tmp_path / "b"), log=quiet)
  d = op / INSTALL_REL
  env = {**os.environ, "PYTHONPATH": str(op), "PYTHONUNBUFFERED": "1"}   # openpilot's PYTHONPATH, as the manager runs it
  # as the manager starts it: ["./modeld"] with no arguments; the artifact comes from the launcher's $MODELD_ARTIFACT
  out, rc = _start_until(["./modeld"], d, tmp_path / "plain.log", "connecting to VisionIPC server 'camerad'", env)
  assert "connecting to VisionIPC server 'camerad'" in out and rc == 0 and "Traceback" not in out, out
  # and with serve's options, passed through the launcher's "$@"
  out, rc = _start_until(["./modeld", "--server", "nosuch", "--no-realtime", "--max-frames", "3"], d, tmp_path / "opts.log",
                         "connecting to VisionIPC server 'nosuch'", env)
  assert "connecting to VisionIPC server 'nosuch'" in out and rc == 0 and "realtime:" not in out, out
  # the launcher's artifact is the installed bundle: without it the process refuses at once, naming that path
  (d / "artifacts").rename(d / "gone")
  r = subprocess.run(["./modeld"], cwd=d, capture_output=True, text=True, timeout=120, env=env)
  assert r.returncode == 2 and f"artifact {d / 'artifacts'} does not exist" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- item 15: process_config.py is the old bytes or the new ones, never half of either ----

class _FullAfterHalf:
  """A file whose first write lands half its bytes on disk and then fails, as on a disk that fills up mid-write."""

  def __init__(self, f):
    self.f = f

  def write(self, data):
    data = bytes(data)
    self.f.write(data[:len(data) // 2])
    self.f.flush()
    raise OSError(errno.ENOSPC, "No space left on device (test)")

  def __getattr__(self, name):
    return getattr(self.f, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.f.close()


def _fill_disk_in(monkeypatch, folder: Path) -> None:
  real_open, folder = io.open, folder.resolve()

  def open_(file, mode="r", *a, **k):
    f = real_open(file, mode, *a, **k)
    if "w" in mode and isinstance(file, str | os.PathLike) and Path(file).resolve().parent == folder:
      return _FullAfterHalf(f)
    return f
  monkeypatch.setattr(io, "open", open_)        # what Path.write_bytes / write_text use
  monkeypatch.setattr(builtins, "open", open_)


@pytest.mark.parametrize("step", ["install", "uninstall"])
def test_process_table_write_interrupted_midway_leaves_the_old_bytes(op, tmp_path, monkeypatch, step):
  b = make_bundle(tmp_path / "b")
  table = op / PROCESS_CONFIG
  if step == "uninstall":
    install(op, b, log=quiet)
  before, old = tree_state(op), table.read_bytes()
  _fill_disk_in(monkeypatch, table.parent)
  with pytest.raises((OSError, UserError)):
    install(op, b, log=quiet) if step == "install" else uninstall(op, log=quiet)
  monkeypatch.undo()
  assert table.read_bytes() == old
  assert tree_state(op) == before   # no temp file left beside the table, and a failed install removed what it had copied
  # and once the disk has room, the same step goes through: the new bytes, whole
  assert (install(op, b, log=quiet) if step == "install" else uninstall(op, log=quiet)) in ("installed", "removed")
  assert table.read_bytes() != old and b"modeld" in table.read_bytes()
