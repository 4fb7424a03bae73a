"""A CPU kernel's THREAD parts run concurrently (artifact/cpu_threads.py), give the bytes the serial loop gives, and an
artifact says how many parts its kernels were split into."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from artifact import cpu_threads

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
  pool = cpu_threads._Pool(n, native=False)
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
  pool = cpu_threads._Pool(2, native=False)
  fxn, seen = _recorder(sleep=0.2)
  t = time.perf_counter()
  pool.run(fxn, [[0], [1]])
  took = time.perf_counter() - t
  assert len(seen) == 2 and took < 0.35, f"two 0.2 s parts took {took:.2f} s: they ran one after another"


def test_pool_hands_a_worker_error_to_the_caller_and_keeps_working():
  pool = cpu_threads._Pool(2, native=False)

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
  from artifact import cpu_threads
  cpu_threads.install("CPU")
Tensor.manual_seed(0)
a, b = Tensor.randn(256, 384).realize(), Tensor.randn(384, 512).realize()
out = (a @ b).relu().contiguous().realize()
runtime = Device["CPU"].runtime_t
launches = cpu_threads._pool.launches if threaded else 0
native = cpu_threads._pool.native is not None if threaded else None
print(json.dumps({"native": native, "out": out.numpy().tobytes().hex(), "a": a.numpy().tolist(), "b": b.numpy().tolist(),
                  "threaded_runtime": bool(getattr(runtime, "_modeld_threaded", False)), "launches": launches}))
"""


