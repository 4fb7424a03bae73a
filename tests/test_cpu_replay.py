"""artifact/cpu_replay.py: a loaded CPU artifact replayed with its calls resolved once computes what tinygrad's own JIT
executor computes, step after step, and hands anything unexpected to tinygrad."""
from __future__ import annotations

import numpy as np
import pytest

from artifact import cpu_replay

pytestmark = pytest.mark.xdist_group("cpu_artifact_1344")


def _load_both(path):
  from artifact.format import verify_artifact
  from artifact.load import load_programs
  art = verify_artifact(path)
  try:
    cpu_replay.ENABLED = False
    plain = load_programs(art)
  finally:
    cpu_replay.ENABLED = True
  fast = load_programs(art)
  return art, (plain["step"], plain["warp"]), (fast["step"], fast["warp"])


def test_replay_is_bit_exact_with_tinygrads_executor(cpu_artifact_1344):
  """Two loads of one artifact, one replayed, fed the same changing inputs (frames swapped, desire pulses, transforms,
  warp-only steps between full ones): every output and every queue they carry between steps stays bit-identical."""
  from artifact.load import frame_tensor
  from modeld_msm.named_program import host_of, host_tensors
  from selfdrive_glue.nv12 import nv12_info
  art, plain, fast = _load_both(cpu_artifact_1344)
  assert all(isinstance(j, cpu_replay.CpuReplay) for j in fast) and not any(isinstance(j, cpu_replay.CpuReplay) for j in plain)
  kernels = sum(isinstance(s, cpu_replay._Kernel) for s in fast[0]._steps)
  assert kernels > 0.8 * len(fast[0]._steps)   # the kernels are replayed; only the few copies go to tinygrad
  nv = nv12_info(*art.camera)
  rng = np.random.default_rng(0)
  pixels = [rng.integers(0, 256, nv.size, dtype=np.uint8) for _ in range(4)]
  frames = [frame_tensor(p, "CPU") for p in pixels]
  host = host_of()
  ht = host_tensors(host)
  for i in range(12):
    host["desire"][...] = 0
    host["desire"].reshape(-1)[i % host["desire"].size] = 1.0
    host["traffic_convention"][...] = [[i % 2, 1 - i % 2]]
    host["tfm"][...] = np.eye(3) + 0.02 * i
    host["big_tfm"][...] = np.eye(3) - 0.01 * i
    j = 2 * (i % 2)
    args = (frames[j], frames[j + 1], ht["desire"], ht["traffic_convention"], ht["tfm"], ht["big_tfm"])
    outs = []
    for policy, warp in (plain, fast):
      if i % 4 == 3:   # a dropped frame: the warp alone moves the image queues
        warp(*args)
      outs.append([t.numpy().copy() for t in policy(*args)])
    for a, b in zip(*outs):
      assert np.array_equal(a, b), f"step {i}"
  assert not np.array_equal(outs[0][0], np.zeros_like(outs[0][0]))


def test_unexpected_inputs_are_refused(cpu_artifact_1344):
  """Frames of the wrong size (which tinygrad's JIT, comparing views, would read past their end) and inputs of the wrong
  kind (which tinygrad reports) are refused, not replayed."""
  from tinygrad import Tensor
  from tinygrad.engine.jit import JitError

  from artifact.load import frame_tensor
  from modeld_msm.named_program import host_of, host_tensors
  from selfdrive_glue.nv12 import nv12_info
  art, _, (policy, _warp) = _load_both(cpu_artifact_1344)
  ht = host_tensors(host_of())
  host = (ht["desire"], ht["traffic_convention"], ht["tfm"], ht["big_tfm"])
  frames = [frame_tensor(np.zeros(nv12_info(*art.camera).size, np.uint8), "CPU") for _ in range(2)]
  policy(*frames, *host)   # the first call: tinygrad's, which the sizes are taken from
  small = [Tensor.zeros(16, dtype="uint8").contiguous().realize() for _ in range(2)]
  with pytest.raises(JitError, match="input 0 has 16 bytes"):
    policy(*small, *host)
  with pytest.raises(JitError, match="args mismatch"):
    policy(*frames, *host[:3], Tensor.zeros(3, 3, dtype="int32").contiguous().realize())
  policy(*frames, *host)   # still runs after a refusal


def test_switch_off_and_non_cpu_devices_keep_the_jit():
  class Jit:
    captured = object()
  jit = Jit()
  assert cpu_replay.wrap(jit, "QCOM") is jit
  cpu_replay.ENABLED = False
  try:
    assert cpu_replay.wrap(jit, "CPU") is jit
  finally:
    cpu_replay.ENABLED = True
