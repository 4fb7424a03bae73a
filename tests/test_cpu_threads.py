"""A CPU kernel's THREAD parts run concurrently (compile/cpu_threads.py), give the bytes the serial loop gives, and an
artifact says how many parts its kernels were split into."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from compile import cpu_threads

REPO = Path(__file__).resolve().parents[1]


def _recorder(sleep: float = 0.0):
  seen: list[tuple[int, int]] = []
  lock = threading.Lock()

  def fxn(part_id):
    if sleep:
      time.sleep(sleep)   # releases the GIL like a ctypes call into a kernel does
    with lock:
      seen.append((part_id, threading.get_ident()))
  return fxn, seen


@pytest.mark.parametrize("n, parts", [(2, 2), (2, 5), (3, 2), (4, 4)])
def test_pool_runs_every_part_once_spread_over_its_threads(n, parts):
  pool = cpu_threads._Pool(n)
  fxn, seen = _recorder()
  pool.run(fxn, [[i] for i in range(parts)])
  assert sorted(p for p, _ in seen) == list(range(parts))
  # part k on lane k % n: the caller's lane and each worker's are distinct threads
  lane_thread = {}
  for p, t in seen:
    assert lane_thread.setdefault(p % n, t) == t
  assert len(set(lane_thread.values())) == min(n, parts)
  assert lane_thread[0] == threading.get_ident()


def test_pool_parts_overlap_in_time():
  pool = cpu_threads._Pool(2)
  fxn, seen = _recorder(sleep=0.2)
  t = time.perf_counter()
  pool.run(fxn, [[0], [1]])
  took = time.perf_counter() - t
  assert len(seen) == 2 and took < 0.35, f"two 0.2 s parts took {took:.2f} s: they ran one after another"


def test_pool_hands_a_worker_error_to_the_caller_and_keeps_working():
  pool = cpu_threads._Pool(2)

  def fxn(part_id):
    if part_id == 1:
      raise ValueError("part 1 broke")
  with pytest.raises(ValueError, match="part 1 broke"):
    pool.run(fxn, [[0], [1]])
  fxn2, seen = _recorder()
  pool.run(fxn2, [[0], [1]])
  assert sorted(p for p, _ in seen) == [0, 1]


_CHILD = r"""
import json, sys
import numpy as np
from tinygrad import Tensor, Device
threaded = sys.argv[1] == "1"
if threaded:
  from compile import cpu_threads
  cpu_threads.install("CPU")
Tensor.manual_seed(0)
a, b = Tensor.randn(256, 384).realize(), Tensor.randn(384, 512).realize()
out = (a @ b).relu().contiguous().realize()
runtime = Device["CPU"].runtime_t
launches = cpu_threads._pool.launches if threaded else 0
print(json.dumps({"out": out.numpy().tobytes().hex(), "a": a.numpy().tolist(), "b": b.numpy().tolist(),
                  "threaded_runtime": bool(getattr(runtime, "_modeld_threaded", False)), "launches": launches}))
"""


def _child(threaded: bool) -> dict:
  env = {**os.environ, "NUM_CPU_THREADS": "2", "PYTHONPATH": str(REPO)}
  r = subprocess.run([sys.executable, "-c", _CHILD, "1" if threaded else "0"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout.splitlines()[-1])


def test_threaded_kernel_gives_the_serial_bytes():
  """A matmul big enough for tinygrad's THREAD opt: the parts ran on the pool and wrote what the serial loop writes."""
  serial, threaded = _child(False), _child(True)
  assert threaded["threaded_runtime"] and not serial["threaded_runtime"]
  assert threaded["launches"] >= 1, "no kernel was split into parts: the test no longer exercises the pool"
  assert threaded["out"] == serial["out"]
  want = np.maximum(np.asarray(threaded["a"], np.float32) @ np.asarray(threaded["b"], np.float32), 0)
  got = np.frombuffer(bytes.fromhex(threaded["out"]), np.float32).reshape(want.shape)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.xdist_group("cpu_artifact_1928")
def test_artifact_records_its_thread_count(cpu_artifact_1928):
  meta = json.loads((cpu_artifact_1928 / "metadata.json").read_text())
  assert meta["cpu_threads"] == cpu_threads.count()


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 cores and CPU affinity")
def test_workers_leave_the_core_modeld_pinned_itself_to():
  """modeld pins itself to one core like openpilot's realtime processes; a worker that stayed there would only take turns."""
  code = ("import os, threading; from compile import cpu_threads; os.sched_setaffinity(0, {0}); pool = cpu_threads._Pool(2); seen = {}\n"
          "def part(i): seen[i] = sorted(os.sched_getaffinity(0))\n"
          "pool.run(part, [[0], [1]]); print(seen[0], seen[1])")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                     env={**os.environ, "PYTHONPATH": str(REPO)})
  assert r.returncode == 0, r.stderr
  caller, worker = r.stdout.split("] [")
  assert caller == "[0" and "0" not in worker.strip("]\n").split(", ")
