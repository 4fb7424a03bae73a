"""Cutting a bound graph into submits by each kernel's estimated a630 time (backend/chunking.py): the rule itself, and the
car's artifact on the emulated render node, whose compile step measured those times by executing the a630 code."""
from __future__ import annotations

import pytest

from backend import chunking


@pytest.fixture
def costs():
  chunking.set_kernel_costs({"a": 1000, "b": 1000, "c": 3000, "d": 500})
  yield
  chunking.set_kernel_costs({})


def test_cuts_by_time_keep_each_chunk_within_budget(costs, monkeypatch):
  monkeypatch.setenv("MSM_CHUNK_US", "2500")
  # a+b fit (2000); c alone is over budget and stands alone; d follows in a chunk of its own
  assert chunking.cuts([10, 20, 30, 40], ["a", "b", "c", "d"], 44, 16) == [0, 20, 30, 44]
  monkeypatch.setenv("MSM_CHUNK_US", "10000")
  assert chunking.cuts([10, 20, 30, 40], ["a", "b", "c", "d"], 44, 16) == [0, 44]


def test_a_chunk_exactly_at_the_budget_is_not_cut(costs, monkeypatch):
  """The budget is a bound the chunk may reach: kernels adding up to exactly the budget share one submit."""
  monkeypatch.setenv("MSM_CHUNK_US", "2000")
  assert chunking.cuts([10, 20, 30], ["a", "b", "d"], 34, 16) == [0, 20, 34]      # a+b = 2000 exactly: one chunk, d the next
  monkeypatch.setenv("MSM_CHUNK_US", "5500")
  assert chunking.cuts([10, 20, 30, 40], ["a", "b", "c", "d"], 44, 16) == [0, 44]  # 1000+1000+3000+500 = 5500
  monkeypatch.setenv("MSM_CHUNK_US", "5499")
  assert chunking.cuts([10, 20, 30, 40], ["a", "b", "c", "d"], 44, 16) == [0, 30, 44]


def test_default_budget_applies_when_costs_are_known(costs, monkeypatch):
  monkeypatch.delenv("MSM_CHUNK_US", raising=False)
  assert chunking.budget_us() == chunking.DEFAULT_CHUNK_US
  assert chunking.cuts([10, 20, 30, 40], ["a", "b", "c", "d"], 44, 1) == [0, 20, 30, 44]


def test_kernel_count_rule_without_costs_or_when_asked(costs, monkeypatch):
  monkeypatch.setenv("MSM_CHUNK_US", "2500")
  assert chunking.cuts([10, 20, 30, 40], ["a", "b", "x", "d"], 44, 2) == [0, 20, 40, 44]   # x has no cost
  monkeypatch.setenv("MSM_CHUNK_US", "0")
  assert chunking.cuts([10, 20, 30, 40], ["a", "b", "c", "d"], 44, 3) == [0, 30, 44]
  assert chunking.cuts([10, 20, 30, 40], ["a", "b", "c", "d"], 44, 0) == [0, 44]       # 0 kernels: one submit
  monkeypatch.setenv("MSM_CHUNK_US", "-1")
  with pytest.raises(RuntimeError, match="MSM_CHUNK_US"):
    chunking.cuts([10], ["a"], 12, 16)


@pytest.mark.xdist_group("qcom_artifact")
def test_car_artifact_is_submitted_in_chunks_of_estimated_time(qcom_artifact, monkeypatch):
  """The compile step ships per-kernel times; loaded, a full step goes out in exactly the chunks the time rule gives."""
  import json

  import numpy as np
  from conftest import event_reader
  from tinygrad import Device
  from tinygrad.helpers import DEV

  from backend.timeline import DISPATCH_OVERHEAD_US
  from modeld_msm.core import Frame, ModeldCore
  from selfdrive_glue.nv12 import nv12_info
  meta = json.loads((qcom_artifact / "metadata.json").read_text())
  kernel_us = meta["kernel_us"]
  assert kernel_us and all(us >= DISPATCH_OVERHEAD_US for us in kernel_us.values()) and max(kernel_us.values()) > 2 * DISPATCH_OVERHEAD_US
  assert "a630 time estimate" in {c for c, _, _ in meta["validation"]["checks"]}
  from test_ir3 import _emu

  from backend.msm import Settings
  info, old = nv12_info(1928, 1208), DEV.value
  monkeypatch.setenv("MODELD_DEV", "EMU+QCOM:IR3")
  # the process's one QCOM device keeps the MSM_* settings it was opened with: open it before changing any, and give it
  # each environment's settings for this test only (opened under MSM_CHUNK_KERNELS=1, every later test would chunk per kernel)
  dev_iface = _emu().iface

  def full_step_submits(env: dict[str, str | None]) -> tuple[int, list[str]]:
    for k, v in env.items():
      if v is None:
        monkeypatch.delenv(k, raising=False)
      else:
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dev_iface, "settings", Settings.from_env(dev_iface.priorities))
    core = ModeldCore(qcom_artifact)   # fresh JITs: their graphs bind (and plan their chunks) under this environment
    it = Device["QCOM"].iface
    core.on_message(event_reader("deviceState", deviceType="tici"))
    core.on_message(event_reader("liveCalibration", rpyCalib=[0.0, 0.0, 0.0]))
    buf = np.zeros(info.size, np.uint8)
    for n in (1, 2):
      core.on_message(event_reader("roadCameraState", frameId=n, sensor="ar0231"))
      s0, d0 = it.stats["submits"], it.node.stats.dispatches
      core.on_frame(Frame(buf, n, n * FRAME_NS, n * FRAME_NS + 1))
      Device["QCOM"].synchronize()
    names = [it.node.kernel_names[d.shader_iova] for d in list(it.node.dispatches)[-(it.node.stats.dispatches - d0):]]
    return it.stats["submits"] - s0, names

  try:
    per_kernel, names = full_step_submits({"MSM_CHUNK_US": "0", "MSM_CHUNK_KERNELS": "1"})
    budget = max(kernel_us.values()) * 1.5
    before = {id(q) for q in _bound_queues()}
    timed, names2 = full_step_submits({"MSM_CHUNK_US": str(budget)})
    per_queue = [_chunk_kernels(q) for q in _bound_queues() if id(q) not in before]   # the policy and the warp JIT's graphs
    chunks = [c for q in per_queue for c in q]
    default, _ = full_step_submits({"MSM_CHUNK_US": None, "MSM_CHUNK_KERNELS": "16"})
  finally:
    DEV.value = old
  assert names == names2 and all(n in kernel_us for n in names) and chunks
  assert 1 < timed < per_kernel and default < per_kernel
  big = [c for c in chunks if sum(kernel_us[n] for n in c) > budget]
  assert all(len(c) == 1 for c in big), big   # over budget only as a single kernel
  for q in per_queue:
    for a, b in zip(q, q[1:]):
      if a and b:   # a queue's chunks are filled: the next kernel would not have fit
        assert sum(kernel_us[n] for n in a) + kernel_us[b[0]] > budget


def _bound_queues() -> list:
  import gc

  from backend.qcom import MSMComputeQueue
  return [q for q in gc.get_objects() if isinstance(q, MSMComputeQueue) and q.binded_device is not None and q._chunks]


def _chunk_kernels(q) -> list[list[str]]:
  """Kernel names per submit chunk of a bound graph queue."""
  ends = list(zip(q._exec_ends, q._exec_names))
  return [[name for end, name in ends if ch.offset // 4 < end <= (ch.offset + ch.size) // 4] for ch in q._chunks]


FRAME_NS = 50_000_000
