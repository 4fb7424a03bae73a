"""Install a release bundle into an openpilot checkout so that openpilot's manager runs this modeld (and this
dmonitoringmodeld, when the bundle carries driver-monitoring artifacts), and undo it.

What `install OPENPILOT_DIR --bundle DIR` does (all of it recorded in third_party/modeld_msm/install.json; every path below is
relative to the folder holding system/manager/process_config.py: the checkout itself for 0.10/0.11, its `openpilot/` package
for master after its tree moved there, the manager's BASEDIR either way):
  third_party/modeld_msm/artifacts/     a copy of the bundle, verified before and after copying
  third_party/modeld_msm/modeld         the launcher the manager runs as modeld (below)
  third_party/modeld_msm/dmonitoringmodeld   the same for dmonitoringmodeld, only when the bundle has driver-monitoring
                                        artifacts (bundle.json "dmonitoring": camera -> entry, artifacts in dmonitoring/<camera>/)
  third_party/modeld_msm/process_config.py.orig   the process table as it was, byte for byte
  system/manager/process_config.py      its one modeld entry (and its one dmonitoringmodeld entry, with such a bundle),
                                        whatever its form, becomes
      NativeProcess("modeld", "third_party/modeld_msm", ["./modeld"], <the stock should_run>, <the stock keywords>)
and `uninstall` puts process_config.py back byte for byte and removes third_party/modeld_msm (and third_party, if
install created it). A bundle without driver-monitoring artifacts leaves openpilot's dmonitoringmodeld as it is; one
installed over a bundle with them puts it back.

Why a launcher and not `PythonProcess("modeld", "modeld_msm.modeld", ...)`: openpilot's launch script sets
PYTHONPATH to the checkout, whose root holds `tinygrad -> tinygrad_repo/tinygrad`, so `import tinygrad` there is
openpilot's vendored tinygrad, not the pinned 0.14.0 this modeld's QCOM backend and artifacts are built for. And a
PythonProcess is forked from the manager, which has already imported that tinygrad while preimporting the stock
dmonitoringmodeld. The launcher is openpilot's own idiom for a process with its own runtime (modeld was once
`NativeProcess("modeld", "selfdrive/modeld", ["./modeld"], ...)` with a shell script there, dmonitoringmodeld likewise):
it execs the interpreter modeld-msm is installed in, `python -m modeld_msm.modeld` (`modeld_msm.dmonitoringmodeld`),
with this package's source root as PYTHONPATH and the installed bundle as MODELD_ARTIFACT, so the process is the same
module as `python -m modeld_msm.modeld` anywhere else. The manager still starts and stops each one when the stock
entry's should_run says, SIGINT then SIGKILL, as for the stock process.
"""
from __future__ import annotations

import ast
import difflib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import modeld_msm
from artifact import kinds
from artifact.format import swap_in_dir
from artifact.signing import SignatureError, key_id, load_public
from release.bundle import BUNDLE_FILE, bundle_files, check_no_links, files_digest, human_size, sha256_bytes, tree_digest, verify_bundle
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import write_atomic

PROCESS_CONFIG = Path("system/manager/process_config.py")
PROCESS_PY = Path("system/manager/process.py")
INSTALL_REL = "third_party/modeld_msm"
STATE, ORIGINAL, BUNDLE_DIR, PUBKEY = "install.json", "process_config.py.orig", "artifacts", "modeld-msm.pub"
# the processes install may replace; each runs from a launcher of its name that execs `python -m modeld_msm.<name>`
MODELD, DMONITORING = "modeld", "dmonitoringmodeld"
PROCESSES = (MODELD, DMONITORING)
DM_KEY = "dmonitoring"   # bundle.json: camera -> entry of the driver-monitoring artifacts, at <bundle>/dmonitoring/<camera>/
STATE_FORMAT = 1   # install.json without "replaced" (before driver monitoring) means modeld alone was replaced
ENTRY_KINDS = ("PythonProcess", "NativeProcess")
# positional parameters after should_run, the same for both classes in openpilot's process.py
EXTRA_POSITIONAL = ("enabled", "sigkill", "watchdog_max_dt")
COMMENT = "# modeld-msm: the vamOS (MSM render node) {name}; changes recorded in {rel}/install.json, `modeld-msm uninstall` undoes them\n"
LAYOUT_HINT = "edit the process table by hand (see README: On the car) or report the layout"


