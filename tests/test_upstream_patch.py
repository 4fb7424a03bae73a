"""upstream/patches/: the MSM series against tinygrad 0.14.0's own QCOM driver, applied to a copy of the installed package
and run on the emulated render node in child Pythons, bit for bit against our patched-from-outside path (backend/qcom.py).

A child imports the patched copy ahead of site-packages (PYTHONPATH); `backend.install()` finds its MSMIface and leaves the
driver alone (our runtime patching is off: backend.qcom is never imported), adding only the EMU node behind it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "upstream_child.py"
_spec = importlib.util.spec_from_file_location("upstream_series", ROOT / "upstream" / "series.py")
series = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(series)  # type: ignore[union-attr]
EMU_ENV = {"DEV": "EMU+QCOM:IR3", "EMU_EXEC": "1", "EMU_STRICT": "1", "HCQDEV_WAIT_TIMEOUT_MS": "1800000"}


def _run(args: list[str], pythonpath: Path | None = None, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
  e = {**os.environ, **env}
  e.pop("PYTHONPATH", None)
  if pythonpath is not None:
    e["PYTHONPATH"] = str(pythonpath)
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=e)


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
  """A copy of the installed tinygrad 0.14.0 with the whole series applied (the folder holding `tinygrad/`)."""
  return series.apply(tmp_path_factory.mktemp("tinygrad_patched") / "site")


IMPORT = ("import tinygrad.runtime.ops_qcom as q, sys; assert q.__file__.startswith(sys.argv[1]), q.__file__; "
          "print(sorted(i.__name__ for i in getattr(q.QCOMDevice, 'ifaces', [])))")


def test_each_patch_applies_on_a_pristine_copy_and_stands_alone(tmp_path):
  ps = series.patches()
  assert len(ps) == 3
  want = ["[]", "['KGSLIface']", "['KGSLIface', 'MSMIface']"]
  for n in (1, 2, 3):
    site = series.apply(tmp_path / f"p{n}", upto=n)
    r = _run(["-c", IMPORT, str(site)], pythonpath=site)
    assert r.returncode == 0 and r.stdout.strip() == want[n - 1], (n, r.stdout, r.stderr[-2000:])
  touched = {f for p in ps for f in re.findall(r"^diff --git a/(\S+) ", p.read_text(), re.M)}
  assert touched == {"tinygrad/runtime/ops_qcom.py", series.AUTOGEN}
  src = (tmp_path / "p3" / "tinygrad/runtime/ops_qcom.py").read_text()
  assert max(len(line) for line in src.splitlines()) <= 150   # tinygrad's line width


def test_patch_1_leaves_no_gpu_address_used_as_a_cpu_pointer(tmp_path):
  """Patch 1 by what it removes: no CPU write (to_mv, memset) through a GPU address (va_addr, gpuaddr) in the driver."""
  def gpu_pointer_writes(src: str) -> list[str]:
    return [line.strip() for line in src.splitlines() if re.search(r"(to_mv|memset)\([^)]*(\.va_addr|gpuaddr)", line)]
  pristine = (series.installed_tinygrad() / "tinygrad/runtime/ops_qcom.py").read_text()
  assert len(gpu_pointer_writes(pristine)) >= 5   # what 0.14.0 does (the CPU and GPU address coincide on KGSL)
  assert gpu_pointer_writes((series.apply(tmp_path / "p1", upto=1) / "tinygrad/runtime/ops_qcom.py").read_text()) == []


def test_kgsl_path_is_unchanged_by_the_series(patched, tmp_path):
  """Stock 0.14.0 and the patched driver on the same recording /dev/kgsl-3d0 (tests/kgsl_record.py): the same ioctls with
  the same arguments (the device's first ones may come in another order: patch 2 opens the context before allocating), the
  same command bytes in every GPU_COMMAND, and the same bytes in every GPU object at the end."""
  record = str(ROOT / "tests" / "kgsl_record.py")
  ra = _run([record, str(tmp_path / "stock.json")], DEV="QCOM:IR3")
  rb = _run([record, str(tmp_path / "patched.json")], pythonpath=patched, DEV="QCOM:IR3")
  assert ra.returncode == 0 and rb.returncode == 0, ra.stderr[-2000:] + rb.stderr[-2000:]
  a, b = (json.loads((tmp_path / f).read_text()) for f in ("stock.json", "patched.json"))
  assert b["iface"] == "KGSLIface"   # tried first: with /dev/kgsl-3d0 there, MSM is never opened
  init = 9   # open-time ioctls: three GPUOBJ_ALLOC + mmap, DRAWCTXT_CREATE, SETPROPERTY, DEVICE_GETPROPERTY
  assert sorted(map(str, a["log"][:init])) == sorted(map(str, b["log"][:init]))
  assert a["log"][init:] == b["log"][init:] and sum(e[0] == "GPU_COMMAND" for e in a["log"]) >= 3
  assert a["memory"] == b["memory"] and len(a["memory"]) > 10


def test_msm_uapi_of_the_series_is_generated_from_backend_uapi(monkeypatch, tmp_path):
  assert series.check() == []
  from backend import uapi
  monkeypatch.setattr(uapi, "MSM_BO_WC", uapi.MSM_BO_CACHED)   # our backend's layouts change: the series is now stale
  assert series.check() and "backend/uapi.py" in series.check()[0]
  monkeypatch.undo()
  for p in series.patches():   # the series edited by hand: caught the same way
    text = p.read_text()
    (tmp_path / p.name).write_text(text.replace("MSM_SUBMIT_NO_IMPLICIT = 0x80000000", "MSM_SUBMIT_NO_IMPLICIT = 0x40000000"))
  monkeypatch.setattr(series, "PATCHES", tmp_path)
  assert series.check()


def test_install_uses_the_patched_driver_and_patches_nothing(patched):
  code = ("import sys, backend; backend.install(); from tinygrad import Device; d = Device['QCOM']; "
          "import tinygrad.runtime.ops_qcom as q; print(type(d) is q.QCOMDevice, isinstance(d.iface, q.MSMIface), "
          "q.QCOMDevice.__module__, 'backend.qcom' in sys.modules, q.__file__.startswith(sys.argv[1]))")
  r = _run(["-c", code, str(patched)], pythonpath=patched, **{**EMU_ENV, "EMU_EXEC": "0"})
  assert r.returncode == 0 and r.stdout.split() == ["True", "True", "tinygrad.runtime.ops_qcom", "False", "True"], r.stdout + r.stderr[-3000:]
  r = _run(["-c", "import backend; backend.install(); from tinygrad import Device; Device['QCOM']"], pythonpath=patched, DEV="QCOM:IR3")
  assert r.returncode != 0 and "EMU interface is used only when asked" in r.stderr   # never a silent fallback to the emulator


def _compare(a: Path, b: Path) -> list[str]:
  x, y = np.load(a), np.load(b)
  assert sorted(x.files) == sorted(y.files)
  return [k for k in x.files if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape or x[k].tobytes() != y[k].tobytes()]


@pytest.mark.slow
def test_patched_driver_is_bit_exact_with_ours_on_ops_and_core_cases(patched, tmp_path):
  ra = _run([str(CHILD), "ops", str(tmp_path / "patched.npz")], pythonpath=patched, **EMU_ENV)
  assert ra.returncode == 0, ra.stderr[-4000:]
  assert ra.stdout.splitlines()[0] == "driver tinygrad.runtime.ops_qcom EMUIface tinygrad.runtime.ops_qcom" and "DONE False" in ra.stdout
  rb = _run([str(CHILD), "ops", str(tmp_path / "ours.npz")], **EMU_ENV)
  assert rb.returncode == 0, rb.stderr[-4000:]
  assert rb.stdout.splitlines()[0] == "driver backend.qcom EMUIface backend.msm" and "DONE True" in rb.stdout
  assert _compare(tmp_path / "patched.npz", tmp_path / "ours.npz") == []
  got = np.load(tmp_path / "patched.npz")
  x, y, m = (np.random.default_rng(i).standard_normal(s).astype(np.float32) for i, s in ((1, (4, 33)), (2, (4, 33)), (3, (33, 9))))
  assert np.array_equal(got["add"], x + y) and np.allclose(got["matmul"], x @ m, atol=1e-4)   # both computed, not both wrong
  assert list(got["stats"]) == [0, 1, 1]   # strict node: no fault; something was submitted and executed


@pytest.mark.slow
def test_patched_driver_runs_an_artifact_built_today_bit_exact(patched, qcom_artifact, tmp_path):
  ra = _run([str(CHILD), "artifact", str(qcom_artifact), str(tmp_path / "patched.npz")], pythonpath=patched, **EMU_ENV)
  assert ra.returncode == 0 and "driver tinygrad.runtime.ops_qcom EMUIface" in ra.stdout, ra.stdout + ra.stderr[-4000:]
  rb = _run([str(CHILD), "artifact", str(qcom_artifact), str(tmp_path / "ours.npz")], **EMU_ENV)
  assert rb.returncode == 0 and "driver backend.qcom EMUIface" in rb.stdout, rb.stdout + rb.stderr[-4000:]
  assert _compare(tmp_path / "patched.npz", tmp_path / "ours.npz") == []
  got = np.load(tmp_path / "patched.npz")
  assert list(got["faults"]) == [0, 1] and all(np.isfinite(got[k]).all() and np.abs(got[k]).max() > 0 for k in got.files if k.startswith("step_"))
