"""Reproducible, lean artifacts: the same models, versions and flags give byte-identical files, and the pickles carry no
scratch memory (buffers every JIT writes before reading them)."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from artifact.jit_pickle import _covered, pickle_programs, scratch_buffers, unpickle_programs


def _stateful_jit(seed: int = 0):
  """A small JIT shaped like the driving program: weights, a queue it reads then rewrites, intermediates, an output."""
  from tinygrad import Tensor, TinyJit
  rng = np.random.default_rng(seed)
  w = Tensor(rng.standard_normal((64, 64)).astype(np.float32)).realize()
  queue = Tensor.zeros(4, 64).contiguous().realize()

  @TinyJit
  def step(x):
    h = (x @ w).relu().contiguous()         # intermediates: planned into the arena
    g = (h @ w + h.sum()).contiguous()
    queue.assign(queue[1:].cat(g.reshape(1, 64), dim=0)).realize()
    return (queue.sum(0) * 0.5 + g).contiguous().realize()
  return step, w, queue


def _run(step, xs):
  return [step(x).numpy().copy() for x in xs]


def _inputs(n: int = 5):
  from tinygrad import Tensor
  rng = np.random.default_rng(7)
  return [Tensor(rng.standard_normal((1, 64)).astype(np.float32)).realize() for _ in range(n)]


def test_scratch_is_what_the_jit_writes_before_reading():
  step, w, queue = _stateful_jit()
  xs = _inputs()
  _run(step, xs[:3])   # captured on the 2nd call
  scratch = scratch_buffers(step)
  ids = {id(b) for b in scratch}
  assert id(w.uop.base.realized) not in ids, "weights are read, never written: their bytes must be pickled"
  assert id(queue.uop.base.realized) not in ids, "the queue is read before it is rewritten: its state must be pickled"
  out = step(xs[3])
  assert id(out.uop.base.realized) in ids, "the output is written every call"
  assert sum(b.nbytes for b in scratch) >= 2 * 64 * 4, "the intermediates (arena) are scratch"


def test_scratch_free_pickle_is_smaller_and_replays_bit_exactly():
  step, _, _ = _stateful_jit()
  xs = _inputs(8)
  _run(step, xs[:3])
  plain = pickle.dumps(step)
  (lean,) = pickle_programs(step)
  assert len(plain) - len(lean) >= sum(b.nbytes for b in scratch_buffers(step))
  (plain_jit,), (lean_jit,) = unpickle_programs(plain), unpickle_programs(lean)
  want, got = _run(plain_jit, xs[3:]), _run(lean_jit, xs[3:])
  for a, b in zip(want, got):
    assert np.array_equal(a, b)
  assert not np.array_equal(got[0], got[1]), "the queue carries state from call to call"


def test_same_capture_in_one_process_gives_the_same_bytes():
  """Buffer slots are per-process counters (a second capture gets other numbers) and equal strings may or may not be one
  object: neither may reach the bytes."""
  a, _, _ = _stateful_jit()
  _run(a, _inputs(3))
  b, _, _ = _stateful_jit()
  _run(b, _inputs(3))
  assert pickle.dumps(a) != pickle.dumps(b), "precondition: tinygrad names the second capture's buffers differently"
  assert pickle_programs(a) == pickle_programs(b)


def test_a_backward_pass_earlier_in_the_process_does_not_reach_the_pickle():
  """tinygrad interns uops by value and a backward pass leaves Metadata on the ones it made: a capture afterwards reuses
  them. Training in the same process (modeld-msm train, tests) must not make artifacts unloadable or different."""
  from tinygrad import Tensor
  from tinygrad.helpers import Context
  a, _, _ = _stateful_jit()
  _run(a, _inputs(3))
  before = pickle_programs(a)
  with Context(TRAINING=1):   # the same shapes and ops as the JIT, differentiated
    rng = np.random.default_rng(0)
    w = Tensor(rng.standard_normal((64, 64)).astype(np.float32)).realize()
    x = Tensor(rng.standard_normal((1, 64)).astype(np.float32)).realize()
    h = (x @ w).relu().contiguous()
    (h @ w + h.sum()).sum().backward()
  b, _, _ = _stateful_jit()
  xs = _inputs(5)
  _run(b, xs[:3])
  after = pickle_programs(b)
  assert after == before and b"Metadata" not in after[0]
  (loaded,) = unpickle_programs(*after)
  assert np.array_equal(_run(loaded, xs[3:])[0], _run(b, xs[3:])[0])


def test_shared_buffers_keep_one_name_across_blobs():
  """The policy and warp JITs share queues: one slot table serves both blobs, so they still share after loading."""
  from tinygrad import Tensor, TinyJit
  q = Tensor.zeros(8).contiguous().realize()

  @TinyJit
  def push(x):
    q.assign(q + x).realize()
    return (q * 1).contiguous().realize()

  @TinyJit
  def peek(x):
    return (q * 2 + x * 0).contiguous().realize()
  for _ in range(3):
    push(Tensor.ones(8).contiguous().realize())
    peek(Tensor.ones(8).contiguous().realize())
  push2, peek2 = unpickle_programs(*pickle_programs(push, peek))
  one = Tensor.ones(8).contiguous().realize()
  push2(one)
  assert peek2(one).numpy().tolist() == [8.0] * 8   # 3 pushes pickled + 1 after loading, doubled


def test_covered():
  assert _covered([(0, 4), (4, 8)], 2, 8)
  assert _covered([(4, 8), (0, 4)], 0, 8)
  assert not _covered([(0, 4), (5, 8)], 0, 8)
  assert not _covered([], 0, 1)
  assert _covered([], 3, 3)


@pytest.mark.slow
@pytest.mark.xdist_group("cpu_artifact_1928")
def test_compile_twice_gives_byte_identical_artifacts(cpu_artifact_1928, tiny_models, tmp_path):
  """The session artifact came from a `modeld-msm compile` subprocess; this one is compiled in this process after other
  tinygrad work (other buffer counters, string identities, hash seed): every file, manifest included, is the same."""
  from tinygrad import Tensor

  from compile.build import compile_artifact
  Tensor.ones(3).contiguous().realize()   # move this process's buffer counters on
  out = tmp_path / "again"
  models = {"vision": tiny_models / "driving_vision.onnx", "policy": tiny_models / "driving_policy.onnx"}
  compile_artifact("driving", models, (1928, 1208), "CPU", out, log=lambda *_: None)
  names = sorted(p.name for p in cpu_artifact_1928.iterdir())
  assert names == sorted(p.name for p in out.iterdir())
  for n in names:
    assert (out / n).read_bytes() == (cpu_artifact_1928 / n).read_bytes(), f"{n} differs between two compiles of the same inputs"


@pytest.mark.slow
@pytest.mark.xdist_group("qcom_artifact")
def test_a_qcom_compile_twice_gives_byte_identical_artifacts(qcom_artifact, tiny_models, tmp_path, cli):
  """The QCOM artifact (a630 machine code, its queues and graph as captured on the emulated node) of the same inputs is
  the same bytes from another compile process, with another hash seed: a release build can be rebuilt and compared."""
  out = tmp_path / "again"
  r = cli("compile", "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx",
          "--camera", "1928x1208", "--device", "QCOM", "-o", out, env={"PYTHONHASHSEED": "12345"})
  assert r.returncode == 0, r.stderr[-2000:]
  names = sorted(p.name for p in qcom_artifact.iterdir())
  assert names == sorted(p.name for p in out.iterdir())
  for n in names:
    assert (out / n).read_bytes() == (qcom_artifact / n).read_bytes(), f"{n} differs between two QCOM compiles of the same inputs"
