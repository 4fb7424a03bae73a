"""pytest plugin for testing/tinygrad_suites.py: tinygrad's own tests, run with our QCOM device over the emulated render node.

Loaded with `-p tinygrad_emu_plugin` before any test module imports tinygrad's Device: installs our kernel interfaces, then
refuses to start unless the default device really is QCOM on the emulator with execution on (a run that quietly fell back
to the CPU would pass everything and prove nothing). At the end it writes how much a630 code the emulator executed."""
from __future__ import annotations

import json
import os

import pytest

import backend

backend.install()


def _node():
  from tinygrad import Device
  return getattr(getattr(Device[Device.DEFAULT], "iface", None), "node", None)


def pytest_sessionstart(session):
  from tinygrad import Device
  node = _node()
  if Device.DEFAULT != "QCOM" or node is None or not node.execute:
    pytest.exit(f"tinygrad's default device is {Device.DEFAULT} ({type(getattr(Device[Device.DEFAULT], 'iface', None)).__name__}), "
                "not QCOM on the executing emulator: run with DEV=EMU+QCOM:IR3 EMU_EXEC=1", returncode=3)


def pytest_sessionfinish(session, exitstatus):
  if (path := os.environ.get("TG_SUITE_STATS")) and (node := _node()) is not None:
    t = node.exec_total
    with open(path, "w") as f:
      json.dump({"dispatches": node.stats.dispatches, "fibers": t.fibers, "fiber_instrs": t.instrs, "exec_s": t.seconds,
                 "faults": len(node.stats.faults)}, f)
