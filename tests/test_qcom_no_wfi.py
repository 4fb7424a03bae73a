"""The wait-for-idle lever (MSM_INDEPENDENT_NO_WFI=1, docs/a630-time.md "Lever: wait-for-idle"): a captured graph's
dispatch that neither reads what an unfinished dispatch writes nor writes what one reads or writes runs without its
CP_WAIT_FOR_IDLE. The emulated a630 runs dispatches one after another, so results alone cannot show a race: at level B it
records the address ranges every dispatch read and wrote and reports one that overlaps a dispatch not yet waited for."""
from __future__ import annotations

import numpy as np
import pytest
from test_ir3 import QCOM_FLAGS, _emu, executing

from backend import qcom

pytestmark = pytest.mark.xdist_group("qcom_artifact")
N = 4096


def _run(monkeypatch, on: bool, conflicts=None):
  """Three steps of a captured graph: two independent kernels, then one reading both. -> (outputs, waits dropped, hazards)."""
  from tinygrad import Tensor, TinyJit
  from tinygrad.helpers import Context

  from backend.msm import Settings
  iface = _emu().iface
  node = iface.node
  monkeypatch.setenv(qcom.NO_WFI_ENV, "1" if on else "0")
  # the default chunking, whatever the device was opened with (a submit's first dispatch always keeps its wait)
  for k in ("MSM_CHUNK_KERNELS", "MSM_CHUNK_US"):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setattr(iface, "settings", Settings.from_env(iface.priorities))
  if conflicts is not None:
    monkeypatch.setattr(qcom.Access, "conflicts", conflicts)
  bound: list = []
  bind = qcom.MSMComputeQueue.bind
  monkeypatch.setattr(qcom.MSMComputeQueue, "bind", lambda self, dev: (bound.append(self), bind(self, dev))[1])

  @TinyJit
  def step(a, b):
    x = (a * 3 + 1).contiguous()
    y = (b * b - 2).contiguous()   # reads and writes nothing x's kernel touches
    return ((x + y) * 0.5).contiguous().realize()   # reads both: keeps its wait

  rng = np.random.default_rng(0)
  ins = [(rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)) for _ in range(4)]
  before = len(node.stats.order_hazards)
  outs = []
  with executing(), Context(**QCOM_FLAGS, JIT_BATCH_SIZE=0):
    for a, b in ins:
      outs.append(step(Tensor(a, device="QCOM"), Tensor(b, device="QCOM")).numpy())
  hazards = node.stats.order_hazards[before:]
  del node.stats.order_hazards[before:]   # the node is shared by every test of this process
  return outs, sum(q.waits_dropped for q in bound), hazards, ins


def test_independent_dispatches_lose_their_wait_and_race_with_nothing(monkeypatch):
  outs, dropped, hazards, ins = _run(monkeypatch, True)
  assert dropped >= 1 and hazards == []
  for (a, b), got in zip(ins, outs):
    assert np.array_equal(got, ((a * 3 + 1) + (b * b - 2)) * np.float32(0.5))
  off, dropped_off, _, _ = _run(monkeypatch, False)
  assert dropped_off == 0 and all(np.array_equal(x, y) for x, y in zip(outs, off))


def test_the_emulator_sees_a_dispatch_racing_one_it_reads(monkeypatch):
  """Every wait dropped (as if nothing depended on anything): the third kernel reads what the first two write, unfinished."""
  _, dropped, hazards, _ = _run(monkeypatch, True, conflicts=lambda self, other: False)
  assert dropped >= 2 and hazards and "which" in hazards[0] and "writes" in hazards[0]
