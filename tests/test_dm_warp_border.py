"""The DM warp per openpilot release: 0.11 reads the frame's edge where the source is outside the frame, master fills 16
(docs/openpilot-master-2026-09.md §5); a DM artifact records which, chosen by --openpilot. And its matrix, built into the
program: read from memory as openpilot's warp reads it, as kernel constants, or (the 1928x1208 cameras) as a crop, all
giving numpy's pixels."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tinygrad import Tensor

from compile.programs.dm_warp import MASTER_BORDER, integer_crop, warp_y, warp_y_numpy
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
  clamp = warp_y(Tensor(frame), m, NV, w, h).numpy()
  fill = warp_y(Tensor(frame), m, NV, w, h, border=MASTER_BORDER).numpy()
  outside = fill == MASTER_BORDER
  assert 0.05 < outside.mean() < 0.9                                   # the shift put part of the image off the frame
  assert np.array_equal(fill[~outside], clamp[~outside])               # inside, the same pixels
  assert (clamp[outside] != MASTER_BORDER).all()                       # 0.11 read the edge there
  assert np.array_equal(fill, warp_y_numpy(frame, m, NV, w, h, border=MASTER_BORDER))
  assert np.array_equal(clamp, warp_y_numpy(frame, m, NV, w, h))


# source coordinates landing on x.5 (ties, rounded half to even) at both edges of the frame, and a half scale
TIES = {
  "low edge": [[1, 0, -10.5], [0, 1, -3.5], [0, 0, 1]],
  "high edge": [[1, 0, NV.width - 20.5], [0, 1, NV.height - 3.5], [0, 0, 1]],
  "half scale": [[0.5, 0, 100], [0, 0.5, 50], [0, 0, 1]],
}
SMALL = (44, 6)   # the emulator's out_w, out_h: a few pixels are enough; 44 splits into 4 pixels per fiber, quick to compile


def _ties_cases(border, size):
  rng = np.random.default_rng(1)
  frame = rng.integers(20, 255, NV.size, dtype=np.uint8)
  for name, m in TIES.items():
    m = np.array(m, np.float32)
    ref = warp_y_numpy(frame, m, NV, *size, border=border)
    # rounding half up instead (np.floor(x + 0.5)) picks other pixels here: the case sees ties
    half_up = warp_y_numpy(frame, m + np.array([[0, 0, 1e-3], [0, 0, 1e-3], [0, 0, 0]], np.float32), NV, *size, border=border)
    assert not np.array_equal(ref, half_up), name
    yield name, frame, m, ref


@pytest.mark.parametrize("border", [None, MASTER_BORDER])
@pytest.mark.parametrize("form", ["constants", "memory"])
def test_ties_round_half_to_even_at_both_edges(border, form):
  """At the DM's size, on the CPU, the matrix built into the kernel or read from memory."""
  for name, frame, m, ref in _ties_cases(border, DM_INPUT_SIZE):
    got = warp_y(Tensor(frame), m if form == "constants" else Tensor(m), NV, *DM_INPUT_SIZE, border=border).numpy()
    assert np.array_equal(got, ref), (name, int((got != ref).sum()))


@pytest.mark.xdist_group("qcom_artifact")
@pytest.mark.parametrize("border", [None, MASTER_BORDER])
def test_ties_on_the_emulated_a630(border):
  """The same on the emulated a630 under openpilot's QCOM flags: its fp32 add rounds the magic-number rounding as the
  CPU's does, and the bitcast keeps the compilers from folding it away."""
  from test_ir3 import QCOM_FLAGS, _emu, executing
  from tinygrad.helpers import Context
  _emu()
  for name, frame, m, ref in _ties_cases(border, SMALL):
    with executing(), Context(**QCOM_FLAGS):
      got = warp_y(Tensor(frame, device="QCOM"), m, NV, *SMALL, border=border).numpy()
    assert np.array_equal(got, ref), (name, int((got != ref).sum()))


@pytest.mark.slow
def test_a_master_dm_artifact_records_its_warp(dm_model, tmp_path):
  r = run_cli("compile", "--model", dm_model, "--camera", "1344x760", "--device", "CPU", "--openpilot", "master", "-o", tmp_path / "a",
              timeout=900)
  assert r.returncode == 0, r.stderr[-2000:]
  assert json.loads((tmp_path / "a" / "metadata.json").read_text())["dm_warp"] == {
    "outside_the_frame": "fill 16", "in_the_model_kernel": False, "matrix": dm_warp_matrix(1344).tolist(), "matrix_as": "memory"}


