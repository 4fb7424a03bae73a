"""Emulator level B: the compiled instruction closures (backend/emu/ir3/compiled.py) and the native runs (native.py)
against the generic handlers.

Both are built once per program and must change nothing but speed: the same registers, memory and outputs bit for bit,
and the same per-dispatch Counts the timeline's cost model reads.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import numpy as np
import pytest

from tests.test_ir3 import QCOM_FLAGS, executing

pytestmark = pytest.mark.xdist_group("qcom_artifact")
RNG = np.random.default_rng(7)


@contextlib.contextmanager
def recorded(node):
  """The Counts of every dispatch executed in the block, in order, without their wall time and the addresses they touched."""
  out: list[tuple[str, dict]] = []
  was = node.counts
  node.counts = collections.deque()
  try:
    yield out
  finally:
    out.extend((name, {k: v for k, v in dataclasses.asdict(c).items() if k not in ("seconds", "read", "written")}) for name, c in node.counts)
    node.counts = was


@contextlib.contextmanager
def native(on: bool, min_run: int | None = None):
  """Level B with or without the native runs (EMU_NATIVE; handlers are cached apart for either); min_run: native.MIN_RUN
  for the block (the plans it makes are dropped after it)."""
  import os

  from backend.emu.ir3 import execute
  from backend.emu.ir3 import native as nat
  was, was_min = os.environ.get("EMU_NATIVE"), nat.MIN_RUN
  os.environ["EMU_NATIVE"] = "1" if on else "0"
  if min_run is not None:
    nat.MIN_RUN = min_run
    execute._HANDLER_CACHE.clear()
  try:
    yield
  finally:
    if was is None:
      del os.environ["EMU_NATIVE"]
    else:
      os.environ["EMU_NATIVE"] = was
    if min_run is not None:
      nat.MIN_RUN = was_min
      execute._HANDLER_CACHE.clear()


@contextlib.contextmanager
def native_calls():
  """How many native runs, and how many of them fetched texels, executed in the block."""
  from backend.emu.ir3 import native as nat
  seen = collections.Counter()
  orig = nat.Run.__call__

  def spy(self, b, mask):
    done = orig(self, b, mask)
    seen["runs"] += done
    seen["isam"] += done and self.n_isam > 0
    return done
  nat.Run.__call__ = spy   # type: ignore[method-assign]
  try:
    yield seen
  finally:
    nat.Run.__call__ = orig   # type: ignore[method-assign]


@contextlib.contextmanager
def generic_only():
  """Every instruction through execute.py's generic handlers (what ran before the compiled closures and native runs)."""
  from backend.emu.ir3 import execute
  saved = dict(execute._HANDLER_CACHE)
  orig = execute.compile_instr

  def generic(ins, handler, op_half):
    def fn(b, mask):
      handler(b, ins, mask)
    return fn
  execute._HANDLER_CACHE.clear()
  execute.compile_instr = generic
  try:
    with native(False):
      yield
  finally:
    execute.compile_instr = orig
    execute._HANDLER_CACHE.clear()
    execute._HANDLER_CACHE.update(saved)


def _workload():
  """Elementwise fp32/fp16/int, matmul, reductions, a convolution (tinygrad keeps one this small in buffers), casts."""
  from tinygrad import Tensor
  from tinygrad.helpers import Context
  rng = np.random.default_rng(7)   # the same inputs on every call
  x = rng.standard_normal((8, 3, 12, 12)).astype(np.float32)
  w = rng.standard_normal((6, 3, 3, 3)).astype(np.float32)
  m = rng.standard_normal((24, 40)).astype(np.float32)
  ints = rng.integers(-1000, 1000, 300).astype(np.int32)
  outs = []
  with Context(**QCOM_FLAGS):
    xt, wt, mt = (Tensor(a, device="QCOM") for a in (x, w, m))
    it = Tensor(ints, device="QCOM")
    outs.append(xt.conv2d(wt, padding=1).relu().numpy())
    outs.append((mt @ mt.T).softmax(-1).numpy())
    outs.append((mt.half() * 3 + 1).exp2().float().sum(0).numpy())
    outs.append(((it * 7) // 3 + (it >> 2) - (it % 5)).max().numpy())
    outs.append((mt.sqrt().log2() + mt.sin()).cast("int32").numpy())
  return outs


def _edges():
  """Elementwise fp32 and int32 over the values where semantics split: NaN, inf, -0, denormals, fp32's extremes, the
  integer extremes, shifts of negatives, float -> int saturation, uint32 -> float rounding."""
  from tinygrad import Tensor
  from tinygrad.helpers import Context
  fs = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38, 1.5, -2.5, 2.5, 0.49999997,
                 2.1e9, -2.2e9, 4.3e9, 16777217.0, 1e-38], np.float32)
  rng = np.random.default_rng(11)
  a = np.concatenate([fs, rng.standard_normal(44).astype(np.float32)])
  b = np.concatenate([fs[::-1], rng.standard_normal(44).astype(np.float32) * 1e-39])   # denormal products and sums
  i32 = np.array([-2**31, 2**31 - 1, -1, 0, 1, -7, 7, 2**24 + 1, -(2**24) - 1, 65535, 65536, -65536], np.int32)
  ia = np.concatenate([i32, rng.integers(-2**31, 2**31 - 1, 52, dtype=np.int64).astype(np.int32)])
  ib = np.concatenate([i32[::-1], rng.integers(-40, 40, 52).astype(np.int32)])
  outs = []
  with Context(**QCOM_FLAGS):
    x, y, p, q = (Tensor(v, device="QCOM") for v in (a, b, ia, ib))
    outs += [(x + y).numpy(), (x * y).numpy(), (x * y + x).numpy(), (-x.abs() * y - x).numpy(), (x < y).where(x, y).numpy(),
             (x == y).numpy(), x.cast("int32").numpy(), x.cast("uint32").numpy(), p.cast("float32").numpy(),
             p.bitcast("uint32").cast("float32").numpy()]
    outs += [(p + q).numpy(), (p - q).numpy(), (p * q).numpy(), (p >> 3).numpy(), (p << 5).numpy(), (p & q).numpy(),
             (p | q).numpy(), (p ^ q).numpy(), p.maximum(q).numpy(), p.minimum(q).numpy(), (p < q).numpy(), (-p).numpy(),
             p.bitcast("uint32").maximum(q.bitcast("uint32")).numpy(), (p.bitcast("uint32") >> 7).numpy()]
  return outs


