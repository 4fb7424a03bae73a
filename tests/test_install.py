"""`modeld-msm install` / `uninstall` against a minimal openpilot-shaped tree of our own: a stub process.py whose classes
record their arguments, a process_config.py with a `procs` list, an `openpilot -> .` link as in openpilot's root, and a
`tinygrad` package there that fails on import (openpilot's vendored tinygrad sits at that path and must not be what
our modeld imports). Bundles are fabricated (manifest-valid artifacts with placeholder pickles): install verifies, it
never unpickles, so no compile is needed here."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from release.install import INSTALL_REL, PROCESS_CONFIG, install, uninstall
from selfdrive_glue.errors import UserError

PROCESS_PY = '''\
class _Proc:
  def __init__(self, name, *args, **kw):
    self.name, self.args, self.kw = name, args, kw

class PythonProcess(_Proc):
  def __init__(self, name, module, should_run, enabled=True, sigkill=False, watchdog_max_dt=None):
    super().__init__(name, module, should_run, enabled=enabled, sigkill=sigkill, watchdog_max_dt=watchdog_max_dt)
    self.module, self.should_run, self.enabled = module, should_run, enabled

class NativeProcess(_Proc):
  def __init__(self, name, cwd, cmdline, should_run, enabled=True, sigkill=False, watchdog_max_dt=None):
    super().__init__(name, cwd, cmdline, should_run, enabled=enabled, sigkill=sigkill, watchdog_max_dt=watchdog_max_dt)
    self.cwd, self.cmdline, self.should_run, self.enabled = cwd, cmdline, should_run, enabled

class DaemonProcess(_Proc):
  pass
'''

STOCK_ENTRY = 'PythonProcess("modeld", "selfdrive.modeld.modeld", only_onroad)'


def table(entries: list[str], header: str = "") -> str:
  body = "".join(f"  {e},\n" for e in entries)
  return f'''import os
# the process table — café, naïve: non-ASCII bytes before the entry must not shift the edit
from openpilot.system.manager.process import PythonProcess, NativeProcess, DaemonProcess
{header}
PC = os.getenv("TEST_PC") is not None

def only_onroad(started, params, CP):
  return started

def always_run(started, params, CP):
  return True

procs = [
  DaemonProcess("manage_athenad", "system.athena.manage_athenad", "AthenadPid"),
  NativeProcess("camerad", "system/camerad", ["./camerad"], always_run),
{body}  PythonProcess("plannerd", "selfdrive.controls.plannerd", only_onroad),
]

managed_processes = {{p.name: p for p in procs}}
'''


def make_openpilot(root: Path, entries: list[str] | None = None) -> Path:
  (root / "system/manager").mkdir(parents=True)
  (root / "system/manager/process.py").write_text(PROCESS_PY)
  (root / PROCESS_CONFIG).write_text(table([STOCK_ENTRY] if entries is None else entries))
  (root / "openpilot").symlink_to(".")
  (root / "tinygrad").mkdir()
  (root / "tinygrad/__init__.py").write_text("raise ImportError('openpilot vendored tinygrad imported by modeld-msm')\n")
  return root


def make_bundle(d: Path, device: str = "QCOM", cameras=("1928x1208", "1344x760"), tag: bytes = b"") -> Path:
  from artifact.format import POLICY_PKL, WARP_PKL, installed_versions, write_artifact
  for cam in cameras:
    w, h = map(int, cam.split("x"))
    target = "QCOM:IR3" if device == "QCOM" else "CPU"
    meta = {"camera": {"width": w, "height": h}, "device": device, "target": target, "load_target": target, "versions": installed_versions(),
            "models": {}}
    write_artifact(d / cam, {POLICY_PKL: b"policy placeholder" + tag, WARP_PKL: b"warp placeholder"}, meta)
  (d / "bundle.json").write_text(json.dumps({"device": device, "artifacts": {c: {"target": "x", "checks": []} for c in cameras}}))
  return d


def tree_state(root: Path) -> dict[str, str]:
  """Every file (links as their target) and directory under root: what 'exactly as before' means."""
  out = {}
  for p in sorted(root.rglob("*")):
    if "__pycache__" in p.parts:
      continue
    rel = p.relative_to(root).as_posix()
    out[rel] = ("link:" + os.readlink(p)) if p.is_symlink() else "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
  return out


def load_table(root: Path) -> dict:
  """Import the (edited) process table as openpilot's manager would, in a fresh interpreter with the checkout on PYTHONPATH."""
  code = ("import json; from openpilot.system.manager.process_config import managed_processes as m, only_onroad; "
          "what = lambda p: [p.cwd, p.cmdline] if hasattr(p, 'cwd') else [p.name, getattr(p, 'module', p.args[0])]; "
          "print(json.dumps({n: [type(p).__name__, what(p), getattr(p, 'should_run', None) is only_onroad, p.kw.get('enabled', True)] "
          "for n, p in m.items()}))")
  r = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"},
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  return json.loads(r.stdout)