@dataclass
class Entry:
  """One process entry of the table (modeld or dmonitoringmodeld): where it is (byte offsets) and what it says."""
  name: str
  start: int
  end: int
  line_start: int
  lineno: int
  kind: str
  ours: bool
  should_run: str
  keywords: list[str]
  at_line_start: bool

  def replacement(self) -> str:
    rest = "".join(f", {k}" for k in self.keywords)
    return f'NativeProcess("{self.name}", "{INSTALL_REL}", ["./{self.name}"], {self.should_run}{rest})'


# openpilot master moved its tree under an `openpilot/` package (docs/openpilot-master-and-dm.md §B.1): the process table is then
# openpilot/system/manager/process_config.py, and the manager's BASEDIR (which NativeProcess paths are relative to) is that
# package folder, the one holding system/. Everything here is relative to that folder, whichever layout it is.
PREFIXED = Path("openpilot")


def check_openpilot(root: Path) -> Path:
  """-> the folder holding system/manager/process_config.py: the checkout itself, or its `openpilot/` package (master)."""
  if not root.is_dir():
    raise UserError(f"{root} is not a directory; pass the openpilot checkout (e.g. /data/openpilot)")
  if (root / PREFIXED / PROCESS_CONFIG).is_file() and (root / PREFIXED / PROCESS_PY).is_file() and not (root / PROCESS_CONFIG).is_file():
    return root / PREFIXED
  if not (root / PROCESS_CONFIG).is_file() or not (root / PROCESS_PY).is_file():
    if (root / "selfdrive/manager/process_config.py").is_file():
      raise UserError(f"{root} is an openpilot older than 0.9 (its process table is selfdrive/manager/process_config.py); "
                      f"this installer edits {PROCESS_CONFIG}: use openpilot 0.10 or newer")
    raise UserError(f"{root} is not an openpilot checkout (no {PROCESS_CONFIG} and {PROCESS_PY}, nor under {PREFIXED}/); pass the "
                    "openpilot directory, e.g. /data/openpilot")
  return root


def layout_name(top: Path, base: Path) -> str:
  return (f"{PREFIXED}/ package layout (openpilot master since its tree moved): {PREFIXED / PROCESS_CONFIG}" if base != top else
          f"root-level layout (openpilot 0.10, 0.11): {PROCESS_CONFIG}")


def find_entry(data: bytes, where: str, name: str, why: str = "") -> Entry:
  """The one `name` entry of the `procs` list, or a UserError saying why the layout is not one this installer edits
  (`why`: why this entry must be there, said before the hint)."""
  hint = f"{why}; {LAYOUT_HINT}" if why else LAYOUT_HINT
  try:
    tree = ast.parse(data)
  except SyntaxError as e:
    raise UserError(f"{where} does not parse as Python ({e.msg}, line {e.lineno}); fix it first") from None
  procs = [n.value for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign) and isinstance(n.value, ast.List)
           and any(isinstance(t, ast.Name) and t.id == "procs" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
  if len(procs) != 1:
    raise UserError(f"unknown process-table layout in {where}: expected one `procs = [...]` list at module level, found {len(procs)}; {hint}")
  calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _func_name(n).endswith("Process") and n.args
           and isinstance(n.args[0], ast.Constant) and n.args[0].value == name]
  if len(calls) != 1:
    lines = ", ".join(str(c.lineno) for c in calls)
    raise UserError(f"unknown process-table layout in {where}: expected exactly one \"{name}\" process entry, found {len(calls)}"
                    + (f" (lines {lines})" if calls else "") + f"; {hint}")
  call = calls[0]
  kind = _func_name(call)
  if call not in procs[0].elts or kind not in ENTRY_KINDS:
    raise UserError(f"unknown process-table layout in {where}: the {name} entry (line {call.lineno}) is not a PythonProcess or "
                    f"NativeProcess element of `procs`; {hint}")
  if not _binds(tree, "NativeProcess"):
    raise UserError(f"unknown process-table layout in {where}: NativeProcess is not imported there; {hint}")
  starts = _line_starts(data)
  span = lambda n: (starts[n.lineno - 1] + n.col_offset, starts[(n.end_lineno or n.lineno) - 1] + (n.end_col_offset or 0))  # noqa: E731
  seg = lambda n: data[slice(*span(n))].decode()  # noqa: E731
  pos = 2 if kind == "PythonProcess" else 3
  should_run = [seg(call.args[pos])] if len(call.args) > pos else [seg(k.value) for k in call.keywords if k.arg == "should_run"]
  if not should_run:
    raise UserError(f"unknown process-table layout in {where}: the {name} entry (line {call.lineno}) has no should_run; {hint}")
  extra = call.args[pos + 1:]
  if len(extra) > len(EXTRA_POSITIONAL):
    raise UserError(f"unknown process-table layout in {where}: the {name} entry (line {call.lineno}) has {len(call.args)} positional "
                    f"arguments; {hint}")
  keywords = [f"{kw}={seg(a)}" for kw, a in zip(EXTRA_POSITIONAL, extra)]
  keywords += [seg(k) for k in call.keywords if k.arg != "should_run"]   # as written: `enabled=(WEBCAM or not PC)` keeps its parentheses
  ours = kind == "NativeProcess" and len(call.args) > 1 and isinstance(call.args[1], ast.Constant) and call.args[1].value == INSTALL_REL
  line_start, (start, end) = starts[call.lineno - 1], span(call)
  return Entry(name, start, end, line_start, call.lineno, kind, ours, should_run[0], keywords, not data[line_start:start].strip())


