"""Reading and editing openpilot's process table (release/install.py: find_entry, find_entries, edit_table) on small tables
written here, for both processes install replaces. test_install.py installs into whole checkouts, whose tables are always
well-formed: the layouts it refuses, and the entry's parts, are held here without a bundle."""
from __future__ import annotations

import pytest

from release.install import COMMENT, INSTALL_REL, edit_table, find_entries, find_entry
from selfdrive_glue.errors import UserError

IMPORTS = "from openpilot.system.manager.process import PythonProcess, NativeProcess, DaemonProcess\n"


def _table(*entries: str, imports: str = IMPORTS, after: str = "") -> bytes:
  return (imports + "procs = [\n" + "".join(f"  {e},\n" for e in entries) + "]\n" + after).encode()


@pytest.mark.parametrize("name", ["modeld", "dmonitoringmodeld"])
def test_a_python_entry_gives_its_should_run_and_keywords(name):
  data = _table('NativeProcess("camerad", "system/camerad", ["./camerad"], always_run)',
                f'PythonProcess("{name}", "selfdrive.modeld.{name}", only_onroad, (WEBCAM or not PC), watchdog_max_dt=5)')
  e = find_entry(data, "t.py", name)
  assert (e.name, e.kind, e.ours, e.should_run, e.keywords, e.lineno, e.at_line_start) == \
         (name, "PythonProcess", False, "only_onroad", ["enabled=WEBCAM or not PC", "watchdog_max_dt=5"], 4, True)   # valid Python still
  assert data[e.start:e.end].decode().startswith(f'PythonProcess("{name}"') and data[e.end - 1:e.end] == b")"
  assert data[e.line_start:e.start] == b"  "


def test_a_native_entry_reads_should_run_fourth_or_by_keyword():
  e = find_entry(_table('NativeProcess("modeld", "selfdrive/modeld", ["./modeld"], only_onroad, True, True)'), "t.py", "modeld")
  assert (e.kind, e.should_run, e.keywords, e.ours) == ("NativeProcess", "only_onroad", ["enabled=True", "sigkill=True"], False)
  e = find_entry(_table('PythonProcess("modeld", "m", enabled=False, should_run=driverview)'), "t.py", "modeld")
  assert (e.should_run, e.keywords) == ("driverview", ["enabled=False"])
  e = find_entry(_table(f'NativeProcess("modeld", "{INSTALL_REL}", ["./modeld"], only_onroad)'), "t.py", "modeld")
  assert e.ours


@pytest.mark.parametrize("table,why", [
  (_table('DaemonProcess("modeld", "selfdrive.modeld.modeld", "ModeldPid")'), "is not a PythonProcess or NativeProcess element of `procs`"),
  (_table('PythonProcess("camerad", "c", always_run)', after='extra = [PythonProcess("modeld", "m", only_onroad)]\n'),
   "is not a PythonProcess or NativeProcess element of `procs`"),
  (_table('PythonProcess("modeld", "m", only_onroad)', imports="from openpilot.system.manager.process import PythonProcess\n"),
   "NativeProcess is not imported there"),
  (_table('PythonProcess("modeld", "m")'), "has no should_run"),
  (_table('NativeProcess("modeld", "d", ["./modeld"], only_onroad, True, False, 5.0, 1)'), "has 8 positional arguments"),
  (_table('PythonProcess("modeld", "m", only_onroad)', 'PythonProcess("modeld", "n", only_onroad)'), "found 2 (lines 3, 4)"),
  (_table('PythonProcess("camerad", "c", always_run)'), 'expected exactly one "modeld" process entry, found 0;'),
  (IMPORTS.encode() + b"procs = []\nprocs = []\n", "expected one `procs = [...]` list at module level, found 2"),
  (b"procs = [\n", "does not parse as Python"),
])
def test_layouts_install_does_not_edit_are_refused_by_what_is_wrong(table, why):
  with pytest.raises(UserError, match="edit the process table by hand|fix it first") as e:
    find_entry(table, "t.py", "modeld")
  assert why in str(e.value) and "t.py" in str(e.value), str(e.value)


