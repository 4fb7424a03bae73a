"""Emulator level B: the compiled instruction closures (backend/emu/ir3/compiled.py) against the generic handlers.

The closures are built once per program and must change nothing but speed: the same registers, memory and outputs bit for
bit, and the same per-dispatch Counts the timeline's cost model reads.
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
  """The Counts of every dispatch executed in the block, in order, without their wall time."""
  out: list[tuple[str, dict]] = []
  was = node.counts
  node.counts = collections.deque()
  try:
    yield out
  finally:
    out.extend((name, {k: v for k, v in dataclasses.asdict(c).items() if k != "seconds"}) for name, c in node.counts)
    node.counts = was


@contextlib.contextmanager
def generic_only():
  """Every instruction through execute.py's generic handlers (what ran before the compiled closures)."""
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
    yield
  finally:
    execute.compile_instr = orig
    execute._HANDLER_CACHE.clear()
    execute._HANDLER_CACHE.update(saved)


def _workload():
  """Elementwise fp32/fp16/int, matmul, reductions, conv through IMAGE=2 textures (isam), casts."""
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


def test_compiled_closures_match_the_generic_handlers_bit_for_bit():
  with executing() as node:
    with generic_only(), recorded(node) as ref_counts:
      ref = _workload()
    with recorded(node) as got_counts:
      got = _workload()
  assert ref_counts
  for r, g in zip(ref, got):
    assert r.dtype == g.dtype and r.tobytes() == g.tobytes()
  assert got_counts == ref_counts


def test_a_program_is_compiled_once_and_reruns_identically():
  from tinygrad import Tensor

  from backend.emu.ir3 import execute
  from backend.emu.ir3.decode import decode
  a = RNG.standard_normal(4096).astype(np.float32)
  with executing() as node:
    t = Tensor(a, device="QCOM").realize()
    with recorded(node) as once:
      first = (t * 3 + 1).sqrt().numpy()
    d = node.dispatches[-1]
    handlers = execute._HANDLER_CACHE[decode(d.shader).digest]
    with recorded(node) as twice:
      second = (t * 3 + 1).sqrt().numpy()
    assert node.dispatches[-1].shader == d.shader
    assert execute._HANDLER_CACHE[decode(d.shader).digest] is handlers   # not rebuilt
  assert first.tobytes() == second.tobytes()
  assert once and once == twice
