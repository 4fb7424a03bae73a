"""Bad input to `compile` and `release` (issue 24: items 2, 4, 5 and 12c): a model file whose metadata pickles a payload,
models that parse but are invalid, devices this box cannot run, and an unsigned artifact whose camera size was edited.
Every case must end in one line, exit 2, before the heavy work, with nothing run and nothing written."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import re
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from compile.onnx_model import decode_output_slices, load_model_info
from compile.refmodels.driving import POLICY_SLICES, VISION_SLICES, encode_output_slices
from selfdrive_glue.errors import UserError
from tests.conftest import REPO, clone_artifact, rewrite_file, run_cli


class _Plant:
  """Unpickles as os.mkdir(marker): the marker's absence afterwards proves nothing ran."""

  def __init__(self, marker: Path):
    self.marker = marker

  def __reduce__(self):
    return os.mkdir, (str(self.marker),)


def _payload(marker: Path, protocol: int = 4) -> str:
  """output_slices metadata that looks like openpilot's (a dict name -> slice) with a payload among the slices."""
  return base64.b64encode(pickle.dumps({"hidden_state": slice(1064, 1576), "plan": _Plant(marker)}, protocol=protocol)).decode()


def _with_props(src: Path, dst: Path, **props: str) -> Path:
  m = onnx.load(str(src))
  kept = {p.key: p.value for p in m.metadata_props}
  del m.metadata_props[:]
  onnx.helper.set_model_props(m, {**kept, **props})
  onnx.save(m, str(dst))
  return dst


def _one_line_error(r, command: str) -> str:
  assert r.returncode == 2, f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"
  assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith(f"modeld-msm {command}: error: "), r.stderr
  return r.stderr


# ------------------------------------------------------------------------------------------------ item 2: metadata pickle

def test_planted_payload_is_real(tmp_path):
  """Plain pickle runs the plant, so its marker's absence below means something."""
  marker = tmp_path / "RAN"
  pickle.loads(base64.b64decode(_payload(marker)))
  assert marker.is_dir()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_output_slices_payload_is_refused_by_name_and_never_runs(protocol, tmp_path):
  marker = tmp_path / "RAN"
  with pytest.raises(UserError, match=r"asks for (posix|os|nt)\.mkdir.*refused") as e:
    decode_output_slices(_payload(marker, protocol))
  assert not marker.exists(), "the payload ran"
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_openpilot_slices_decode_under_every_protocol(protocol):
  """openpilot writes pickle.dumps(dict of slices) with whatever protocol its Python defaults to: all of them still load."""
  for slices in (VISION_SLICES, POLICY_SLICES):
    assert decode_output_slices(base64.b64encode(pickle.dumps(slices, protocol=protocol)).decode()) == slices
  assert decode_output_slices(encode_output_slices(POLICY_SLICES)) == POLICY_SLICES


@pytest.mark.parametrize("value", [{"plan": 3}, {"plan": slice("a", "b")}, {"plan": slice(0, 10, 2)}, {"plan": slice(-5, None)},
                                   {1: slice(0, 1)}, [slice(0, 1)], {"plan": slice(0, True)}])
def test_slice_metadata_of_other_shapes_is_refused(value):
  with pytest.raises(UserError, match="output_slices"):
    decode_output_slices(base64.b64encode(pickle.dumps(value)).decode())


def test_a_payload_inside_a_tuple_or_extension_code_is_refused(tmp_path):
  """Other routes to a callable: a global nested in the slice's own arguments, and a copyreg extension code."""
  import copyreg
  marker = tmp_path / "RAN"
  nested = pickle.dumps({"plan": slice(0, _Plant(marker))})
  with pytest.raises(UserError, match="mkdir"):
    decode_output_slices(base64.b64encode(nested).decode())
  module = _Plant.__reduce__(_Plant(marker))[0].__module__
  copyreg.add_extension(module, "mkdir", 240)
  try:
    ext = pickle.dumps(_Plant(marker), protocol=2)
    assert b"\x82\xf0" in ext   # EXT1 240: the global named by a registered code, not by text
    with pytest.raises(UserError, match="mkdir"):
      decode_output_slices(base64.b64encode(ext).decode())
  finally:
    copyreg.remove_extension(module, "mkdir", 240)
  assert not marker.exists()


