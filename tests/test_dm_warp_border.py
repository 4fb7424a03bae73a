"""The DM warp per openpilot release: 0.11 reads the frame's edge where the source is outside the frame, master fills 16
(docs/openpilot-master-2026-09.md §5); a DM artifact records which, chosen by --openpilot."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tinygrad import Tensor

from compile.programs.dm_warp import MASTER_BORDER, warp_y, warp_y_numpy
from selfdrive_glue.camera import DM_INPUT_SIZE, dm_warp_matrix
from selfdrive_glue.nv12 import nv12_info
from tests.conftest import run_cli

NV = nv12_info(1344, 760)


def _shifted() -> np.ndarray:
  """The camera's DM matrix moved so the left quarter of the output reads from left of the frame."""
  m = dm_warp_matrix(NV.width).astype(np.float32)
  m[0, 2] -= 600
  return m


def test_master_fills_outside_the_frame_0_11_clamps():
  rng = np.random.default_rng(0)
  frame = rng.integers(20, 255, NV.size, dtype=np.uint8)   # no pixel of the frame is 16
  m = _shifted()
  w, h = DM_INPUT_SIZE
  clamp = warp_y(Tensor(frame), Tensor(m), NV, w, h).numpy()
  fill = warp_y(Tensor(frame), Tensor(m), NV, w, h, border=MASTER_BORDER).numpy()
  outside = fill == MASTER_BORDER
  assert 0.05 < outside.mean() < 0.9                                   # the shift put part of the image off the frame
  assert np.array_equal(fill[~outside], clamp[~outside])               # inside, the same pixels
  assert (clamp[outside] != MASTER_BORDER).all()                       # 0.11 read the edge there
  assert np.array_equal(fill, warp_y_numpy(frame, m, NV, w, h, border=MASTER_BORDER))
  assert np.array_equal(clamp, warp_y_numpy(frame, m, NV, w, h))


@pytest.mark.slow
def test_a_master_dm_artifact_records_its_warp(dm_model, tmp_path):
  r = run_cli("compile", "--model", dm_model, "--camera", "1344x760", "--device", "CPU", "--openpilot", "master", "-o", tmp_path / "a",
              timeout=900)
  assert r.returncode == 0, r.stderr[-2000:]
  assert json.loads((tmp_path / "a" / "metadata.json").read_text())["dm_warp"] == {"outside_the_frame": "fill 16"}
