"""Issue 40.10, the compile's messages on hostile model files: one true line each (a huge slice index or a name with
terminal escapes in output_slices, weights in external data files, a DM graph error that is not about calib)."""
from __future__ import annotations

import base64
import pickle

import onnx
import pytest
from onnx import TensorProto, helper

from compile.onnx_model import decode_output_slices, load_model_info
from selfdrive_glue.errors import UserError


def _b64(d) -> str:
  return base64.b64encode(pickle.dumps(d)).decode()


def test_a_huge_slice_index_is_refused_in_a_printable_line():
  with pytest.raises(UserError, match="below 2\\*\\*31") as e:
    decode_output_slices(_b64({"plan": slice(0, 10**5000)}))
  assert len(str(e.value)) < 300


@pytest.mark.parametrize("name", ["plan\nvalid", "\x1b[31mplan", "", "x" * 65])
def test_slice_names_that_are_not_printable_text_are_refused(name):
  with pytest.raises(UserError, match="not printable text") as e:
    decode_output_slices(_b64({name: slice(0, 1)}))
  assert "\n" not in str(e.value) and "\x1b" not in str(e.value)


def test_external_data_is_named_not_called_damage(dm_model, tmp_path):
  m = onnx.load(str(dm_model))
  out = tmp_path / "dmonitoring_model.onnx"
  onnx.save(m, str(out), save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
  with pytest.raises(UserError) as e:
    load_model_info(out, "dmonitoring")
  assert "external data" in str(e.value) and "weights.bin" in str(e.value) and "damaged" not in str(e.value), str(e.value)


def test_a_dm_graph_error_does_not_blame_calib(dm_model, tmp_path):
  """The DM's calib input is float32 in its float16 graph by design: a failure elsewhere must not be blamed on it."""
  from onnx import numpy_helper
  m = onnx.load(str(dm_model))
  # one weight stored as float32 in the float16 graph: a type error the full check finds, nothing to do with calib
  w = next(t for t in m.graph.initializer if t.data_type == TensorProto.FLOAT16 and len(t.dims) == 4)
  w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).astype("float32"), w.name))
  out = tmp_path / "dmonitoring_model.onnx"
  onnx.save(m, str(out))
  with pytest.raises(UserError) as e:
    load_model_info(out, "dmonitoring")
  assert "not a valid ONNX model" in str(e.value) and "calib" not in str(e.value), str(e.value)


def test_a_dm_input_declared_in_the_wrong_precision_is_still_named(dm_model, tmp_path):
  m = onnx.load(str(dm_model))
  for i in m.graph.input:
    if i.name == "calib":
      i.CopyFrom(helper.make_tensor_value_info("calib", TensorProto.DOUBLE, (1, 3)))
  out = tmp_path / "dmonitoring_model.onnx"
  onnx.save(m, str(out))
  with pytest.raises(UserError, match="calib"):
    load_model_info(out, "dmonitoring")