@pytest.mark.parametrize("which", ["vision", "policy"])
def test_compile_cli_refuses_a_crafted_model_before_running_its_metadata(which, tiny_models, tmp_path):
  marker = tmp_path / "RAN"
  paths = {k: tiny_models / f"driving_{k}.onnx" for k in ("vision", "policy")}
  paths[which] = _with_props(paths[which], tmp_path / f"driving_{which}.onnx", output_slices=_payload(marker))
  out = tmp_path / "out"
  r = run_cli("compile", "--vision", paths["vision"], "--policy", paths["policy"], "--device", "CPU", "-o", out, timeout=120)
  err = _one_line_error(r, "compile")
  assert "mkdir" in err and str(paths[which]) in err and which in err, err
  assert not marker.exists(), "the model file's payload ran"
  assert not out.exists() and "[compile] loading" not in r.stdout


def test_dmonitoring_compile_refuses_a_crafted_model_before_running_its_metadata(dm_model, tmp_path):
  """The driver-monitoring model's output_slices go through the same restricted decoder (issue 24 item 2: "the DM ... models
  to come")."""
  marker = tmp_path / "RAN"
  crafted = _with_props(dm_model, tmp_path / "dmonitoring_model.onnx", output_slices=_payload(marker))
  out = tmp_path / "out"
  r = run_cli("compile", "--dmonitoring", crafted, "--device", "CPU", "-o", out, timeout=120)
  err = _one_line_error(r, "compile")
  assert "mkdir" in err and str(crafted) in err, err
  assert not marker.exists(), "the model file's payload ran"
  assert not out.exists()


def test_release_cli_refuses_a_crafted_model_before_running_its_metadata(tiny_models, tmp_path):
  marker = tmp_path / "RAN"
  vision = _with_props(tiny_models / "driving_vision.onnx", tmp_path / "driving_vision.onnx", output_slices=_payload(marker, 0))
  out = tmp_path / "bundle"
  r = run_cli("release", "--vision", vision, "--policy", tiny_models / "driving_policy.onnx", "--device", "CPU", "--camera", "1928x1208",
              "--smoke-frames", "0", "-o", out, timeout=120)
  err = _one_line_error(r, "release")
  assert "mkdir" in err and "vision" in err, err
  assert not marker.exists(), "the model file's payload ran"
  assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".bundle")], "something was left behind"


# every module that unpickles, and why it may: a new reader of model metadata (DM, combined models) must use decode_output_slices
UNPICKLERS = {
  "compile/onnx_model.py": "the restricted output_slices decoder",
  "artifact/jit_pickle.py": "the artifacts' restricted JIT unpickler",
  "compile/tuning/record.py": "tinygrad's own search cache, written moments before by our recording run",
}


def _unpickles(source: str) -> bool:
  """Code (not comments or docstrings) that calls into an unpickler: pickle.load(s)/Unpickler, or imports one by name."""
  import ast
  mods, names = {"pickle", "_pickle", "cloudpickle", "dill"}, {"load", "loads", "Unpickler"}
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in mods and node.attr in names:
      return True
    if isinstance(node, ast.ImportFrom) and node.module in mods and any(a.name in names for a in node.names):
      return True
  return False


def _reads_slices_metadata(source: str) -> bool:
  """Code that reads an ONNX model's metadata_props and names 'output_slices' (writers use helper.set_model_props)."""
  import ast
  nodes = list(ast.walk(ast.parse(source)))
  return (any(isinstance(n, ast.Attribute) and n.attr == "metadata_props" for n in nodes)
          and any(isinstance(n, ast.Constant) and n.value == "output_slices" for n in nodes))