@pytest.fixture
def op(tmp_path) -> Path:
  return make_openpilot(tmp_path / "openpilot")


@pytest.fixture
def bundle(tmp_path) -> Path:
  return make_bundle(tmp_path / "bundle")


def quiet(*_a) -> None:
  pass


def test_install_runs_our_modeld_and_uninstall_restores_exactly(op, bundle):
  before, stock = tree_state(op), (op / PROCESS_CONFIG).read_bytes()
  assert load_table(op)["modeld"][0] == "PythonProcess"
  assert install(op, bundle, log=quiet) == "installed"

  procs = load_table(op)
  assert procs["modeld"] == ["NativeProcess", [INSTALL_REL, ["./modeld"]], True, True]   # should_run kept: only_onroad
  assert procs["plannerd"] == ["PythonProcess", ["plannerd", "selfdrive.controls.plannerd"], True, True]   # others untouched
  assert procs["camerad"][0] == "NativeProcess" and len(procs) == 4
  d = op / INSTALL_REL
  state = json.loads((d / "install.json").read_text())
  assert state["process_config"]["stock_entry"] == STOCK_ENTRY and state["bundle"]["cameras"] == ["1928x1208", "1344x760"]
  assert (d / "process_config.py.orig").read_bytes() == stock
  assert (d / "artifacts/1928x1208/manifest.json").read_bytes() == (bundle / "1928x1208/manifest.json").read_bytes()
  assert "-m modeld_msm.modeld" in (d / "modeld").read_text() and os.access(d / "modeld", os.X_OK)

  # what the manager's nativelauncher does: chdir to cwd, exec cmdline, with openpilot's PYTHONPATH (whose tinygrad fails)
  r = subprocess.run(["./modeld", "--help"], cwd=op / procs["modeld"][1][0], capture_output=True, text=True, timeout=120,
                     env={**os.environ, "PYTHONPATH": str(op)})
  assert r.returncode == 0 and r.stdout.startswith("usage: modeld [-h] [--artifact ARTIFACT]"), r.stdout + r.stderr
  # the same launcher with a probe in place of the module: which tinygrad, which bundle, which modeld_msm
  probe = d / "probe"
  probe.write_text((d / "modeld").read_text().replace('-m modeld_msm.modeld "$@"', """-c 'import os, tinygrad, modeld_msm.modeld as m
print(tinygrad.__file__); print(os.environ["MODELD_ARTIFACT"]); print(m.__file__)'"""))
  r = subprocess.run(["sh", "./probe"], cwd=d, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(op)})
  assert r.returncode == 0, r.stderr
  tinygrad_file, artifact, module = r.stdout.split()
  assert not tinygrad_file.startswith(str(op)) and artifact == str(d / "artifacts") and module == str(REPO / "modeld_msm/modeld.py")
  probe.unlink()

  assert uninstall(op, log=quiet) == "removed"
  assert (op / PROCESS_CONFIG).read_bytes() == stock
  assert tree_state(op) == before   # third_party, which install created, is gone too
  assert uninstall(op, log=quiet) == "not installed"


def test_install_twice_is_a_no_op_and_a_new_bundle_updates(op, bundle, tmp_path):
  install(op, bundle, log=quiet)
  after_first, table_first = tree_state(op), (op / PROCESS_CONFIG).read_bytes()
  assert install(op, bundle, log=quiet) == "unchanged"
  assert tree_state(op) == after_first

  other = make_bundle(tmp_path / "bundle2", tag=b"v2")
  assert install(op, other, log=quiet) == "updated"
  assert (op / PROCESS_CONFIG).read_bytes() == table_first
  assert (op / INSTALL_REL / "artifacts/1928x1208/driving_policy.pkl").read_bytes().endswith(b"v2")
  uninstall(op, log=quiet)
  assert "PythonProcess(\"modeld\", \"selfdrive.modeld.modeld\", only_onroad)" in (op / PROCESS_CONFIG).read_text()
  assert not (op / "third_party").exists()


def test_native_entry_keeps_should_run_and_keywords(tmp_path, bundle):
  op = make_openpilot(tmp_path / "op", ['NativeProcess("modeld", "selfdrive/modeld", ["./modeld"], only_onroad, enabled=not PC)'])
  stock = (op / PROCESS_CONFIG).read_bytes()
  (op / "third_party").mkdir()   # openpilot has one: uninstall must leave it
  install(op, bundle, log=quiet)
  text = (op / PROCESS_CONFIG).read_text()
  assert f'NativeProcess("modeld", "{INSTALL_REL}", ["./modeld"], only_onroad, enabled=not PC)' in text
  assert load_table(op)["modeld"] == ["NativeProcess", [INSTALL_REL, ["./modeld"]], True, True]
  uninstall(op, log=quiet)
  assert (op / PROCESS_CONFIG).read_bytes() == stock and (op / "third_party").is_dir()


