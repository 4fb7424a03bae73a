"""`modeld-msm install` / `uninstall` against a minimal openpilot-shaped tree of our own: a stub process.py whose classes
record their arguments, a process_config.py with a `procs` list, an `openpilot -> .` link as in openpilot's root, and a
`tinygrad` package there that fails on import (openpilot's vendored tinygrad sits at that path and must not be what
our modeld imports). Bundles are fabricated (manifest-valid artifacts with placeholder pickles): install verifies, it
never unpickles, so no compile is needed here. A bundle with driver-monitoring artifacts lists them under "dmonitoring"
in bundle.json (fabricated the same way, in dmonitoring/<camera>/); installing one replaces dmonitoringmodeld too."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from artifact.kinds import DM_PKL
from release.install import INSTALL_REL, PROCESS_CONFIG, install, launcher_text, source_root, uninstall
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
MASTER_ENTRY = 'PythonProcess("modeld", "openpilot.selfdrive.modeld.modeld", only_onroad)'
# openpilot's dmonitoringmodeld entry: 0.10/0.11, master (module with the `openpilot.` prefix), and the very old native one
DM_STOCK = 'PythonProcess("dmonitoringmodeld", "selfdrive.modeld.dmonitoringmodeld", driverview, enabled=(WEBCAM or not PC))'
DM_MASTER = 'PythonProcess("dmonitoringmodeld", "openpilot.selfdrive.modeld.dmonitoringmodeld", driverview, enabled=(WEBCAM or not PC))'
DM_NATIVE = 'NativeProcess("dmonitoringmodeld", "selfdrive/modeld", ["./dmonitoringmodeld"], driverview)'
OUR_DM = f'NativeProcess("dmonitoringmodeld", "{INSTALL_REL}", ["./dmonitoringmodeld"], driverview, enabled=(WEBCAM or not PC))'
OUR_MODELD = f'NativeProcess("modeld", "{INSTALL_REL}", ["./modeld"], only_onroad)'

needs_dm_module = pytest.mark.skipif(importlib.util.find_spec("modeld_msm.dmonitoringmodeld") is None,
                                     reason="modeld_msm.dmonitoringmodeld is not written yet: installing driver monitoring imports it")


def table(entries: list[str], header: str = "") -> str:
  body = "".join(f"  {e},\n" for e in entries)
  return f'''import os
# the process table — café, naïve: non-ASCII bytes before the entry must not shift the edit
from openpilot.system.manager.process import PythonProcess, NativeProcess, DaemonProcess
{header}
PC = os.getenv("TEST_PC") is not None
WEBCAM = os.getenv("TEST_WEBCAM") is not None

def only_onroad(started, params, CP):
  return started

def driverview(started, params, CP):
  return started or params.get_bool("IsDriverViewEnabled")

def always_run(started, params, CP):
  return True

procs = [
  DaemonProcess("manage_athenad", "system.athena.manage_athenad", "AthenadPid"),
  NativeProcess("camerad", "system/camerad", ["./camerad"], always_run),
{body}  PythonProcess("plannerd", "selfdrive.controls.plannerd", only_onroad),
  PythonProcess("dmonitoringd", "selfdrive.monitoring.dmonitoringd", driverview, enabled=(WEBCAM or not PC)),
]

managed_processes = {{p.name: p for p in procs}}
'''


def make_openpilot(root: Path, entries: list[str] | None = None) -> Path:
  (root / "system/manager").mkdir(parents=True)
  (root / "system/manager/process.py").write_text(PROCESS_PY)
  (root / PROCESS_CONFIG).write_text(table([STOCK_ENTRY, DM_STOCK] if entries is None else entries))
  (root / "openpilot").symlink_to(".")
  (root / "tinygrad").mkdir()
  (root / "tinygrad/__init__.py").write_text("raise ImportError('openpilot vendored tinygrad imported by modeld-msm')\n")
  return root



def make_bundle(d: Path, device: str = "QCOM", cameras=("1928x1208", "1344x760"), tag: bytes = b"", dm=()) -> Path:
  """A bundle of `cameras`, with driver-monitoring artifacts (kind "dmonitoring", in dmonitoring/<camera>/) for the
  cameras `dm` (none by default)."""
  from artifact.format import installed_versions, write_artifact
  from artifact.kinds import POLICY_PKL, WARP_PKL
  for cam, sub, extra, programs in [(c, "", {}, {POLICY_PKL: b"policy placeholder" + tag, WARP_PKL: b"warp placeholder"}) for c in cameras] + \
                                   [(c, "dmonitoring/", {"kind": "dmonitoring"}, {DM_PKL: b"dm placeholder" + tag}) for c in dm]:
    w, h = map(int, cam.split("x"))
    target = "QCOM:IR3" if device == "QCOM" else "CPU"
    meta = {"camera": {"width": w, "height": h}, "device": device, "target": target, "load_target": target, "versions": installed_versions(),
            "models": {}, **extra}
    write_artifact(d / sub / cam, programs, meta)
  index = {"device": device, "artifacts": {c: {"target": "x", "checks": []} for c in cameras}}
  if dm:
    index["dmonitoring"] = {c: {"target": "x", "checks": []} for c in dm}
  (d / "bundle.json").write_text(json.dumps(index))
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


def load_table(root: Path, **env: str) -> dict:
  """Import the (edited) process table as openpilot's manager would, in a fresh interpreter with the checkout on PYTHONPATH:
  name -> [class, [cwd, cmdline] or [name, module], should_run's function name, enabled]."""
  code = ("import json; from openpilot.system.manager.process_config import managed_processes as m; "
          "what = lambda p: [p.cwd, p.cmdline] if hasattr(p, 'cwd') else [p.name, getattr(p, 'module', p.args[0])]; "
          "print(json.dumps({n: [type(p).__name__, what(p), getattr(getattr(p, 'should_run', None), '__name__', None), "
          "p.kw.get('enabled', True)] for n, p in m.items()}))")
  r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60,
                     env={**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1", **env})
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
  assert procs["modeld"] == ["NativeProcess", [INSTALL_REL, ["./modeld"]], "only_onroad", True]   # should_run kept
  assert procs["plannerd"] == ["PythonProcess", ["plannerd", "selfdrive.controls.plannerd"], "only_onroad", True]   # others untouched
  # a bundle without driver-monitoring artifacts: openpilot's dmonitoringmodeld stays
  assert procs["dmonitoringmodeld"] == ["PythonProcess", ["dmonitoringmodeld", "selfdrive.modeld.dmonitoringmodeld"], "driverview", True]
  assert procs["camerad"][0] == "NativeProcess" and len(procs) == 6
  d = op / INSTALL_REL
  state = json.loads((d / "install.json").read_text())
  assert state["process_config"]["stock_entry"] == STOCK_ENTRY and state["bundle"]["cameras"] == ["1928x1208", "1344x760"]
  assert (d / "process_config.py.orig").read_bytes() == stock
  assert (d / "artifacts/1928x1208/manifest.json").read_bytes() == (bundle / "1928x1208/manifest.json").read_bytes()
  assert "-m modeld_msm.modeld" in (d / "modeld").read_text() and os.access(d / "modeld", os.X_OK)
  assert list(state["process_config"]["replaced"]) == ["modeld"] and state["bundle"]["dmonitoring"] == []
  assert not (d / "dmonitoringmodeld").exists()

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
  assert load_table(op)["modeld"] == ["NativeProcess", [INSTALL_REL, ["./modeld"]], "only_onroad", True]
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
  with pytest.raises(UserError, match=r"requires artifacts signed by key \w+ \(.*, kept from an earlier `install --pubkey`\), and bundle .* "
                     r"fails that check \(artifact .* is not signed, and a public key is configured \(.*\)\); sign it with that key"):
    install(op, make_bundle(tmp_path / "unsigned", tag=b"2"), log=quiet)   # the kept key refuses an unsigned bundle, saying why
  assert install(op, bundle, drop_pubkey=True, log=quiet) == "updated"   # dropped only when asked by name: the launcher changes
  assert "MODELD_PUBKEY" not in (d / "modeld").read_text() and not (d / "modeld-msm.pub").exists()


# ---- driver monitoring: a bundle with "dmonitoring" artifacts replaces dmonitoringmodeld too ----

DM_CAMS = ("1928x1208", "1344x760")


def dm_bundle(d: Path, tag: bytes = b"") -> Path:
  return make_bundle(d, dm=DM_CAMS, tag=tag)


def put_back(op: Path, ours: str, stock: str) -> None:
  """What a user does by hand: our entry (and the comment install put above it) back to the stock one."""
  t = op / PROCESS_CONFIG
  lines = t.read_text().splitlines(keepends=True)
  i = next(i for i, line in enumerate(lines) if line.strip() == f"{ours},")
  assert lines[i - 1].lstrip().startswith("# modeld-msm:")
  lines[i - 1:i + 1] = [f"  {stock},\n"]
  t.write_text("".join(lines))


@needs_dm_module
@pytest.mark.parametrize("modeld, dm", [(STOCK_ENTRY, DM_STOCK), (MASTER_ENTRY, DM_MASTER), (STOCK_ENTRY, DM_NATIVE)],
                         ids=["0.11", "master", "old-native"])
def test_install_with_driver_monitoring_runs_both_and_uninstall_restores_exactly(tmp_path, modeld, dm):
  op = make_openpilot(tmp_path / "op", [modeld, dm])
  bundle = dm_bundle(tmp_path / "bundle")
  before, stock = tree_state(op), (op / PROCESS_CONFIG).read_bytes()
  log: list[str] = []
  assert install(op, bundle, log=log.append) == "installed"

  text = (op / PROCESS_CONFIG).read_text()
  our_dm = OUR_DM if "enabled" in dm else f'NativeProcess("dmonitoringmodeld", "{INSTALL_REL}", ["./dmonitoringmodeld"], driverview)'
  assert f"  {OUR_MODELD},\n" in text and f"  {our_dm},\n" in text and modeld not in text and dm not in text
  for env, enabled in (({}, True), ({"TEST_PC": "1"}, "enabled" not in dm), ({"TEST_PC": "1", "TEST_WEBCAM": "1"}, True)):
    procs = load_table(op, **env)
    assert procs["modeld"] == ["NativeProcess", [INSTALL_REL, ["./modeld"]], "only_onroad", True]
    assert procs["dmonitoringmodeld"] == ["NativeProcess", [INSTALL_REL, ["./dmonitoringmodeld"]], "driverview", enabled], env
    assert procs["plannerd"][0] == "PythonProcess" and len(procs) == 6
    assert procs["dmonitoringd"] == ["PythonProcess", ["dmonitoringd", "selfdrive.monitoring.dmonitoringd"], "driverview",
                                     "TEST_WEBCAM" in env or "TEST_PC" not in env]   # not ours: untouched
  d = op / INSTALL_REL
  state = json.loads((d / "install.json").read_text())
  replaced = state["process_config"]["replaced"]
  assert {n: r["stock_entry"] for n, r in replaced.items()} == {"modeld": modeld, "dmonitoringmodeld": dm}
  assert replaced["dmonitoringmodeld"]["entry"] == our_dm and state["process_config"]["stock_entry"] == modeld
  assert state["bundle"]["dmonitoring"] == list(DM_CAMS) and (d / "process_config.py.orig").read_bytes() == stock
  assert (d / "artifacts/dmonitoring/1344x760/manifest.json").read_bytes() == (bundle / "dmonitoring/1344x760/manifest.json").read_bytes()
  assert f"{d / 'dmonitoringmodeld'} (python -m modeld_msm.dmonitoringmodeld) as dmonitoringmodeld" in log[-1]

  # the DM launcher as the manager's nativelauncher runs it, with openpilot's PYTHONPATH (whose tinygrad fails)
  launcher = d / "dmonitoringmodeld"
  assert os.access(launcher, os.X_OK)
  assert launcher.read_text() == (d / "modeld").read_text().replace("-m modeld_msm.modeld", "-m modeld_msm.dmonitoringmodeld")   # same env
  env = {**os.environ, "PYTHONPATH": str(op)}
  r = subprocess.run(["./dmonitoringmodeld", "--help"], cwd=op / INSTALL_REL, capture_output=True, text=True, timeout=120, env=env)
  assert r.returncode == 0 and r.stdout.startswith("usage:") and "--artifact" in r.stdout, r.stdout + r.stderr
  probe = d / "probe"
  probe.write_text(launcher.read_text().replace('-m modeld_msm.dmonitoringmodeld "$@"', """-c 'import os, tinygrad, modeld_msm.dmonitoringmodeld as m
print(tinygrad.__file__); print(os.environ["MODELD_ARTIFACT"]); print(m.__file__)'"""))
  r = subprocess.run(["sh", "./probe"], cwd=d, capture_output=True, text=True, timeout=120, env=env)
  assert r.returncode == 0, r.stderr
  tinygrad_file, artifact, module = r.stdout.split()
  assert not tinygrad_file.startswith(str(op)) and artifact == str(d / "artifacts") and module == str(REPO / "modeld_msm/dmonitoringmodeld.py")
  probe.unlink()

  assert install(op, bundle, log=quiet) == "unchanged"
  log.clear()
  assert uninstall(op, log=log.append) == "removed"
  assert (op / PROCESS_CONFIG).read_bytes() == stock and tree_state(op) == before
  assert "runs its stock modeld and dmonitoringmodeld again" in log[-1]


def test_dm_launcher_execs_the_dm_module_with_the_bundle(tmp_path):
  """The launcher text alone, run with an interpreter that shows what it was asked to run (needs no DM module)."""
  shown = tmp_path / "shown"
  fake = tmp_path / "python"
  fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" "$PYTHONPATH" "$MODELD_ARTIFACT" "${{MODELD_PUBKEY-none}}" > {shown}\n')
  fake.chmod(0o755)
  d = tmp_path / "third_party/modeld_msm"
  d.mkdir(parents=True)
  (d / "dmonitoringmodeld").write_bytes(launcher_text(str(fake), source_root(), True, "dmonitoringmodeld"))
  (d / "dmonitoringmodeld").chmod(0o755)
  r = subprocess.run(["./dmonitoringmodeld", "--max-frames", "3"], cwd=d, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  assert shown.read_text().splitlines() == ["-m", "modeld_msm.dmonitoringmodeld", "--max-frames", "3", str(source_root()),
                                            str(d / "artifacts"), str(d / "modeld-msm.pub")]


def test_dry_run_shows_both_edits_and_changes_nothing(tmp_path):
  op = make_openpilot(tmp_path / "op", [MASTER_ENTRY, DM_MASTER])
  bundle = dm_bundle(tmp_path / "bundle")
  before = tree_state(op)
  r = run_cli("install", op, "--bundle", bundle, "--dry-run")
  assert r.returncode == 0, r.stderr
  d = op.resolve() / INSTALL_REL
  assert f"-  {MASTER_ENTRY}," in r.stdout and f"+  {OUR_MODELD}," in r.stdout
  assert f"-  {DM_MASTER}," in r.stdout and f"+  {OUR_DM}," in r.stdout
  assert f"{d / 'modeld'} (exec " in r.stdout and f"{d / 'dmonitoringmodeld'} (exec " in r.stdout
  assert "-m modeld_msm.dmonitoringmodeld)" in r.stdout and "driver monitoring: 1928x1208, 1344x760" in r.stdout
  assert tree_state(op) == before


def test_bundle_without_dm_leaves_the_dm_entry_stock_and_says_so(tmp_path, bundle):
  op = make_openpilot(tmp_path / "op", [MASTER_ENTRY, DM_MASTER])
  r = run_cli("install", op, "--bundle", bundle, "--dry-run")
  assert r.returncode == 0 and "leave openpilot's dmonitoringmodeld as it is: this bundle has no driver-monitoring artifacts" in r.stdout
  assert "dmonitoringmodeld (exec" not in r.stdout and f"-  {DM_MASTER}," not in r.stdout, r.stdout
  log: list[str] = []
  assert install(op, bundle, log=log.append) == "installed"
  assert "dmonitoringmodeld is openpilot's own (the bundle has no driver-monitoring artifacts)" in log[-1]
  assert f"  {DM_MASTER},\n" in (op / PROCESS_CONFIG).read_text() and not (op / INSTALL_REL / "dmonitoringmodeld").exists()
  assert load_table(op)["dmonitoringmodeld"][0] == "PythonProcess"
  # nor does a table without any dmonitoringmodeld stop a bundle without driver monitoring
  bare = make_openpilot(tmp_path / "bare", [STOCK_ENTRY])
  assert install(bare, bundle, log=quiet) == "installed" and uninstall(bare, log=quiet) == "removed"


@pytest.mark.parametrize("entries, why", [
  ([STOCK_ENTRY], 'expected exactly one "dmonitoringmodeld" process entry, found 0;'),
  ([STOCK_ENTRY, DM_STOCK, DM_NATIVE], r'expected exactly one "dmonitoringmodeld" process entry, found 2 \(lines \d+, \d+\)'),
], ids=["missing", "duplicate"])
def test_dm_bundle_on_a_table_without_one_dm_entry_is_refused(tmp_path, entries, why):
  op = make_openpilot(tmp_path / "op", entries)
  bundle = dm_bundle(tmp_path / "bundle")
  before = tree_state(op)
  r = run_cli("install", op, "--bundle", bundle)
  err = r.stderr.strip()
  assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
  assert "unknown process-table layout in system/manager/process_config.py" in err and "has driver-monitoring artifacts" in err
  with pytest.raises(UserError, match=why):
    install(op, bundle, log=quiet)
  assert tree_state(op) == before


def test_interpreter_check_imports_the_dm_module_only_with_dm(tmp_path):
  """The check runs `python -c "import ..."` in the launchers' interpreter: an interpreter that logs its arguments shows
  which modules. Without the DM module that install is refused, nothing written; with it, it goes through."""
  calls = tmp_path / "calls"
  python = tmp_path / "python"
  python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\nexec {sys.executable} "$@"\n')
  python.chmod(0o755)
  op = make_openpilot(tmp_path / "op")
  install(op, make_bundle(tmp_path / "plain"), python=str(python), log=quiet)
  assert calls.read_text().splitlines() == ["-c import backend, modeld_msm.modeld; backend.check_tinygrad()"]
  calls.unlink()
  before = tree_state(op)
  try:
    assert install(op, dm_bundle(tmp_path / "dm"), python=str(python), log=quiet) == "updated"
  except UserError as e:
    assert importlib.util.find_spec("modeld_msm.dmonitoringmodeld") is None
    assert "cannot import modeld_msm.modeld and modeld_msm.dmonitoringmodeld" in str(e) and "named 'modeld_msm.dmonitoringmodeld'" in str(e)
    assert tree_state(op) == before
  assert calls.read_text().splitlines() == ["-c import backend, modeld_msm.modeld, modeld_msm.dmonitoringmodeld; backend.check_tinygrad()"]


@needs_dm_module
def test_bundles_with_and_without_dm_replace_each_other(op, tmp_path):
  stock = (op / PROCESS_CONFIG).read_bytes()
  d = op / INSTALL_REL
  assert install(op, make_bundle(tmp_path / "plain"), log=quiet) == "installed"
  only_modeld = (op / PROCESS_CONFIG).read_bytes()
  assert install(op, dm_bundle(tmp_path / "dm"), log=quiet) == "updated"
  both = (op / PROCESS_CONFIG).read_text()
  assert f"  {OUR_MODELD},\n" in both and f"  {OUR_DM},\n" in both and (d / "dmonitoringmodeld").is_file()
  assert list(json.loads((d / "install.json").read_text())["process_config"]["replaced"]) == ["modeld", "dmonitoringmodeld"]
  assert (d / "process_config.py.orig").read_bytes() == stock
  assert install(op, dm_bundle(tmp_path / "dm"), log=quiet) == "unchanged"
  assert install(op, dm_bundle(tmp_path / "dm2", tag=b"v2"), log=quiet) == "updated" and (op / PROCESS_CONFIG).read_text() == both

  log: list[str] = []
  r = run_cli("install", op, "--bundle", make_bundle(tmp_path / "plain2", tag=b"v3"), "--dry-run")
  assert r.returncode == 0 and "put openpilot's stock dmonitoringmodeld back" in r.stdout and f"-  {OUR_DM}," in r.stdout, r.stdout
  assert install(op, make_bundle(tmp_path / "plain2", tag=b"v3"), log=log.append) == "updated"
  assert (op / PROCESS_CONFIG).read_bytes() == only_modeld and not (d / "dmonitoringmodeld").exists()
  assert "dmonitoringmodeld is openpilot's own" in log[-1]
  assert list(json.loads((d / "install.json").read_text())["process_config"]["replaced"]) == ["modeld"]
  assert uninstall(op, log=quiet) == "removed" and (op / PROCESS_CONFIG).read_bytes() == stock


@needs_dm_module
@pytest.mark.parametrize("back", ["dmonitoringmodeld", "modeld"])
def test_one_entry_put_back_by_hand_is_named(op, tmp_path, back):
  install(op, dm_bundle(tmp_path / "dm"), log=quiet)
  ours, stock = (OUR_DM, DM_STOCK) if back == "dmonitoringmodeld" else (OUR_MODELD, STOCK_ENTRY)
  still = "modeld" if back == "dmonitoringmodeld" else "dmonitoringmodeld"
  put_back(op, ours, stock)
  after = tree_state(op)
  want = f"runs the stock {back} again while {still} still runs {INSTALL_REL}.*git -C .* checkout"
  with pytest.raises(UserError, match=want):
    install(op, dm_bundle(tmp_path / "dm"), log=quiet)
  with pytest.raises(UserError, match=want):
    uninstall(op, log=quiet)
  assert tree_state(op) == after
  put_back(op, OUR_MODELD if back == "dmonitoringmodeld" else OUR_DM, STOCK_ENTRY if back == "dmonitoringmodeld" else DM_STOCK)
  with pytest.raises(UserError, match="runs the stock modeld and dmonitoringmodeld again .*run `modeld-msm uninstall"):
    install(op, dm_bundle(tmp_path / "dm"), log=quiet)
  assert uninstall(op, log=quiet) == "removed" and not (op / "third_party").exists()


def test_our_dm_entry_without_install_json_is_refused(tmp_path, bundle):
  op = make_openpilot(tmp_path / "op", [STOCK_ENTRY, OUR_DM])
  before = tree_state(op)
  with pytest.raises(UserError, match=f"already runs {INSTALL_REL} as dmonitoringmodeld but {INSTALL_REL}/install.json is gone"):
    install(op, bundle, log=quiet)
  with pytest.raises(UserError, match=f"runs {INSTALL_REL} as dmonitoringmodeld but there is no"):
    uninstall(op, log=quiet)
  assert tree_state(op) == before


def test_install_json_from_before_driver_monitoring_still_works(op, bundle, tmp_path):
  """STATE_FORMAT stays 1: an install.json without the DM fields (as modeld-msm wrote before) reads as modeld alone replaced."""
  stock = (op / PROCESS_CONFIG).read_bytes()
  install(op, bundle, log=quiet)
  f = op / INSTALL_REL / "install.json"
  state = json.loads(f.read_text())
  assert state["format"] == 1   # written by this version as by the older ones on cars: the format number is on disk, not ours to move
  del state["process_config"]["replaced"], state["bundle"]["dmonitoring"]
  assert set(state["process_config"]) == {"path", "original_sha256", "installed_sha256", "stock_entry", "entry", "line"}
  f.write_text(json.dumps(state, indent=1))
  assert install(op, bundle, log=quiet) == "unchanged"
  r = run_cli("uninstall", op, "--dry-run")
  assert r.returncode == 0 and f"+  {STOCK_ENTRY}," in r.stdout and str(op.resolve() / INSTALL_REL / "modeld") in r.stdout, r.stdout + r.stderr
  assert uninstall(op, log=quiet) == "removed"
  assert (op / PROCESS_CONFIG).read_bytes() == stock and not (op / "third_party").exists()

  install(op, bundle, log=quiet)   # and an old install.json under a bundle with driver monitoring: both replaced, then both undone
  state = json.loads(f.read_text())
  del state["process_config"]["replaced"], state["bundle"]["dmonitoring"]
  f.write_text(json.dumps(state, indent=1))
  if importlib.util.find_spec("modeld_msm.dmonitoringmodeld") is not None:
    assert install(op, dm_bundle(tmp_path / "dm"), log=quiet) == "updated" and f"  {OUR_DM},\n" in (op / PROCESS_CONFIG).read_text()
  assert uninstall(op, log=quiet) == "removed" and (op / PROCESS_CONFIG).read_bytes() == stock


def test_bundle_with_a_malformed_dmonitoring_key_is_refused(op, tmp_path):
  b = make_bundle(tmp_path / "b")
  index = json.loads((b / "bundle.json").read_text())
  (b / "bundle.json").write_text(json.dumps({**index, "dmonitoring": ["1928x1208"]}))
  before = tree_state(op)
  with pytest.raises(UserError, match="dmonitoring"):
    install(op, b, log=quiet)
  assert tree_state(op) == before


def make_prefixed_openpilot(root: Path) -> Path:
  """openpilot master after its tree moved under an `openpilot/` package: the process table and the manager's BASEDIR are
  in root/openpilot, and the modules are named `openpilot.…`."""
  base = root / "openpilot"
  (base / "system/manager").mkdir(parents=True)
  (base / "system/manager/process.py").write_text(PROCESS_PY)
  (base / PROCESS_CONFIG).write_text(table([MASTER_ENTRY, DM_MASTER]))
  (root / "tinygrad").mkdir()
  (root / "tinygrad/__init__.py").write_text("raise ImportError('openpilot vendored tinygrad imported by modeld-msm')\n")
  return root


def test_install_into_masters_openpilot_package_layout_and_back(tmp_path):
  """The tree under openpilot/ (master): the table edited there, our files beside it in openpilot/third_party (NativeProcess
  paths are relative to that folder, the manager's BASEDIR), the dry run naming the layout, uninstall byte for byte."""
  op = make_prefixed_openpilot(tmp_path / "op")
  bundle = make_bundle(tmp_path / "bundle", dm=("1928x1208", "1344x760"))
  before, stock = tree_state(op), (op / "openpilot" / PROCESS_CONFIG).read_bytes()
  r = run_cli("install", op, "--bundle", bundle, "--dry-run")
  assert r.returncode == 0, r.stderr
  assert "openpilot/ package layout (openpilot master" in r.stdout and "0.11's vision + policy pair" in r.stdout, r.stdout
  assert f"-  {MASTER_ENTRY}," in r.stdout and tree_state(op) == before
  assert install(op, bundle, log=quiet) == "installed"
  procs = load_table(op)
  assert procs["modeld"] == ["NativeProcess", [INSTALL_REL, ["./modeld"]], "only_onroad", True]
  assert procs["dmonitoringmodeld"][:2] == ["NativeProcess", [INSTALL_REL, ["./dmonitoringmodeld"]]]
  assert (op / "openpilot" / INSTALL_REL / "modeld").is_file() and not (op / "third_party").exists()
  assert uninstall(op, log=quiet) == "removed"
  assert (op / "openpilot" / PROCESS_CONFIG).read_bytes() == stock and tree_state(op) == before


def test_a_tree_with_a_process_table_but_no_process_module_is_refused(tmp_path, bundle):
  """Both files make an openpilot tree: a process_config.py alone (a copy, a half checkout) is not one this installer edits."""
  op = make_openpilot(tmp_path / "op")
  (op / "system/manager/process.py").unlink()
  before = tree_state(op)
  with pytest.raises(UserError, match="is not an openpilot checkout"):
    install(op, bundle, log=quiet)
  assert tree_state(op) == before


def test_an_install_json_of_another_format_is_refused_and_nothing_changes(op, bundle):
  install(op, bundle, log=quiet)
  f = op / INSTALL_REL / "install.json"
  state = json.loads(f.read_text())
  state["format"] = 2
  f.write_text(json.dumps(state))
  before = tree_state(op)
  for act in (lambda: install(op, bundle, log=quiet), lambda: uninstall(op, log=quiet)):
    with pytest.raises(UserError, match="install.json is of format 2, this modeld-msm writes 1"):
      act()
  assert tree_state(op) == before


def test_the_edited_table_keeps_its_permissions(op, bundle):
  t = op / PROCESS_CONFIG
  t.chmod(0o640)
  install(op, bundle, log=quiet)
  assert INSTALL_REL in t.read_text() and t.stat().st_mode & 0o7777 == 0o640