def test_the_restricted_decoder_is_the_only_reader_of_pickles_from_files():
  assert _unpickles("import pickle\npickle.loads(b'')") and _unpickles("from pickle import Unpickler")
  assert not _unpickles('"""call pickle.load first"""  # pickle.loads')
  found = {f.relative_to(REPO).as_posix() for pkg in ("cli", "offcar", "compile", "modeld_msm", "artifact", "release", "selfdrive_glue", "backend")
           for f in (REPO / pkg).rglob("*.py") if _unpickles(f.read_text())}
  assert found <= set(UNPICKLERS), f"unpickling outside the reviewed modules: {sorted(found - set(UNPICKLERS))}"
  readers = {f.relative_to(REPO).as_posix() for pkg in ("cli", "offcar", "compile", "modeld_msm", "artifact", "release")
             for f in (REPO / pkg).rglob("*.py") if _reads_slices_metadata(f.read_text())}
  assert readers == {"compile/onnx_model.py"}, f"output_slices read from ONNX metadata outside compile/onnx_model.py: {sorted(readers)}"


# ------------------------------------------------------------------------------------------------ item 5: invalid models

def _flip_name_bit(src: Path, dst: Path) -> Path:
  """One bit flipped in the last occurrence of a tensor name one node makes and the next one reads: still a protobuf."""
  m = onnx.load(str(src))
  name = next(n.output[0] for n in m.graph.node if any(n.output[0] in x.input for x in m.graph.node))
  data = bytearray(src.read_bytes())
  data[data.rfind(name.encode())] ^= 1
  dst.write_bytes(bytes(data))
  return dst


def _edit(src: Path, dst: Path, fn) -> Path:
  m = onnx.load(str(src))
  fn(m)
  onnx.save(m, str(dst))
  return dst


def _input_dtype(name: str, elem: int):
  def fn(m):
    next(i for i in m.graph.input if i.name == name).type.tensor_type.elem_type = elem
  return fn


def _short_initializer(m) -> None:
  init = next(i for i in m.graph.initializer if len(i.raw_data) > 64)
  init.raw_data = init.raw_data[:-2]


def _reshape_target_flipped(src: Path, dst: Path) -> Path:
  """A high bit set in the leading dim of a Reshape's shape constant, where shape inference does not notice (the target
  leads into a node that takes any shape): only running the graph shows it."""
  from onnx import numpy_helper
  m = onnx.load(str(src))
  inits = {i.name: i for i in m.graph.initializer}
  for node in (n for n in m.graph.node if n.op_type == "Reshape" and n.input[1] in inits):
    trial = onnx.load(str(src))
    init = next(i for i in trial.graph.initializer if i.name == node.input[1])
    shape = numpy_helper.to_array(init).copy()
    shape[0] |= 1 << 10
    init.CopyFrom(numpy_helper.from_array(shape, init.name))
    onnx.save(trial, str(dst))
    try:
      load_model_info(dst, "policy")
    except UserError:
      continue
    return dst
  pytest.skip("every Reshape target change is caught by shape inference in these models")


def _extra_input(m) -> None:
  m.graph.input.append(onnx.helper.make_tensor_value_info("lateral_control_params", TensorProto.FLOAT16, (1, 2)))