def _child(threaded: bool, pool: str = "native") -> dict:
  env = {**os.environ, "NUM_CPU_THREADS": "2", "PYTHONPATH": str(REPO), "MODELD_CPU_POOL": pool}
  r = subprocess.run([sys.executable, "-c", _CHILD, "1" if threaded else "0"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("pool", ["native", "python"])
def test_threaded_kernel_gives_the_serial_bytes(pool):
  """A matmul big enough for tinygrad's THREAD opt: the parts ran on the pool (either hand-off) and wrote what the serial
  loop writes."""
  serial, threaded = _child(False), _child(True, pool)
  assert threaded["threaded_runtime"] and not serial["threaded_runtime"]
  assert threaded["launches"] >= 1, "no kernel was split into parts: the test no longer exercises the pool"
  assert threaded["native"] == (pool == "native")
  assert threaded["out"] == serial["out"]
  want = np.maximum(np.asarray(threaded["a"], np.float32) @ np.asarray(threaded["b"], np.float32), 0)
  got = np.frombuffer(bytes.fromhex(threaded["out"]), np.float32).reshape(want.shape)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.xdist_group("cpu_artifact_1928")
def test_artifact_records_its_thread_count(cpu_artifact_1928):
  meta = json.loads((cpu_artifact_1928 / "metadata.json").read_text())
  assert meta["cpu_threads"] == cpu_threads.count()


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
  """`code` run by a child Python with the repository importable; it must exit 0."""
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                     env={**os.environ, "PYTHONPATH": str(REPO)})
  assert r.returncode == 0, r.stderr
  return r


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 cores and CPU affinity")
def test_workers_leave_the_core_modeld_pinned_itself_to():
  """modeld pins itself to one core like openpilot's realtime processes; a worker that stayed there would only take turns."""
  code = ("import os, threading; from artifact import cpu_threads; os.sched_setaffinity(0, {0})\n"
          "pool = cpu_threads._Pool(2, native=False); seen = {}\n"
          "def part(i): seen[i] = sorted(os.sched_getaffinity(0))\n"
          "pool.run(part, [[0], [1]]); print(seen[0], seen[1])")
  r = _python(code)
  caller, worker = r.stdout.split("] [")
  assert caller == "[0" and "0" not in worker.strip("]\n").split(", ")


_PARTS_C = r"""
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
/* what a kernel part is given: its output row and its part id; it records the thread that ran it */
void part(uint64_t* out, int id) { out[2 * id] = (uint64_t)syscall(SYS_gettid); out[2 * id + 1] += 1; }
"""


@pytest.fixture(scope="module")
def part_lib(tmp_path_factory):
  import ctypes
  import shutil
  if shutil.which("clang") is None:
    pytest.skip("needs clang")
  d = tmp_path_factory.mktemp("parts")
  subprocess.run(["clang", "-x", "c", "-O2", "-fPIC", "-shared", "-o", str(d / "parts.so"), "-"], input=_PARTS_C.encode(), check=True)
  lib = ctypes.CDLL(str(d / "parts.so"))
  # the kernel's address in this process, and the library's path for a child, which loads it itself
  return SimpleNamespace(addr=ctypes.cast(lib.part, ctypes.c_void_p).value, path=d / "parts.so")


@pytest.mark.parametrize("n, parts", [(2, 2), (2, 5), (3, 3), (3, 8)])
def test_native_pool_runs_every_part_once_on_its_lane(part_lib, n, parts):
  """The C hand-off: part k on lane k % n (lane 0 the calling thread), each once, over many kernels in a row."""
  pool = cpu_threads._Pool(n, native=True)
  if pool.native is None:
    pytest.skip(pool.native_why)
  out = np.zeros((parts, 2), np.uint64)
  for _ in range(200):
    assert pool.run_native(part_lib.addr, [[out.ctypes.data, p] for p in range(parts)])
  assert (out[:, 1] == 200).all()
  tids = {int(out[p, 0]) for p in range(0, parts, n)}
  assert tids == {threading.get_native_id()}
  lanes = [{int(out[p, 0]) for p in range(k, parts, n)} for k in range(min(n, parts))]
  assert all(len(t) == 1 for t in lanes) and len(set().union(*lanes)) == min(n, parts)
  assert set().union(*lanes[1:]) == {t.native_id for t in pool.threads[:min(n, parts) - 1]}


def test_native_pool_runs_a_kernel_too_big_for_its_lanes_on_the_caller(part_lib):
  """More arguments than a lane carries: the parts run one after another on the calling thread (a C pool's workers
  take no Python work), each once; a kernel that fits still goes to the worker."""
  import ctypes

  from artifact.cpu_pool_native import MAX_ARGS
  pool = cpu_threads._Pool(2, native=True)
  if pool.native is None:
    pytest.skip(pool.native_why)
  fxn = ctypes.CFUNCTYPE(None)(part_lib.addr)
  out = np.zeros((2, 2), np.uint64)
  pool.run_split(part_lib.addr, fxn, [[out.ctypes.data, p] + [0] * (MAX_ARGS - 1) for p in range(2)])
  assert (out[:, 1] == 1).all() and set(out[:, 0].tolist()) == {threading.get_native_id()}
  pool.run_split(part_lib.addr, fxn, [[out.ctypes.data, p] for p in range(2)])
  assert (out[:, 1] == 2).all() and int(out[1, 0]) == pool.threads[0].native_id


def test_native_pool_runs_a_part_handed_over_before_its_worker_started(part_lib):
  """A worker that starts after the caller handed it a part (the pool's threads start concurrently with the first
  kernel) still runs it: it does not take the counter it finds as already seen."""
  import ctypes

  from artifact import cpu_pool_native
  lib = cpu_pool_native.build()
  size = int(lib.modeld_pool_lane_size())
  lanes = (ctypes.c_char * (2 * size))()
  out = np.zeros((2, 2), np.uint64)
  flat = (ctypes.c_uint64 * (2 * cpu_pool_native.MAX_ARGS))()
  for p in range(2):
    flat[p * cpu_pool_native.MAX_ARGS], flat[p * cpu_pool_native.MAX_ARGS + 1] = out.ctypes.data, p
  caller = threading.Thread(target=lib.modeld_pool_run, args=(lanes, 2, part_lib.addr, flat, 2))
  caller.start()
  time.sleep(0.3)   # the caller has bumped the lane's counter, run its part and now waits
  assert out[0, 1] == 1 and out[1, 1] == 0 and caller.is_alive()
  worker = threading.Thread(target=lib.modeld_pool_worker, args=(ctypes.addressof(lanes) + size,), daemon=True)
  worker.start()
  caller.join(timeout=10)
  assert not caller.is_alive() and out[1, 1] == 1
  lib.modeld_pool_stop(ctypes.addressof(lanes) + size)
  worker.join(timeout=10)
  assert not worker.is_alive()


def test_native_pool_survives_a_storm_of_tiny_kernels(part_lib):
  """100,000 hand-offs of a kernel that returns at once, in a child with a time limit: the counters' races (a finished
  part seen between two loads of its counter) would leave caller and worker asleep waiting on each other."""
  code = ("import ctypes, sys, numpy as np; from artifact import cpu_threads; pool = cpu_threads._Pool(2, native=True)\n"
          "assert pool.native is not None, pool.native_why\n"
          f"fn = ctypes.cast(ctypes.CDLL({str(part_lib.path)!r}).part, ctypes.c_void_p).value\n"
          "out = np.zeros((2, 2), np.uint64); args = [[out.ctypes.data, 0], [out.ctypes.data, 1]]\n"
          "for _ in range(100000): pool.run_native(fn, args)\n"
          "print(int(out[0, 1]), int(out[1, 1]))")
  assert _python(code, timeout=120).stdout.split() == ["100000", "100000"]


def test_python_pool_when_asked(monkeypatch):
  monkeypatch.setattr(cpu_threads, "_POOL", "python")
  pool = cpu_threads._Pool(2)
  assert pool.native is None and "MODELD_CPU_POOL=python" in pool.native_why
  fxn, seen = _recorder()
  pool.run(fxn, [[0], [1]])
  assert sorted(p for p, _ in seen) == [0, 1]