def find_entries(data: bytes, where: str, needed: list[str], why: dict[str, str] | None = None) -> dict[str, Entry | None]:
  """The entries of PROCESSES: those `needed` must each be there once, in a form this installer edits (else the
  UserError of find_entry); the others are None where the table has no such entry, or not one find_entry reads."""
  found: dict[str, Entry | None] = {}
  for name in PROCESSES:
    try:
      found[name] = find_entry(data, where, name, (why or {}).get(name, ""))
    except UserError:
      if name in needed:
        raise
      found[name] = None
  return found


def _names(names) -> str:
  return " and ".join(n for n in PROCESSES if n in names)


def _func_name(call: ast.Call) -> str:
  f = call.func
  return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _binds(tree: ast.Module, name: str) -> bool:
  for n in tree.body:
    if isinstance(n, ast.ImportFrom | ast.Import) and any((a.asname or a.name) == name for a in n.names):
      return True
    if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == name:
      return True
  return False


def _line_starts(data: bytes) -> list[int]:
  # ast columns are UTF-8 byte offsets, so the file is edited as bytes: everything outside the entry stays as it was
  starts, pos = [], 0
  for line in data.splitlines(keepends=True):
    starts.append(pos)
    pos += len(line)
  return starts + [pos]


def edit_table(data: bytes, entries: list[Entry]) -> bytes:
  """`data` with each entry (found in `data`) replaced by ours; from the last one back, so the offsets still hold."""
  for e in sorted(entries, key=lambda e: e.start, reverse=True):
    new = e.replacement().encode()
    if not e.at_line_start:
      data = data[:e.start] + new + data[e.end:]
      continue
    indent = data[e.line_start:e.start]
    data = data[:e.line_start] + indent + COMMENT.format(name=e.name, rel=INSTALL_REL).encode() + indent + new + data[e.end:]
  return data


def unified_diff(old: bytes, new: bytes, rel: Path) -> str:
  return "".join(difflib.unified_diff(old.decode(errors="replace").splitlines(keepends=True), new.decode(errors="replace").splitlines(keepends=True),
                                      f"a/{rel}", f"b/{rel}"))


def source_root() -> Path:
  """The directory holding this package's modules (the checkout for an editable install, else site-packages)."""
  return Path(modeld_msm.__file__).resolve().parents[1]


