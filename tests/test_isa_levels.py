"""The CPU code we generate, built for each x86 ISA level the project meets, on whatever CPU runs the suite.

tinygrad's CPU device compiles with -march=native, so a suite run on an AVX-512 box never executes the AVX2 code an AVX2-only
box gets (and the reverse): an AVX2-only EPYC once failed where the AVX-512 box passed. Here the tests that compare the CPU
device's results (test_ir3's conformance against the CPU, the pointwise kernel and its captured JIT) run again in a child
with the CPU device's target pinned to each level (DEV=CPU:CLANG:x86_64,<march>), wherever this CPU can execute it.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cpu_pointwise import MARCH_NEEDS

ROOT = Path(__file__).resolve().parents[1]
# the tests whose expectations hold on every ISA level: CPU results compared only where C and IEEE define them
SELECTION = ["tests/test_ir3.py", "-k", "int32 or int16 or casts or unary or binary or fp16 or division or reductions or matmul",
             "tests/test_cpu_pointwise.py"]


def _flags() -> set[str]:
  if platform.system() != "Linux":
    return set()
  return {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split(":", 1)[1].split()}


@pytest.mark.slow   # ~40 s a level: a child pytest that compiles every kernel again for that level
@pytest.mark.parametrize("march", ["haswell", "skylake-avx512"])
def test_cpu_comparisons_pass_with_code_built_for(march):
  missing = sorted(MARCH_NEEDS[march] - _flags())
  if platform.machine() != "x86_64" or missing:
    pytest.skip(f"this CPU cannot run -march={march} (no {' '.join(missing) or 'x86_64'})")
  env = {**os.environ, "DEV": f"CPU:CLANG:x86_64,{march}", "CACHELEVEL": "0"}   # no kernel from tinygrad's cache of another level
  r = subprocess.run([sys.executable, "-m", "pytest", *SELECTION, "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-p", "no:xdist"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  tail = r.stdout[-3000:]
  assert r.returncode == 0, tail + r.stderr[-2000:]
  assert " passed" in tail and "failed" not in tail, tail


def test_the_child_really_builds_for_the_pinned_level():
  """The pinned target reaches clang: the CPU device's compiler is called with -march=haswell, not native."""
  code = ("from tinygrad import Tensor, Device\n"
          "import numpy as np\n"
          "x = Tensor(np.arange(4096, dtype=np.float32), device='CPU')\n"
          "(x * 2 + 1).realize()\n"
          "print(Device['CPU'].compiler.args)\n")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "DEV": "CPU:CLANG:x86_64,haswell"},
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "-march=haswell" in r.stdout, r.stdout
