"""Compute precision per target: CPU feature detection, the choice it drives, and the exact fp16 -> fp32 graph rewrite."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from artifact.cpu_info import cpu_info
from compile.precision import choose, widen_to_fp32
from selfdrive_glue.errors import UserError

EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx f16c fma avx2 avx512f avx512_bf16\n"
# the SIMD flags of /proc/cpuinfo on the H200 host (a Sapphire Rapids-class Xeon): Linux spells AVX512-FP16 avx512_fp16
SAPPHIRE = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fma sse4_1 sse4_2 avx f16c avx2 "
            "avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni "
            "avx512_bitalg avx512_vpopcntdq amx_bf16 avx512_fp16 amx_tile amx_int8\n")
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp\nCPU part\t: 0xd0c\n"
ARM_OLD = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n"


@pytest.mark.parametrize("text, native", [(EPYC, False), (SAPPHIRE, True), (ARM, True), (ARM_OLD, False), ("", False)])
def test_native_fp16_detection(text, native):
  info = cpu_info(text)
  assert info.native_fp16 is native
  assert ("native fp16: yes" in info.summary()) is native


def test_cpu_model_and_flags_are_read():
  info = cpu_info(EPYC)
  assert info.model == "AMD EPYC 7B13" and {"avx2", "f16c", "avx512f"} <= info.flags
  assert "avx512f" in info.summary() and "AMD EPYC 7B13" in info.summary()


def test_choice_per_target():
  no16, has16 = cpu_info(EPYC), cpu_info(SAPPHIRE)
  assert choose("CPU", "auto", no16)[0] == "fp32" and "no native fp16" in choose("CPU", "auto", no16)[1]
  # native fp16 or not, a CPU computes in fp32: tinygrad renders fp16 as __fp16 (see the renderer test below)
  assert choose("CPU", "auto", has16)[0] == "fp32" and "__fp16" in choose("CPU", "auto", has16)[1]
  assert choose("CPU:LLVM", "auto", no16)[0] == "fp32"
  assert choose("CPU", "fp16", no16)[0] == "fp16"  # asked for: honoured
  assert choose("QCOM", "auto", no16)[0] == "fp16"  # the car computes like the models
  assert choose("CUDA", "auto", no16)[0] == "fp16" and choose("NV", "fp32", no16)[0] == "fp32"  # workstation GPUs: either
  with pytest.raises(UserError, match="fp32 is for CPU and workstation GPU artifacts"):
    choose("QCOM", "fp32", no16)
  with pytest.raises(UserError, match="unknown precision"):
    choose("CPU", "bf16", no16)


def test_tinygrad_renders_fp16_as_storage_only():
  """Why auto picks fp32 even where the CPU has native fp16: clang computes __fp16 in fp32, converting around each op.
  If tinygrad ever renders fp16 as _Float16 (native arithmetic), this fails and the choice must be measured again."""
  from tinygrad import dtypes
  from tinygrad.renderer.cstyle import ClangRenderer
  assert ClangRenderer.type_map[dtypes.half] == "__fp16"


def _elem_types(m: onnx.ModelProto) -> set[int]:
  g = m.graph
  types = {t.data_type for t in g.initializer}
  types |= {vi.type.tensor_type.elem_type for vi in (*g.input, *g.output, *g.value_info)}
  types |= {a.i for n in g.node for a in n.attribute if a.name == "to"}
  types |= {a.t.data_type for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR}
  return types


def test_widened_reference_models_keep_weights_and_outputs(tiny_models, tmp_path):
  import onnxruntime as ort
  rng = np.random.default_rng(0)
  for kind in ("vision", "policy"):
    src = tiny_models / f"driving_{kind}.onnx"
    dst = widen_to_fp32(src, tmp_path / src.name)
    a, b = onnx.load(str(src)), onnx.load(str(dst))
    assert TensorProto.FLOAT16 in _elem_types(a) and TensorProto.FLOAT16 not in _elem_types(b)
    for ta, tb in zip(a.graph.initializer, b.graph.initializer):
      assert np.array_equal(numpy_helper.to_array(ta).astype(np.float32), numpy_helper.to_array(tb))  # exact
    assert a.metadata_props == b.metadata_props  # output_slices etc. travel with the graph
    sa, sb = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (src, dst))
    feeds16, feeds32 = {}, {}
    for i in sa.get_inputs():
      shape = [d if isinstance(d, int) else 1 for d in i.shape]
      if i.type == "tensor(uint8)":
        feeds16[i.name] = feeds32[i.name] = rng.integers(0, 256, shape, dtype=np.uint8)
      else:
        feeds16[i.name] = rng.standard_normal(shape).astype(np.float16)
        feeds32[i.name] = feeds16[i.name].astype(np.float32)
    ref, got = sa.run(None, feeds16)[0].astype(np.float32), sb.run(None, feeds32)[0]
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() <= 2e-2 + 2e-2 * np.abs(ref).max()  # the compile check's fp16 tolerance


def test_widen_refuses_what_it_does_not_understand(tmp_path):
  body = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "b", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1])])
  node = helper.make_node("If", ["c"], ["out"], then_branch=body, else_branch=body)
  g = helper.make_graph([node], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                        [helper.make_tensor_value_info("out", TensorProto.FLOAT16, [1])])
  onnx.save(helper.make_model(g), str(tmp_path / "if.onnx"))
  with pytest.raises(UserError, match="subgraph.*--precision fp16"):
    widen_to_fp32(tmp_path / "if.onnx", tmp_path / "out.onnx")
  assert not (tmp_path / "out.onnx").exists()


@pytest.mark.xdist_group("cpu_artifact_1928")
def test_artifact_records_the_choice_for_this_cpu(cpu_artifact_1928, cli):
  meta = json.loads((cpu_artifact_1928 / "metadata.json").read_text())
  want, why = choose("CPU", "auto")
  assert meta["precision"]["compute"] == want and meta["precision"]["why"] == why
  assert cpu_info().model in meta["precision"]["cpu"]
  assert f"precision              ok      {want}" in (cpu_artifact_1928.parent / "compile.log").read_text()
  r = cli("verify", cpu_artifact_1928)
  assert r.returncode == 0 and f"compute  {want}" in r.stdout


def test_qcom_fp32_refused_before_compiling(tiny_models, tmp_path, cli):
  r = cli("compile", "--vision", tiny_models / "driving_vision.onnx", "--policy", tiny_models / "driving_policy.onnx",
          "--device", "QCOM", "--precision", "fp32", "-o", tmp_path / "a", timeout=60)
  assert r.returncode == 2 and "fp32 is for CPU and workstation GPU artifacts" in r.stderr and not (tmp_path / "a").exists()
