"""Fault classes of issue 11 not covered elsewhere (GPU-side injections: test_backend_qcom.py; camera restart and SIGINT:
test_modeld*.py / test_msgq_exit.py). testing/fault_matrix.py prints the whole matrix."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("limit_kib", [16, 64])
def test_disk_full_leaves_no_half_written_log(tmp_path, limit_kib):
  # no small tmpfs here: RLIMIT_FSIZE with SIGXFSZ ignored makes write() fail with EFBIG, as a full disk fails with ENOSPC;
  # at 16 KiB the failure shows in a write, at 64 KiB partly only at the final flush in close()
  code = textwrap.dedent(f"""
    import errno, os, resource, signal, sys
    sys.path.insert(0, {str(REPO)!r})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_kib} * 1024, {limit_kib} * 1024))
    from selfdrive_glue.logs import LogWriter
    try:
      with LogWriter({str(tmp_path)!r} + "/out/rlog", compression="none") as w:
        for i in range(70):
          w.write(os.urandom(1000))
    except OSError as e:
      print("ERR", e.errno == errno.EFBIG)
  """)
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert p.stdout.strip() == "ERR True", p.stdout + p.stderr
  assert [x for x in tmp_path.rglob("*") if x.is_file()] == []


def test_nan_outputs_publish_invalid_then_recover(cpu_artifact_1928):
  import numpy as np
  from conftest import event_reader

  from modeld_msm.core import Frame, ModeldCore
  from selfdrive_glue.messaging import log_from_bytes
  core = ModeldCore(cpu_artifact_1928)
  core.on_member("deviceState", event_reader("deviceState", deviceType="tici").deviceState)
  core.on_member("roadCameraState", event_reader("roadCameraState", sensor="ar0231").roadCameraState)
  core.on_member("liveCalibration", event_reader("liveCalibration", rpyCalib=[0.0, 0.0, 0.0]).liveCalibration)
  buf = np.zeros(core.model.nv12.size, np.uint8)
  orig = core.model.run

  def poisoned(*a, **kw):
    out, raw = orig(*a, **kw)
    raw = raw.copy()
    raw[::5] = np.nan
    return out, raw
  assert log_from_bytes(core.on_frame(Frame(buf, 1, 0, 1))[0][1]).valid
  core.model.run = poisoned
  msgs = core.on_frame(Frame(buf, 2, 50_000_000, 50_000_001))
  assert msgs and not log_from_bytes(msgs[0][1]).valid and core.stats.nonfinite_steps == 1
  core.model.run = orig
  assert log_from_bytes(core.on_frame(Frame(buf, 3, 100_000_000, 100_000_001))[0][1]).valid