INVALID = {
  # case: (which model, how it is broken, words the message must contain)
  "flipped_bit": ("policy", _flip_name_bit, ["not a valid ONNX model", "policy"]),
  "fp32_input_in_fp16_graph": ("policy", lambda s, d: _edit(s, d, _input_dtype("features_buffer", TensorProto.FLOAT)),
                               ["not a valid ONNX model", "'features_buffer' float32 in a float16 graph"]),
  "initializer_too_short": ("vision", lambda s, d: _edit(s, d, _short_initializer), ["raw_data", "vision"]),
  "reshape_target_flipped": ("policy", _reshape_target_flipped, ["refused by onnxruntime", "Reshape", "requested shape"]),
  "input_not_fed_by_modeld": ("policy", lambda s, d: _edit(s, d, _extra_input), ["lateral_control_params", "does not feed"]),
  "hidden_state_not_512_wide": ("vision", lambda s, d: _with_props(s, d, output_slices=encode_output_slices(
    {**VISION_SLICES, "hidden_state": slice(1064, 1500)})), ["hidden_state", "512"]),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_model_is_one_line_before_loading(case, tiny_models, tmp_path):
  which, breaker, words = INVALID[case]
  paths = {k: tiny_models / f"driving_{k}.onnx" for k in ("vision", "policy")}
  paths[which] = breaker(paths[which], tmp_path / f"driving_{which}.onnx")
  onnx.load(str(paths[which]))   # each still parses: only validation can tell
  out = tmp_path / "out"
  t = time.perf_counter()
  r = run_cli("compile", "--vision", paths["vision"], "--policy", paths["policy"], "--device", "CPU", "-o", out, timeout=120)
  err = _one_line_error(r, "compile")
  for w in words:
    assert w in err, f"{w!r} not in {err!r}"
  assert paths[which].name in err
  assert "[compile] loading" not in r.stdout and not out.exists(), "refused only after tinygrad loaded the models"
  assert time.perf_counter() - t < 30


def test_model_only_tinygrad_cannot_parse_is_refused_before_the_program_is_built(tiny_models, tmp_path):
  """tinygrad reads ONNX with a parser of its own: a field with a group wire type (3) that onnx and onnxruntime skip as
  unknown stops it."""
  src = tiny_models / "driving_policy.onnx"
  data = src.read_bytes()
  # an unknown top-level ModelProto field 99 as a group (start 99<<3|3, end 99<<3|4), which protobuf skips and tinygrad does not
  grp = bytes([(99 << 3 | 3) & 0x7F | 0x80, (99 << 3 | 3) >> 7, (99 << 3 | 4) & 0x7F | 0x80, (99 << 3 | 4) >> 7])
  bad = tmp_path / "driving_policy.onnx"
  bad.write_bytes(data + grp)
  info = load_model_info(bad, "policy")   # onnx reads it, the contract holds
  import onnxruntime as ort
  ort.InferenceSession(str(bad), providers=["CPUExecutionProvider"])
  r = run_cli("compile", "--vision", tiny_models / "driving_vision.onnx", "--policy", bad, "--device", "CPU", "-o", tmp_path / "out", timeout=120)
  err = _one_line_error(r, "compile")
  assert "tinygrad's ONNX parser" in err and info.path.name in err, err
  assert "[compile] 1/3" not in r.stdout


# ------------------------------------------------------------------------------------------------ item 4: devices

def _old_libllvm() -> Path | None:
  for d in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/aarch64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")):
    for v in (15, 14):
      for name in (f"libLLVM-{v}.so.1", f"libLLVM-{v}.so"):
        if (d / name).is_file():
          return d / name
  return None


def test_cpu_llvm_with_an_llvm_older_than_16_is_refused_clearly(tiny_models, tmp_path):
  lib = _old_libllvm()
  if lib is None:
    pytest.skip("no libLLVM 14 or 15 on this box")
  out = tmp_path / "out"
  r = run_cli("compile", "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx",
              "--device", "CPU:LLVM", "--layout", "off", "--search", "off", "-o", out, timeout=120, env={"LLVM_PATH": str(lib)})
  err = _one_line_error(r, "compile")
  assert "needs LLVM >= 16" in err and re.search(r"libLLVM 1[45]\b", err) and str(lib) in err and "--device CPU" in err, err
  assert "[compile] loading" not in r.stdout and not out.exists()


def test_llvm_version_is_read_from_the_library(tmp_path):
  lib = _old_libllvm()
  if lib is None:
    pytest.skip("no libLLVM 14 or 15 on this box")
  code = "from compile.preflight import llvm_library; print(llvm_library())"
  import subprocess
  import sys
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env={**os.environ, "LLVM_PATH": str(lib)}, timeout=60)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == repr((str(lib), int(re.search(r"LLVM-(\d+)", lib.name).group(1)))), r.stdout


