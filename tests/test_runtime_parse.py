"""The compile's runtime parse (compile/runtime_parse.py) for every process and output layout it serves, without a compile:
the driving model as the 0.11 pair (two outputs) and as master's combined model (one output with the action head), and
the driver-monitoring model. Each takes its good layout and refuses a layout the car's parser cannot read, by name.
test_supercombo_model.py covers the combined model only."""
from __future__ import annotations

import numpy as np
import pytest

from artifact.kinds import KINDS
from compile.refmodels.dmonitoring import DM_SLICES
from compile.refmodels.driving import POLICY_SLICES, VISION_SLICES
from compile.refmodels.supercombo import slices as combined_slices
from compile.runtime_parse import check_runtime_parses
from selfdrive_glue.errors import UserError


def _raw(slices: dict[str, slice], seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).normal(0, 0.1, max(s.stop for s in slices.values())).astype(np.float32)


def _layouts(kind: str, plan_width: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, dict[str, slice]]]:
  """({output name: flat vector}, {output name: slices}) as the compile hands them over for `kind`."""
  if kind == "driving":
    policy = dict(POLICY_SLICES)
    if plan_width is not None:
      policy["plan"] = slice(0, plan_width)
    s = {"vision_outputs": VISION_SLICES, "policy_outputs": policy}
  elif kind == "supercombo":
    s = {"outputs": combined_slices()}
    if plan_width is not None:
      s["outputs"]["plan"] = slice(s["outputs"]["plan"].start, s["outputs"]["plan"].start + plan_width)
  else:
    s = {"outputs": DM_SLICES}
  return {n: _raw(sl, i) for i, (n, sl) in enumerate(s.items())}, s


@pytest.mark.parametrize("kind,messages", [("driving", "modelV2, drivingModelData, cameraOdometry"),
                                           ("supercombo", "modelV2, drivingModelData, cameraOdometry"),
                                           ("dmonitoring", "driverStateV2")])
def test_each_process_parses_its_own_layout_into_its_messages(kind, messages):
  outputs, slices = _layouts(kind)
  assert check_runtime_parses(KINDS[kind], "m.onnx", outputs, slices) == f"a reference output parsed by the car's own code into {messages}"


@pytest.mark.parametrize("kind", ["driving", "supercombo"])
def test_a_plan_the_parser_cannot_shape_is_refused_in_either_driving_layout(kind):
  outputs, slices = _layouts(kind, plan_width=900)
  with pytest.raises(UserError, match=r"^m.onnx: the car's parser refuses its outputs \(head 'plan' is 900 wide.*does not follow the contract$"):
    check_runtime_parses(KINDS[kind], "m.onnx", outputs, slices)


def test_a_layout_of_the_other_process_is_refused_by_each():
  """The process decides the parser: driving outputs handed to the DM parse (and the reverse) fail by name, not pass."""
  dm_out, dm_slices = _layouts("dmonitoring")
  with pytest.raises(UserError, match=r"m.onnx: the car's parser refuses its outputs \(model output has no 'pose' head"):
    check_runtime_parses(KINDS["supercombo"], "m.onnx", dm_out, dm_slices)
  sc_out, sc_slices = _layouts("supercombo")
  with pytest.raises(UserError, match=r"cannot read its outputs \(KeyError: 'wheel_on_right'\); dmonitoringmodeld would stop on its first"):
    check_runtime_parses(KINDS["dmonitoring"], "m.onnx", sc_out, sc_slices)


def test_a_dm_layout_lacking_a_head_the_filler_needs_is_refused():
  outputs, slices = _layouts("dmonitoring")
  slices["outputs"] = {k: v for k, v in slices["outputs"].items() if k != "face_descs_rhd"}
  with pytest.raises(UserError, match=r"cannot read its outputs \(KeyError: 'face_descs_rhd'\); dmonitoringmodeld would stop"):
    check_runtime_parses(KINDS["dmonitoring"], "m.onnx", outputs, slices)
