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