def test_dry_run_prints_the_diff_and_changes_nothing(op, bundle):
  before = tree_state(op)
  r = run_cli("install", op, "--bundle", bundle, "--dry-run")
  assert r.returncode == 0, r.stderr
  assert f"-  {STOCK_ENTRY}," in r.stdout
  assert f'+  NativeProcess("modeld", "{INSTALL_REL}", ["./modeld"], only_onroad),' in r.stdout
  assert "--- a/system/manager/process_config.py" in r.stdout and "dry run, nothing changed" in r.stdout
  assert tree_state(op) == before

  assert run_cli("install", op, "--bundle", bundle).returncode == 0
  installed = tree_state(op)
  r = run_cli("uninstall", op, "--dry-run")
  assert r.returncode == 0 and f"+  {STOCK_ENTRY}," in r.stdout and "remove" in r.stdout, r.stdout + r.stderr
  assert tree_state(op) == installed
  assert run_cli("uninstall", op).returncode == 0 and tree_state(op) == before


@pytest.mark.parametrize("entries, why", [
  ([], 'expected exactly one "modeld" process entry, found 0'),
  ([STOCK_ENTRY, 'PythonProcess("modeld", "selfdrive.modeld.modeld2", only_onroad)'], 'found 2'),
])
def test_unknown_table_layout_is_refused(tmp_path, bundle, entries, why):
  op = make_openpilot(tmp_path / "op", entries)
  before = tree_state(op)
  with pytest.raises(UserError, match=f"unknown process-table layout.*{why}"):
    install(op, bundle, log=quiet)
  assert tree_state(op) == before


def test_table_without_a_procs_list_is_refused(op, bundle):
  (op / PROCESS_CONFIG).write_text(f"from openpilot.system.manager.process import PythonProcess, NativeProcess\nPROCS = [{STOCK_ENTRY}]\n")
  with pytest.raises(UserError, match=r"expected one `procs = \[...\]` list"):
    install(op, bundle, log=quiet)


def test_not_an_openpilot_tree_is_refused(tmp_path, bundle):
  r = run_cli("install", tmp_path, "--bundle", bundle)
  assert r.returncode == 2 and "is not an openpilot checkout" in r.stderr and "Traceback" not in r.stderr
  assert list(tmp_path.iterdir()) == [bundle]


def test_cpu_bundle_needs_allow_cpu(op, tmp_path):
  cpu = make_bundle(tmp_path / "cpu", device="CPU", cameras=("1928x1208",))
  before = tree_state(op)
  with pytest.raises(UserError, match="is for CPU; the car runs QCOM bundles.*--allow-cpu"):
    install(op, cpu, log=quiet)
  assert tree_state(op) == before
  assert install(op, cpu, allow_cpu=True, log=quiet) == "installed"


def test_bundle_failing_verify_is_refused(op, bundle):
  pkl = bundle / "1344x760/driving_policy.pkl"
  pkl.write_bytes(pkl.read_bytes() + b"!")
  before = tree_state(op)
  r = run_cli("install", op, "--bundle", bundle)
  assert r.returncode == 2 and "driving_policy.pkl does not match its manifest" in r.stderr, r.stderr
  assert tree_state(op) == before


def test_a_single_artifact_is_not_a_bundle(op, bundle):
  with pytest.raises(UserError, match="no bundle.json .a single artifact."):
    install(op, bundle / "1928x1208", log=quiet)


def test_uninstall_refuses_a_table_edited_since(op, bundle):
  install(op, bundle, log=quiet)
  t = op / PROCESS_CONFIG
  t.write_text(t.read_text() + "# a later local edit\n")
  with pytest.raises(UserError, match="edited after the install"):
    uninstall(op, log=quiet)
  assert (op / INSTALL_REL / "install.json").exists()



def test_pubkey_is_checked_now_and_installed_for_every_start(op, bundle, tmp_path):
  from artifact.format import sign_tree
  from artifact.signing import generate_keypair
  priv, pub = generate_keypair(tmp_path / "keys")
  with pytest.raises(UserError, match="signature|signed"):
    install(op, bundle, pubkey=pub, log=quiet)   # not signed yet
  assert not (op / "third_party").exists()
  sign_tree(bundle, priv)
  assert install(op, bundle, pubkey=pub, log=quiet) == "installed"
  d = op / INSTALL_REL
  assert (d / "modeld-msm.pub").read_bytes() == pub.read_bytes()
  assert 'export MODELD_PUBKEY="$here/modeld-msm.pub"' in (d / "modeld").read_text()
  assert install(op, bundle, log=quiet) == "unchanged"   # without --pubkey the installed key stays (tests/test_bad_input_install.py)
  assert install(op, bundle, drop_pubkey=True, log=quiet) == "updated"   # dropped only when asked by name: the launcher changes
  assert "MODELD_PUBKEY" not in (d / "modeld").read_text() and not (d / "modeld-msm.pub").exists()