@pytest.mark.parametrize("imports", ["class NativeProcess:\n  pass\n", "import native as NativeProcess\n",
                                     "def NativeProcess(*a):\n  return a\n"])
def test_nativeprocess_bound_any_way_at_module_level_will_do(imports):
  assert find_entry(_table('PythonProcess("modeld", "m", only_onroad)', imports=imports), "t.py", "modeld").kind == "PythonProcess"


def test_an_annotated_procs_list_is_read_too():
  data = (IMPORTS + 'procs: list = [\n  PythonProcess("modeld", "m", only_onroad),\n]\n').encode()
  assert find_entry(data, "t.py", "modeld").lineno == 3


def test_find_entries_needs_only_the_needed():
  data = _table('PythonProcess("modeld", "m", only_onroad)')
  found = find_entries(data, "t.py", ["modeld"])
  assert found["modeld"] is not None and found["dmonitoringmodeld"] is None
  with pytest.raises(UserError, match='"dmonitoringmodeld" process entry, found 0; the bundle has DM; edit'):
    find_entries(data, "t.py", ["modeld", "dmonitoringmodeld"], {"dmonitoringmodeld": "the bundle has DM"})


def test_edit_replaces_each_entry_and_keeps_every_other_byte():
  data = _table('PythonProcess("modeld", "selfdrive.modeld.modeld", only_onroad)', 'PythonProcess("plannerd", "p", only_onroad)',
                'PythonProcess("dmonitoringmodeld", "selfdrive.modeld.dmonitoringmodeld", driverview, enabled=(WEBCAM or not PC))')
  found = find_entries(data, "t.py", ["modeld", "dmonitoringmodeld"])
  new = edit_table(data, [found["dmonitoringmodeld"], found["modeld"]])   # any order
  want = _table(
    COMMENT.format(name="modeld", rel=INSTALL_REL).rstrip("\n") + f'\n  NativeProcess("modeld", "{INSTALL_REL}", ["./modeld"], only_onroad)',
    'PythonProcess("plannerd", "p", only_onroad)',
    COMMENT.format(name="dmonitoringmodeld", rel=INSTALL_REL).rstrip("\n")
    + f'\n  NativeProcess("dmonitoringmodeld", "{INSTALL_REL}", ["./dmonitoringmodeld"], driverview, enabled=(WEBCAM or not PC))')
  assert new == want, new.decode()
  again = find_entries(new, "t.py", ["modeld", "dmonitoringmodeld"])
  assert again["modeld"].ours and again["dmonitoringmodeld"].ours and again["dmonitoringmodeld"].keywords == ["enabled=(WEBCAM or not PC)"]


def test_an_entry_sharing_its_line_is_replaced_in_place():
  data = (IMPORTS + 'procs = [PythonProcess("camerad", "c", always_run), PythonProcess("modeld", "m", only_onroad)]\n').encode()
  e = find_entry(data, "t.py", "modeld")
  assert not e.at_line_start
  assert edit_table(data, [e]) == (IMPORTS + 'procs = [PythonProcess("camerad", "c", always_run), '
                                   f'NativeProcess("modeld", "{INSTALL_REL}", ["./modeld"], only_onroad)]\n').encode()


def test_ours_is_the_native_entry_running_from_our_folder_however_its_arguments_are_passed():
  ours = find_entry(_table(f'NativeProcess("modeld", "{INSTALL_REL}", cmdline=["./modeld"], should_run=only_onroad)'), "t.py", "modeld")
  assert ours.ours and ours.should_run == "only_onroad" and ours.keywords == ['cmdline=["./modeld"]']
  other = find_entry(_table('NativeProcess("modeld", cwd="selfdrive/modeld", cmdline=["./modeld"], should_run=only_onroad)'), "t.py", "modeld")
  assert not other.ours