@pytest.mark.parametrize("corpus", ["workload", "edges"])
def test_closures_and_native_runs_match_the_generic_handlers_bit_for_bit(corpus):
  work = _workload if corpus == "workload" else _edges
  with executing() as node:
    with generic_only(), recorded(node) as ref_counts:
      ref = work()
    with native(False), recorded(node) as closure_counts:
      closures = work()
    # every native form on its own, too: the edge corpus's kernels are mostly one op between a load and a store
    with native(True, min_run=1 if corpus == "edges" else None), recorded(node) as native_counts, native_calls() as calls:
      nat = work()
  # the native runs did run (a silent fallback would prove nothing); texel fetches: test_qcom_exec, on the car's program
  assert ref_counts and calls["runs"] > 0, calls
  for r, c, g in zip(ref, closures, nat):
    assert r.dtype == c.dtype == g.dtype and r.tobytes() == c.tobytes() == g.tobytes()
  assert closure_counts == ref_counts and native_counts == ref_counts


def test_a_program_is_compiled_once_and_reruns_identically():
  from tinygrad import Tensor

  from backend.emu.ir3 import execute
  from backend.emu.ir3 import native as nat
  from backend.emu.ir3.decode import decode
  a = RNG.standard_normal(4096).astype(np.float32)
  with executing() as node:
    t = Tensor(a, device="QCOM").realize()
    with recorded(node) as once:
      first = (t * 3 + 1).sqrt().numpy()
    d = node.dispatches[-1]
    handlers = execute._HANDLER_CACHE[(decode(d.shader).digest, nat.enabled())]
    with recorded(node) as twice:
      second = (t * 3 + 1).sqrt().numpy()
    assert node.dispatches[-1].shader == d.shader
    assert execute._HANDLER_CACHE[(decode(d.shader).digest, nat.enabled())] is handlers   # not rebuilt
  assert first.tobytes() == second.tobytes()
  assert once and once == twice


PLANTED = {   # a C micro-op made wrong the way a port of alu.py could get it wrong: (what it was, what it becomes)
  "float -> int without NaN -> 0": ("if (v != v) return 0;", ""),
  "mad fused": ("float t = u2f(a[l]) * u2f(b[l]); r[l] = f2u(t + u2f(c[l]));", "r[l] = f2u(fmaf(u2f(a[l]), u2f(b[l]), u2f(c[l])));"),
  "ashr as a logical shift": ("(uint32_t)((int32_t)a[l] >> (b[l] & 31))", "(a[l] >> (b[l] & 31))"),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_edge_corpus_catches_a_planted_native_bug(bug, monkeypatch, tmp_path):
  from backend.emu.ir3 import native as nat
  old, new = PLANTED[bug]
  assert old in nat._SOURCE + nat._RUN
  for part in ("_SOURCE", "_RUN"):
    monkeypatch.setattr(nat, part, getattr(nat, part).replace(old, new))
  monkeypatch.setattr(nat, "_LIB", None)   # rebuilt from the planted source, into a cache of its own
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  try:
    with executing():
      with native(False):
        ref = _edges()
      with native(True, min_run=1):
        got = _edges()
  finally:
    nat._LIB = None   # the next user builds (or loads) the real one again
  assert any(r.tobytes() != g.tobytes() for r, g in zip(ref, got)), f"planted '{bug}' went unnoticed"
