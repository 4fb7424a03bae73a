"""Issue 40, deliverable 2: hostile values in every field modeld and dmonitoringmodeld read, published over our msgq to
the real processes (testing/fuzz_values.py), at a size CI affords: both keep publishing, every output is finite or marked
invalid, and nothing is sticky once the bad publisher stops."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))
import fuzz_values  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dm_cpu_artifact")]


def test_both_processes_survive_hostile_values_and_recover(cpu_artifact_1928, dm_cpu_artifact, prefix):
  r = fuzz_values.fuzz_values(cpu_artifact_1928, dm_cpu_artifact, seed=3, frames=80)
  assert not r.died, r.died
  assert r.violations == [], r.violations
  assert r.bad_sent > 100 and r.wrong_member_sent > 5   # the publisher was hostile
  # one output per frame from each process (the fuzz loop waits for both)
  assert r.outputs["modelV2"] == r.frames == 80 and r.outputs["driverStateV2"] == r.frames, (r.outputs, r.missing)
  assert r.recovered   # valid and finite again once the good messages are back