@pytest.mark.parametrize("border", [None, MASTER_BORDER])
def test_the_warp_folded_into_the_models_first_kernel_changes_no_output(dm_model, border):
  """For images the DM program leaves its warp lazy, so the model's input conversion gathers from the frame itself: the
  outputs are bit-identical to the program that realizes the warp first (built here on the CPU, where both run)."""
  from compile.onnx_model import load_model_info
  from compile.programs.dmonitoring_step import DMProgram
  m = np.asarray(dm_warp_matrix(NV.width), np.float32) @ np.array([[1.01, 0.02, -9.5], [-0.01, 0.99, 7.25], [0, 0, 1]], np.float32)
  prog = DMProgram(load_model_info(dm_model, "dmonitoring"), NV, "CPU", border=border, matrix=m)
  rng = np.random.default_rng(3)
  frame = rng.integers(0, 256, NV.size, dtype=np.uint8)
  calib = np.array([[0.02, -0.01, 0.03]], np.float32)
  outs = {}
  for fold in (False, True):
    prog.fold_warp = fold
    outs[fold] = prog.run(Tensor(frame), Tensor(calib)).numpy()
  assert np.isfinite(outs[False]).all() and np.array_equal(outs[True], outs[False])


TICI = nv12_info(1928, 1208)


def test_the_1928_cameras_warp_is_a_crop_the_mici_s_is_not():
  assert integer_crop(dm_warp_matrix(1928), TICI, *DM_INPUT_SIZE) == (244, 248)
  assert integer_crop(dm_warp_matrix(1344), NV, *DM_INPUT_SIZE) is None                       # scale 0.75
  shifted = dm_warp_matrix(1928).copy()
  shifted[0, 2] = TICI.width - DM_INPUT_SIZE[0] + 1                                          # one column past the frame
  assert integer_crop(shifted, TICI, *DM_INPUT_SIZE) is None
  shifted[0, 2] = 10.5                                                                       # between pixels
  assert integer_crop(shifted, TICI, *DM_INPUT_SIZE) is None
  sheared = dm_warp_matrix(1928).copy()
  sheared[0, 1] = 1e-3
  assert integer_crop(sheared, TICI, *DM_INPUT_SIZE) is None


@pytest.mark.parametrize("border", [None, MASTER_BORDER])
def test_the_crop_reads_the_pixels_the_projective_warp_reads(border):
  """The 1928x1208 cameras' DM warp as a crop gives numpy's projective warp, padding columns never read."""
  rng = np.random.default_rng(4)
  frame = rng.integers(0, 256, TICI.size, dtype=np.uint8)
  m = dm_warp_matrix(TICI.width)
  got = warp_y(Tensor(frame), m, TICI, *DM_INPUT_SIZE, border=border).numpy()
  assert np.array_equal(got, warp_y_numpy(frame, m, TICI, *DM_INPUT_SIZE, border=border))


@pytest.mark.xdist_group("qcom_artifact")
def test_the_crop_on_the_emulated_a630():
  from test_ir3 import QCOM_FLAGS, _emu, executing
  from tinygrad.helpers import Context
  _emu()
  frame = np.random.default_rng(5).integers(0, 256, TICI.size, dtype=np.uint8)
  m = dm_warp_matrix(TICI.width)
  assert integer_crop(m, TICI, *SMALL) is not None
  with executing(), Context(**QCOM_FLAGS):
    got = warp_y(Tensor(frame, device="QCOM"), m, TICI, *SMALL).numpy()
  assert np.array_equal(got, warp_y_numpy(frame, m, TICI, *SMALL))


def test_a_dm_artifact_built_with_another_matrix_is_refused():
  """The program cannot take another matrix, so the runtime refuses one built for a matrix its camera does not have."""
  from pathlib import Path

  from artifact.format import ArtifactError, VerifiedArtifact
  from modeld_msm.dm_core import warp_matrix_of
  meta = {"camera": {"width": 1928, "height": 1208}, "kind": "dmonitoring"}
  good = VerifiedArtifact(Path("a"), {**meta, "dm_warp": {"matrix": dm_warp_matrix(1928).tolist()}}, {})
  assert np.array_equal(warp_matrix_of(good), dm_warp_matrix(1928))
  for bad in ({"dm_warp": {"matrix": dm_warp_matrix(1344).tolist()}}, {"dm_warp": {}}, {}):
    with pytest.raises(ArtifactError, match="DM warp matrix .* is not the 1928-wide driver camera's"):
      warp_matrix_of(VerifiedArtifact(Path("a"), {**meta, **bad}, {}))