def launcher_text(python: str, src: Path, pubkey: bool, name: str = MODELD) -> bytes:
  """The launcher the manager runs as `name`: `python -m modeld_msm.<name>` on the installed bundle."""
  lines = [
    "#!/bin/sh",
    "# Written by `modeld-msm install` (what it changed: install.json beside this file; `modeld-msm uninstall` undoes it).",
    "# openpilot's PYTHONPATH makes `tinygrad` its vendored copy; modeld-msm needs the pinned tinygrad it was installed with,",
    "# so it runs in that interpreter with its own source root first on the path.",
    'here="$(cd "$(dirname "$0")" && pwd)"',
    f"export PYTHONPATH={shlex.quote(str(src))}",
    f'export MODELD_ARTIFACT="$here/{BUNDLE_DIR}"',
  ]
  if pubkey:
    lines.append(f'export MODELD_PUBKEY="$here/{PUBKEY}"   # refuse artifacts not signed by the release key')
  lines.append(f'exec {shlex.quote(python)} -m modeld_msm.{name} "$@"')
  return ("\n".join(lines) + "\n").encode()


def _check_interpreter(python: str, src: Path, names: list[str]) -> None:
  """The launchers' interpreter must import these processes' modules and the pinned tinygrad from outside the openpilot tree."""
  modules = [f"modeld_msm.{n}" for n in names]
  code = f"import backend, {', '.join(modules)}; backend.check_tinygrad()"
  env = {**os.environ, "PYTHONPATH": str(src)}
  try:
    r = subprocess.run([python, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=120)
  except OSError as e:
    raise UserError(f"cannot run {python} ({e.strerror}); pass --python with the interpreter modeld-msm is installed in") from None
  if r.returncode != 0:
    last = (r.stderr.strip().splitlines() or ["no output"])[-1]
    raise UserError(f"{python} cannot import {' and '.join(modules)} with its pinned tinygrad ({last}); "
                    "install modeld-msm into it (`pip install -e .` in the checkout) or pass --python")


def read_state(root: Path) -> dict[str, Any] | None:
  d = root / INSTALL_REL
  if not d.exists():
    return None
  try:
    state = json.loads((d / STATE).read_text())
  except FileNotFoundError:
    raise UserError(f"{d} exists but was not written by `modeld-msm install` (no {STATE}); move it away and try again") from None
  except ValueError as e:
    raise UserError(f"{d / STATE} is unreadable ({e}); restore {PROCESS_CONFIG} with `git checkout`, remove {d}, then install again") from None
  if not _state_shape_ok(state):
    raise UserError(f"{d / STATE} is not of the shape `modeld-msm install` writes (edited?); restore {PROCESS_CONFIG} with `git checkout`, "
                    f"remove {d}, then install again")
  if state.get("format") != STATE_FORMAT:
    raise UserError(f"{d / STATE} is of format {state.get('format')}, this modeld-msm writes {STATE_FORMAT}; uninstall with the "
                    "modeld-msm that installed it")
  return state


def _state_shape_ok(state: Any) -> bool:
  """install.json as install writes it, field by field where install and uninstall read it (JSON from disk is checked
  before use: a wrong shape is one line, not a traceback halfway through an uninstall)."""
  if not isinstance(state, dict):
    return False
  pc, bundle = state.get("process_config"), state.get("bundle")
  if not isinstance(pc, dict) or not isinstance(bundle, dict):
    return False
  replaced = pc.get("replaced", {MODELD: pc})
  return (all(isinstance(pc.get(k), str) for k in ("original_sha256", "installed_sha256"))
          and isinstance(replaced, dict) and all(n in PROCESSES and isinstance(r, dict) for n, r in replaced.items())
          and isinstance(bundle.get("digest"), str) and isinstance(bundle.get("source"), str) and isinstance(bundle.get("bytes"), int)
          and isinstance(state.get("created_dirs", []), list) and all(isinstance(c, str) and ".." not in Path(c).parts and not Path(c).is_absolute()
                                                                    for c in state.get("created_dirs", []))
          and isinstance(state.get("pubkey") or "", str))


def installed_pubkey(root: Path, state: dict[str, Any] | None, pubkey: str | os.PathLike | None, drop_pubkey: bool) -> tuple[Path | None, bool]:
  """The public key this install checks the bundle with and installs, and whether it is the one an earlier install left.

  A key once installed stays until the user drops it by name: an install without --pubkey is most often just a new
  bundle, and quietly turning signature checking off on the car for it would undo what the first install asked for."""
  if pubkey is not None and drop_pubkey:
    raise UserError("--pubkey and --drop-pubkey exclude each other; pass --pubkey KEY to require that key, or --drop-pubkey alone "
                    "to turn signature checking off")
  if pubkey is not None:
    return Path(pubkey), False
  if state is None or not state.get("pubkey") or drop_pubkey:
    return None, False
  kept = root / INSTALL_REL / PUBKEY
  if not kept.is_file():
    raise UserError(f"{INSTALL_REL}/{STATE} says modeld checks signatures with {kept}, but that file is gone; pass --pubkey KEY to "
                    "install the release key again, or --drop-pubkey to turn signature checking off")
  return kept, True


def replaced_entries(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Process name -> {stock_entry, entry, line} of each entry the install replaced. An install.json written before
  driver monitoring has no "replaced": it replaced modeld alone, recorded at the top of "process_config"."""
  pc = state["process_config"]
  if "replaced" in pc:
    return dict(pc["replaced"])
  return {MODELD: {k: pc.get(k) for k in ("stock_entry", "entry", "line")}}


def _saved_original(d: Path) -> bytes:
  try:
    return (d / ORIGINAL).read_bytes()
  except FileNotFoundError:
    raise UserError(f"{d / ORIGINAL}, the process table as it was before the install, is gone; restore {PROCESS_CONFIG} with "
                    f"`git checkout`, remove {d}, then install again") from None


def _ours(found: dict[str, Entry | None]) -> set[str]:
  return {n for n, e in found.items() if e is not None and e.ours}


def _table_mismatch(prev: set[str], ours: set[str]) -> str:
  """How the entries the table runs from INSTALL_REL differ from those install.json says were replaced ("" if they do not)."""
  back, extra, still = prev - ours, ours - prev, ours & prev
  parts = ([f"runs the stock {_names(back)} again"] if back else []) + \
          ([f"runs {INSTALL_REL} as {_names(extra)}, which {STATE} does not record"] if extra else [])
  if not parts:
    return ""
  return (f"{INSTALL_REL}/{STATE} says modeld-msm replaced {_names(prev)}, but {PROCESS_CONFIG} {' and '.join(parts)}"
          + (f" while {_names(still)} still runs {INSTALL_REL}" if still else "") + " (put back by hand, or by an update or a checkout?)")


def _edit(table: bytes, found: dict[str, Entry | None], names: list[str]) -> tuple[bytes, dict[str, dict[str, Any]]]:
  """`table` with the entries `names` replaced by ours, and what install.json records of each (replaced_entries)."""
  entries = [entry for n in names if (entry := found[n]) is not None]
  return edit_table(table, entries), {e.name: {"stock_entry": table[e.start:e.end].decode(), "entry": e.replacement(), "line": e.lineno}
                                      for e in entries}


def install(openpilot: str | os.PathLike, bundle: str | os.PathLike, python: str | None = None, allow_cpu: bool = False,
            pubkey: str | os.PathLike | None = None, dry_run: bool = False, log=print, drop_pubkey: bool = False) -> str:
  """-> "installed", "updated" (another bundle or launcher), "unchanged", or "dry run".

  modeld is replaced, and dmonitoringmodeld too when the bundle has driver-monitoring artifacts (else it stays, or goes
  back to, openpilot's own). Without `pubkey`, a key installed before is kept (the bundle must pass it); `drop_pubkey`
  removes it."""
  top, bundle = Path(openpilot).resolve(), Path(bundle).resolve()
  root = check_openpilot(top)
  state = read_state(root)
  pubkey, kept = installed_pubkey(root, state, pubkey, drop_pubkey)
  try:
    b = verify_bundle(bundle, pubkey=pubkey, smoke=None)
  except SignatureError as e:
    if not kept:
      raise
    why = str(e).split(";")[0]
    raise UserError(f"modeld-msm in {root} requires artifacts signed by key {key_id(load_public(str(pubkey)))} ({pubkey}, kept from an earlier "
                    f"`install --pubkey`), and bundle {bundle} fails that check ({why}); sign it with that key (`modeld-msm sign`), "
                    "pass --pubkey for another key, or --drop-pubkey to turn signature checking off") from None
  if b.device != "QCOM" and not allow_cpu:
    raise UserError(f"bundle {bundle} is for {b.device}; the car runs QCOM bundles (`modeld-msm release --device QCOM`); "
                    "pass --allow-cpu to install a CPU bundle anyway (openpilot on a PC)")
  contracts = sorted({a.kind for a in b.artifacts.values()})
  log(f"openpilot: {layout_name(top, root)}; driving model contract: " + ", ".join(kinds.KINDS[k].contract for k in contracts))
  dm = b.dm_cameras   # bundle.json "dmonitoring", its shape checked by read_index
  wanted = [MODELD] + ([DMONITORING] if dm else [])
  needed_why = {DMONITORING: f"bundle {bundle} has driver-monitoring artifacts (bundle.json \"{DM_KEY}\"), so install replaces that "
                             "entry too (or install a bundle without them)"}
  dropping = drop_pubkey and state is not None and bool(state.get("pubkey"))
  table = root / PROCESS_CONFIG
  data = table.read_bytes()
  found = find_entries(data, str(PROCESS_CONFIG), wanted, needed_why)
  ours = _ours(found)
  prev = replaced_entries(state) if state is not None else {}
  d = root / INSTALL_REL
  if state is None and ours:
    raise UserError(f"{PROCESS_CONFIG} already runs {INSTALL_REL} as {_names(ours)} but {INSTALL_REL}/{STATE} is gone; restore the table "
                    f"with `git -C {root} checkout {PROCESS_CONFIG}` and install again")
  if mismatch := _table_mismatch(set(prev), ours):
    raise UserError(f"{mismatch}; " + (f"run `modeld-msm uninstall {root}`, then install again" if not ours else
                    f"restore the table with `git -C {root} checkout {PROCESS_CONFIG}` (or put {d / ORIGINAL} back), run "
                    f"`modeld-msm uninstall {root}`, then install again"))
  original = _saved_original(d) if state is not None else data
  if state is None:
    new_table, records = _edit(data, found, wanted)
  elif set(wanted) == set(prev):
    new_table, records = data, prev
  else:
    # a bundle with driver monitoring over one without, or the other way: the table is the saved original, edited anew
    pc = state["process_config"]
    if sha256_bytes(original) != pc["original_sha256"]:
      raise UserError(f"{d / ORIGINAL} does not match the hash in {STATE} (modified?); restore {PROCESS_CONFIG} with git, then remove {d}")
    if sha256_bytes(data) != pc["installed_sha256"]:
      raise UserError(f"{PROCESS_CONFIG} was edited after the install, and this bundle changes which entries run {INSTALL_REL} "
                      f"({_names(prev)} -> {_names(wanted)}), which starts from the saved {ORIGINAL} and would lose that edit; undo the "
                      f"edit, or run `modeld-msm uninstall {root}` and install again")
    new_table, records = _edit(original, find_entries(original, f"{INSTALL_REL}/{ORIGINAL}", wanted, needed_why), wanted)
  python = python or sys.executable
  src = source_root()
  launchers = {n: launcher_text(python, src, pubkey is not None, n) for n in wanted}
  pub_bytes = Path(pubkey).read_bytes() if pubkey is not None else None
  files = bundle_files(b)   # what the signed manifests and bundle.json list: the only files copied
  check_no_links(bundle, files)
  unlisted = sum(len(fs) for _, _, fs in os.walk(bundle)) - len(files)   # os.walk follows no link (a link to / would walk the host)
  digest = files_digest(bundle, files)
  what_bundle = f"{b.device}; {', '.join(b.cameras)}" + (f"; driver monitoring: {', '.join(dm)}" if dm else "")
  if state is not None:
    same = (set(wanted) == set(prev) and state["bundle"]["digest"] == digest
            and all((d / n).is_file() and (d / n).read_bytes() == text for n, text in launchers.items())
            and ((d / PUBKEY).read_bytes() if (d / PUBKEY).exists() else None) == pub_bytes)
    if same:
      log(f"modeld-msm is already installed in {root} with this bundle ({what_bundle}); nothing to do")
      return "unchanged"
  what = "replace the installed bundle with" if state is not None else "copy"
  size = sum((bundle / f).stat().st_size for f in files)
  key_note = (f"keep the installed public key {d / PUBKEY}: every artifact must be signed by it" if kept else
              f"REMOVE the installed public key {d / PUBKEY}: modeld will no longer check artifact signatures" if dropping else "")
  dm_stays = "" if dm else ((f"put openpilot's stock {DMONITORING} back" if DMONITORING in prev else f"leave openpilot's {DMONITORING} as it is")
                            + ": this bundle has no driver-monitoring artifacts")
  if dry_run:
    log(f"dry run, nothing changed. install would:\n  {what} {bundle} ({what_bundle}; {human_size(size)}) -> {d / BUNDLE_DIR}\n  write "
        + ", ".join(f"{d / n} (exec {python} -m modeld_msm.{n})" for n in wanted) + f", {STATE}, {ORIGINAL}"
        + "".join(f"\n  {note}" for note in (dm_stays, key_note) if note))
    diff = unified_diff(data, new_table, PROCESS_CONFIG)
    log(diff if diff else f"  leave {PROCESS_CONFIG} as it is (it already runs {INSTALL_REL} as {_names(wanted)})")
    return "dry run"
  _check_interpreter(python, src, wanted)
  _remove_leftovers(root)
  created = [] if (root / "third_party").exists() else ["third_party"]
  (root / "third_party").mkdir(exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=".modeld_msm.tmp-", dir=root / "third_party"))
  try:
    log(f"copying the bundle ({human_size(size)}) into {d / BUNDLE_DIR}"
        + (f"; {unlisted} file(s) in {bundle} that no manifest or {BUNDLE_FILE} lists are left out" if unlisted > 0 else ""))
    copy_files(bundle, files, tmp / BUNDLE_DIR)
    verify_bundle(tmp / BUNDLE_DIR, device=b.device, pubkey=pubkey, smoke=None)
    if tree_digest(tmp / BUNDLE_DIR) != digest:
      raise UserError(f"the copy of {bundle} differs from it (was the bundle written to during the copy?); try again")
    (tmp / ORIGINAL).write_bytes(original)
    for n, text in launchers.items():
      (tmp / n).write_bytes(text)
      os.chmod(tmp / n, 0o755)
    if pub_bytes is not None:
      (tmp / PUBKEY).write_bytes(pub_bytes)
    new_state = {
      "format": STATE_FORMAT, "installed_unix": int(time.time()), "openpilot": str(root),
      "python": python, "source_root": str(src), "created_dirs": state["created_dirs"] if state else created,
      "process_config": {"path": str(PROCESS_CONFIG), "original_sha256": sha256_bytes(original), "installed_sha256": sha256_bytes(new_table),
                         **records[MODELD],   # stock_entry, entry, line: modeld's, where an install.json before driver monitoring had them
                         "replaced": records},
      "bundle": {"source": str(bundle), "device": b.device, "cameras": b.cameras, DM_KEY: dm, "digest": digest, "bytes": size,
                 "bundle_json_sha256": sha256_bytes((bundle / BUNDLE_FILE).read_bytes())},
      "pubkey": PUBKEY if pub_bytes is not None else None,
    }
    (tmp / STATE).write_text(json.dumps(new_state, indent=1))
    swap_in_dir(tmp, d)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    _remove_created(root, created)
    raise
  if new_table != data:
    try:
      write_atomic(table, new_table, table.stat().st_mode & 0o7777)
    except BaseException:
      shutil.rmtree(d, ignore_errors=True)
      _remove_created(root, created)
      raise
    log(unified_diff(data, new_table, PROCESS_CONFIG))
  result = "updated" if state is not None else "installed"
  if dropping:
    log(f"warning: --drop-pubkey: removed the public key from {d}; modeld in {root} now accepts unsigned artifacts "
        "(install again with --pubkey KEY to check signatures)")
  elif kept:
    log(f"kept the installed public key {d / PUBKEY}: modeld accepts only artifacts signed by it (--drop-pubkey removes it)")
  runs = " and ".join(f"{d / n} (python -m modeld_msm.{n}) as {n}" for n in wanted)
  stock_dm = "" if dm else f"; {DMONITORING} is openpilot's own (the bundle has no driver-monitoring artifacts)"
  log(f"modeld-msm {result} in {root}: openpilot's manager runs {runs}, serving {d / BUNDLE_DIR} ({what_bundle}){stock_dm}")
  return result


def uninstall(openpilot: str | os.PathLike, dry_run: bool = False, log=print) -> str:
  """-> "removed", "not installed", or "dry run"."""
  root = check_openpilot(Path(openpilot).resolve())
  state = read_state(root)
  table = root / PROCESS_CONFIG
  data = table.read_bytes()
  if state is None:
    if ours := _ours(find_entries(data, str(PROCESS_CONFIG), [MODELD])):
      raise UserError(f"{PROCESS_CONFIG} runs {INSTALL_REL} as {_names(ours)} but there is no {INSTALL_REL}/{STATE} to undo it from; "
                      f"restore the table with `git -C {root} checkout {PROCESS_CONFIG}`")
    log(f"modeld-msm is not installed in {root}; nothing to do")
    return "not installed"
  d = root / INSTALL_REL
  pc = state["process_config"]
  prev = set(replaced_entries(state))
  original = _saved_original(d)
  if sha256_bytes(original) != pc["original_sha256"]:
    raise UserError(f"{d / ORIGINAL} does not match the hash in {STATE} (modified?); restore {PROCESS_CONFIG} with git, then remove {d}")
  restore = sha256_bytes(data) == pc["installed_sha256"]
  if not restore and (ours := _ours(find_entries(data, str(PROCESS_CONFIG), [MODELD]))):
    if mismatch := _table_mismatch(prev, ours):
      raise UserError(f"{mismatch}, so restoring the saved copy could lose other edits; restore the table with "
                      f"`git -C {root} checkout {PROCESS_CONFIG}` (or put {d / ORIGINAL} back by hand), then run uninstall again")
    raise UserError(f"{PROCESS_CONFIG} was edited after the install, so restoring the saved copy would lose that edit; undo the edit, "
                    f"or put {d / ORIGINAL} back by hand, then run uninstall again")
  if dry_run:
    log(f"dry run, nothing changed. uninstall would:\n  remove {d} (the launchers " + ", ".join(str(d / n) for n in PROCESSES if n in prev)
        + f"; bundle {state['bundle']['source']}, {human_size(state['bundle']['bytes'])})")
    log(unified_diff(data, original, PROCESS_CONFIG) if restore else f"  leave {PROCESS_CONFIG} as it is (it no longer runs {INSTALL_REL})")
    return "dry run"
  if restore:
    write_atomic(table, original, table.stat().st_mode & 0o7777)
    log(unified_diff(data, original, PROCESS_CONFIG))
  else:
    log(f"{PROCESS_CONFIG} no longer runs {INSTALL_REL} (restored by hand or replaced by an update); leaving it as it is")
  _remove_leftovers(root)
  gone = d.parent / f".modeld_msm.removing-{os.getpid()}"
  os.replace(d, gone)   # one rename: the install is gone at once, the files follow
  shutil.rmtree(gone)
  _remove_created(root, state.get("created_dirs", []))
  log(f"modeld-msm removed from {root}: openpilot's manager runs its stock {_names(prev)} again")
  return "removed"


def copy_files(src: Path, rels: list[str], dst: Path) -> None:
  """Copy these files of src (checked by check_no_links) into dst; a link swapped in since is not followed (O_NOFOLLOW)."""
  for rel in rels:
    (dst / rel).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(src / rel, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fin, open(dst / rel, "wb") as fout:
      shutil.copyfileobj(fin, fout, 1 << 20)


def _remove_leftovers(root: Path) -> None:
  """Folders of an earlier install or uninstall killed midway (SIGKILL, power loss): only ours, by their names."""
  tp = root / "third_party"
  for p in [*tp.glob(".modeld_msm.tmp-*"), *tp.glob(".modeld_msm.removing-*")] if tp.is_dir() else []:
    if p.is_dir() and not p.is_symlink():
      shutil.rmtree(p, ignore_errors=True)


def _remove_created(root: Path, created: list[str]) -> None:
  for rel in created:
    try:
      (root / rel).rmdir()   # only if empty: something else may have moved in since
    except OSError:
      pass
