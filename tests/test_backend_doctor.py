"""`modeld-msm doctor` as a user runs it (a real process)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def doctor(*args, **env):
  e = {k: v for k, v in os.environ.items() if not k.startswith("MSM_") and k not in ("DEV", "EMU_EXEC")}
  return subprocess.run([sys.executable, "-m", "cli.main", "doctor", *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                        env={**e, **env})


def test_doctor_emu_reports_node_and_round_trip():
  r = doctor("--emu", "--rounds", "3", MSM_PRIORITY="1", MSM_CHUNK_KERNELS="16")
  assert r.returncode == 0, r.stdout + r.stderr[-2000:]
  out = r.stdout
  assert "0x06030001 (Adreno 630)" in out and "[0x100000000, 0x200000000)" in out and "priorities             3" in out
  assert "priority 1 (MSM_PRIORITY), chunks of 16 kernels" in out and "3 round trips" in out and "fence 3 retired" in out
  assert "level A" in out and "IR3 execution" not in out


def test_doctor_reports_the_address_mode_and_a_map_round_trip():
  """MODELD_MSM_VM on a node with VM_BIND (EMU_VM_BIND=1) and on one without: the mode chosen, why, and a buffer mapped,
  written by a job and unmapped again with no VA range left behind."""
  def line(out: str, key: str) -> str:
    return next(ln for ln in out.splitlines() if key in ln)
  for env, want in ((dict(EMU_VM_BIND="1"), "VM_BIND: our own addresses"), (dict(EMU_VM_BIND="1", MODELD_MSM_VM="kernel"), "kernel-managed"),
                    (dict(EMU_VM_BIND="0"), "kernel-managed")):
    r = doctor("--emu", "--rounds", "1", **env)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert want in line(r.stdout, "GPU addresses"), r.stdout
    trip = line(r.stdout, "map/submit/unmap")
    assert trip.startswith("[ok") and "the job wrote 42" in trip, trip
    if "VM_BIND" in want:
      assert "UNMAP after its fence" in trip and "(as before)" in trip, trip
  r = doctor("--emu", EMU_VM_BIND="0", MODELD_MSM_VM="bind")
  assert r.returncode == 1 and "MODELD_MSM_VM=bind, but the kernel refused SET_PARAM(EN_VM_BIND)" in r.stdout
  r = doctor("--emu", MODELD_MSM_VM="sometimes")
  assert r.returncode == 1 and "MODELD_MSM_VM='sometimes' is not one of auto, bind, kernel" in r.stdout


def test_doctor_emu_level_b_executes_a_kernel():
  r = doctor("--emu", "--rounds", "1", EMU_EXEC="1")
  assert r.returncode == 0, r.stdout + r.stderr[-2000:]
  assert "level B: executes the IR3 code" in r.stdout
  line = next(ln for ln in r.stdout.splitlines() if "IR3 execution" in ln)
  assert line.startswith("[ok") and "matches numpy" in line, line


def test_doctor_rejects_bad_priority():
  r = doctor("--emu", MSM_PRIORITY="7")
  assert r.returncode == 1 and "MSM_PRIORITY=7 is out of range" in r.stdout


@pytest.mark.skipif(os.path.exists("/dev/kgsl-3d0") or any(Path("/dev/dri").glob("renderD*")), reason="this machine has a GPU node")
def test_doctor_without_gpu_is_unusable():
  r = doctor()
  assert r.returncode == 1 and "run with --emu" in r.stdout and "no /dev/kgsl-3d0" in r.stdout