GPU_NODES = {"CUDA": "/dev/nvidiactl", "NV": "/dev/nvidiactl", "AMD": "/dev/kfd"}


@pytest.mark.parametrize("device", list(GPU_NODES))
def test_gpu_device_missing_here_is_one_line_before_loading(device, tiny_models, tmp_path):
  if os.path.exists(GPU_NODES[device]):
    pytest.skip(f"this box has a {device} GPU")
  out = tmp_path / "out"
  r = run_cli("compile", "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx",
              "--device", device, "-o", out, timeout=120)
  err = _one_line_error(r, "compile")
  assert f"no {device} device here (" in err and "--device CPU" in err, err
  assert "[compile] loading" not in r.stdout and not out.exists()


# ------------------------------------------------------------------------------------------------ item 12c: edited camera size

def _rehash(d: Path) -> None:
  m = json.loads((d / "manifest.json").read_text())
  for name in m["files"]:
    m["files"][name] = hashlib.sha256((d / name).read_bytes()).hexdigest()
  rewrite_file(d / "manifest.json", json.dumps(m).encode())


def _set_camera(d: Path, width: int, height: int, geometry: bool) -> None:
  from selfdrive_glue.nv12 import nv12_info
  meta = json.loads((d / "metadata.json").read_text())
  meta["camera"].update(width=width, height=height)
  if geometry:
    nv = nv12_info(width, height)
    meta["camera"].update(stride=nv.stride, y_height=nv.y_height, uv_height=nv.uv_height, uv_offset=nv.uv_offset, size=nv.size)
  rewrite_file(d / "metadata.json", json.dumps(meta, indent=1, sort_keys=True).encode())
  _rehash(d)


@pytest.mark.xdist_group("cpu_artifact_1928")
def test_unsigned_artifact_with_edited_camera_is_refused_at_load(cpu_artifact_1928, tmp_path):
  """All of the camera's geometry rewritten consistently, the manifest re-hashed, no key: only the programs themselves know."""
  from artifact.format import ArtifactError, verify_artifact
  from artifact.load import frame_input_bytes, load_programs
  from modeld_msm.model_state import ModelState
  from selfdrive_glue.nv12 import nv12_info
  d = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  _set_camera(d, 1344, 760, geometry=True)
  verify_artifact(d, camera=(1344, 760), pubkey="")   # the JSON alone is consistent
  with pytest.raises(ArtifactError, match=r"says camera 1344x760 .*compiled for 4804608-byte frames \(1928x1208\).*edited") as e:
    ModelState(d, camera=(1344, 760))
  assert "\n" not in str(e.value)
  # the sizes read off the programs are the ones the compile used
  progs = load_programs(verify_artifact(cpu_artifact_1928))
  policy, warp = progs["step"], progs["warp"]
  assert frame_input_bytes(policy.jit) == frame_input_bytes(warp.jit) == {0: nv12_info(1928, 1208).size, 1: nv12_info(1928, 1208).size}


@pytest.mark.xdist_group("cpu_artifact_1928")
def test_camera_size_edited_without_its_geometry_is_refused_by_verify(cpu_artifact_1928, tmp_path):
  d = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  _set_camera(d, 1344, 760, geometry=False)
  r = run_cli("verify", d, "--camera", "1344x760", timeout=120)
  err = _one_line_error(r, "verify")
  assert "disagrees with its own NV12 layout" in err and "stride 2048, not 1408" in err, err


def test_fp32_input_reads_as_fp32_in_info(tiny_models, tmp_path):
  """An fp32 graph with fp32 inputs is within the contract (our own widened copies are): only the mix is refused."""
  from compile.precision import widen_to_fp32
  path = widen_to_fp32(tiny_models / "driving_policy.onnx", tmp_path / "driving_policy.onnx")
  info = load_model_info(path, "policy")
  assert set(info.input_dtypes.values()) == {"float32"}
  assert np.dtype(info.input_dtypes["features_buffer"]) == np.float32
