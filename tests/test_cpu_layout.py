"""CPU levers: the weight-layout rewrite and the Conv op table compute what the original models compute, the artifact's
manifest records them, and a shipped kernel search is used only for the kernels it was recorded for."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from compile.checks import ORT_ATOL, ORT_RTOL
from compile.cpu import layout as cpu_layout
from compile.cpu import search as cpu_search
from selfdrive_glue.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _feeds(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
  from compile.onnx_model import load_model_info
  info = load_model_info(path, "vision" if "vision" in path.name else "policy")
  rng = np.random.default_rng(seed)
  return {n: rng.integers(0, 256, s, dtype=np.uint8) if info.input_dtypes[n] == "uint8" else rng.standard_normal(s).astype(info.input_dtypes[n])
          for n, s in info.input_shapes.items()}


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
  import onnxruntime as ort
  return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0].astype(np.float32)


@pytest.mark.parametrize("kind", ["vision", "policy"])
def test_transposed_weights_compute_the_same_in_onnxruntime(tiny_models, tmp_path, kind):
  src = tiny_models / f"driving_{kind}.onnx"
  m = onnx.load(str(src))
  n = cpu_layout.transpose_weights(m.graph)
  onnx.save(m, str(tmp_path / src.name))
  gemms = [nd for nd in m.graph.node if nd.op_type == "Gemm"]
  assert n > 0 and gemms and all(any(a.name == "transB" and a.i == 1 for a in nd.attribute) for nd in gemms)
  assert sum(nd.op_type == "Transpose" and nd.name.endswith("__cpu_t") for nd in m.graph.node) == n - len(gemms)
  feeds = _feeds(src)
  # the same values in another order: onnxruntime gives the same outputs up to its own summation order in fp16
  np.testing.assert_allclose(_ort(tmp_path / src.name, feeds), _ort(src, feeds), rtol=1e-2, atol=1e-2)


def test_shared_or_non_2d_weights_are_left_alone(tmp_path):
  from onnx import TensorProto, helper, numpy_helper
  w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
  g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("MatMul", ["x", "w"], ["b"]),
                         helper.make_node("Add", ["a", "b"], ["y"])], "g",
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 2))],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 3))], [w])
  onnx.save(helper.make_model(g), str(tmp_path / "m.onnx"))
  assert cpu_layout.rewrite(tmp_path / "m.onnx", tmp_path / "out.onnx")["weights_transposed"] == 0
  assert numpy_helper.to_array(onnx.load(str(tmp_path / "out.onnx")).graph.initializer[0]).shape == (2, 3)


@pytest.mark.parametrize("kind", ["vision", "policy"])
def test_cpu_runner_matches_onnxruntime_and_the_plain_runner(tiny_models, tmp_path, kind):
  """The runner compile builds for a CPU (fp32, transposed weights, dense convolutions materialised, pointwise ones on our
  kernel with their Elu) against onnxruntime on the original fp16 model with the compile check's tolerance, and against
  tinygrad's plain fp32 runner."""
  from tinygrad import Tensor
  from tinygrad.nn.onnx import OnnxRunner

  from compile.programs.one_model import runner_model
  src = tiny_models / f"driving_{kind}.onnx"
  feeds = _feeds(src, 1)
  ref = _ort(src, feeds)
  outs = {}
  for layout in (False, True):
    runner = OnnxRunner(runner_model(src, "fp32", layout, tmp_path)[0])
    if layout:
      cpu_layout.apply(runner)
    inputs = {k: Tensor(v.astype(np.float32) if v.dtype == np.float16 else v) for k, v in feeds.items()}
    outs[layout] = next(iter(runner(inputs).values())).float().numpy()
    if layout:   # the vision model's pointwise convolutions ran on compile/cpu/pointwise.py (the policy has none)
      assert (len(runner.cpu_pointwise) > 0) == (kind == "vision")
  assert np.all(np.abs(outs[True] - ref) <= ORT_ATOL + ORT_RTOL * np.abs(ref))
  np.testing.assert_allclose(outs[True], outs[False], rtol=1e-5, atol=1e-5)


def test_conv_op_table_materialises_only_dense_spatial_convolutions():
  from tinygrad import Tensor
  from tinygrad.nn.onnx import onnx_ops
  conv = cpu_layout.cpu_ops(onnx_ops)["Conv"]
  x = Tensor.randn(1, 4, 8, 8)
  dense = conv(x, Tensor.randn(6, 4, 3, 3), None, pads=[1, 1, 1, 1], strides=[2, 2])
  pointwise = conv(x, Tensor.randn(6, 4, 1, 1), None)
  depthwise = conv(x, Tensor.randn(4, 1, 3, 3), None, group=4, pads=[1, 1, 1, 1])
  from tinygrad.uop.ops import Ops
  assert dense.uop.op is Ops.CONTIGUOUS
  assert pointwise.uop.op is not Ops.CONTIGUOUS and depthwise.uop.op is not Ops.CONTIGUOUS
  assert onnx_ops["Conv"] is not conv   # tinygrad's own table is untouched: only runners given the CPU table use it


def test_elu_runs_as_a_kernel_of_its_own():
  """A pointwise convolution followed by Elu: one kernel with tinygrad's table (the Elu fused into the convolution's
  epilogue, where clang leaves it scalar), two with the CPU table (the convolution, then the Elu alone), same values."""
  from tinygrad import GlobalCounters, Tensor
  from tinygrad.nn.onnx import onnx_ops
  x, w = Tensor.randn(1, 8, 16, 16).realize(), Tensor.randn(24, 8, 1, 1).realize()
  outs, kernels = [], []
  for ops in (onnx_ops, cpu_layout.cpu_ops(onnx_ops)):
    y = ops["Elu"](ops["Conv"](x, w, None), alpha=1.0)
    GlobalCounters.reset()
    outs.append(y.numpy())
    kernels.append(GlobalCounters.kernel_count)
  assert kernels == [1, 2]
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)
  assert (outs[0] < 0).any() and (outs[0] > 0).any()   # both branches of Elu were taken


def test_layout_choice_per_target():
  assert cpu_layout.choose("CPU", "auto")[0] and cpu_layout.choose("CPU:LLVM", "auto")[0]
  assert not cpu_layout.choose("CPU", "off")[0]
  assert not cpu_layout.choose("QCOM", "auto")[0] and not cpu_layout.choose("CUDA", "auto")[0]
  with pytest.raises(UserError, match="--layout on is for CPU"):
    cpu_layout.choose("QCOM", "on")
  with pytest.raises(UserError, match="unknown layout"):
    cpu_layout.choose("CPU", "sideways")


@pytest.mark.xdist_group("cpu_artifact_1928")
def test_artifact_records_layout_and_search(cpu_artifact_1928):
  meta = json.loads((cpu_artifact_1928 / "metadata.json").read_text())
  lay = meta["cpu_layout"]
  assert lay["on"] is True and lay["dense_conv_materialised"] is True and lay["elu_own_kernel"] is True
  assert lay["vision_weights_transposed"] > 0 and lay["policy_weights_transposed"] > 0
  # the tiny models have no shipped search: the heuristic opts, said so
  assert meta["search"] == {"used": False, "why": meta["search"]["why"], "beam": None, "kernels": 0, "tuned": 0}
  assert "no shipped search" in meta["search"]["why"]
  log = (cpu_artifact_1928.parent / "compile.log").read_text()
  assert any(line.startswith("precision") and " ok " in line and "cpu layout on" in line and "no shipped search" in line
             for line in log.splitlines())


def _key(**kw):
  base = {"device": "CPU", "precision": "fp32", "layout": True, "camera": (1928, 1208), "model_sha256": {"vision": "a", "policy": "b"}}
  return cpu_search.match_key(**{**base, **kw})


def test_search_set_is_used_only_for_its_own_kernels():
  recorded = {"match": _key(), "beam": 1, "recorded_on": "test", "entries": []}
  table = {"format": cpu_search.FORMAT, "sets": [recorded]}
  assert cpu_search.choose("auto", _key(), table)[0] is recorded
  for other in (_key(precision="fp16"), _key(layout=False), _key(camera=(1344, 760)), _key(model_sha256={"vision": "a", "policy": "c"}),
                _key(device="CPU:LLVM"), _key(threads=_key()["threads"] + 1)):
    got, why = cpu_search.choose("auto", other, table)
    assert got is None and "no shipped search" in why
  stale = {**_key(), "code": "0" * 16}   # our kernel-shaping code changed since the recording
  assert cpu_search.choose("auto", stale, table)[0] is None
  assert cpu_search.choose("off", _key(), table) == (None, "requested")
  with pytest.raises(UserError, match="unknown search"):
    cpu_search.choose("always", _key(), table)


def test_search_sets_are_keyed_by_isa_level_and_borrowed_with_a_reason():
  """A set recorded on AVX-512 matches an AVX-512 box exactly; an AVX2 box with no set of its own borrows it and the reason
  says so; a set of its own level wins over the borrowed one."""
  avx512 = {"match": _key(isa="avx512"), "beam": 1, "recorded_on": "an AVX-512 box", "entries": []}
  table = {"format": cpu_search.FORMAT, "sets": [avx512]}
  got, why = cpu_search.choose("auto", _key(isa="avx512"), table)
  assert got is avx512 and "ISA level" not in why
  got, why = cpu_search.choose("auto", _key(isa="avx2"), table)
  assert got is avx512 and "for ISA level avx512; none is shipped for this CPU's avx2" in why
  avx2 = {"match": _key(isa="avx2"), "beam": 1, "recorded_on": "an AVX2 box", "entries": []}
  table["sets"].append(avx2)
  assert cpu_search.choose("auto", _key(isa="avx2"), table)[0] is avx2
  assert cpu_search.choose("auto", _key(isa="base"), table)[0] is avx2   # the nearest level first
  assert cpu_search.choose("auto", _key(isa="avx2", precision="fp16"), table)[0] is None   # only the level may differ


def test_gpu_sets_match_only_the_architecture_they_were_timed_on():
  """A GPU set (bench/bench_gpu.py: the H200's made the default CUDA artifact's GPU time 0.53-0.65x PyTorch's) is used on its
  own architecture only; another GPU, another runtime and the CPU get the heuristic, and the reason names what is shipped."""
  gpu = dict(device="CUDA", precision="fp16", layout=False, isa="sm_90")
  assert _key(**gpu)["threads"] == 1   # tinygrad does not split a GPU's kernels
  h200 = {"match": _key(**gpu), "beam": 1, "recorded_on": "NVIDIA H200 sm_90", "entries": []}
  table = {"format": cpu_search.FORMAT, "sets": [h200]}
  got, why = cpu_search.choose("auto", _key(**gpu), table)
  assert got is h200 and "recorded on NVIDIA H200 sm_90" in why
  got, why = cpu_search.choose("auto", _key(**{**gpu, "isa": "sm_89"}), table)
  assert got is None and "no shipped search for CUDA sm_89 fp16" in why and "shipped: sm_90 fp16" in why and "--device CUDA" in why
  for other in (_key(**{**gpu, "device": "NV"}), _key(**{**gpu, "precision": "fp32"}), _key(isa="avx2"), _key(isa="avx512")):
    assert cpu_search.choose("auto", other, table)[0] is None
  assert cpu_search.choose("off", _key(**gpu), table) == (None, "requested")
  assert cpu_search.choose("auto", _key(device="QCOM", precision="fp16", layout=False, isa="QCOM"), table)[0] is None


def test_code_fingerprint_is_the_same_under_every_python_here():
  """The GPU host and the car run Python 3.12, CI 3.11: ast.dump's text differs between them (3.12 added type_params), so a
  fingerprint made from it never matched across versions. fingerprint_of runs unchanged under each other Python found."""
  import inspect
  import shutil
  found = [shutil.which(f"python3.{m}") for m in (10, 12, 13)] + sorted(map(str, Path.home().glob(".pyenv/versions/3.1*/bin/python3")))
  others = list(dict.fromkeys(p for p in found if p))
  if not others:
    pytest.skip("no other Python (3.10, 3.12, 3.13 on PATH or under ~/.pyenv) to compare with")
  src = Path(cpu_search.__file__).parents[1]   # the sources are named under compile/
  texts = [(src / n).read_text() for n in cpu_search.KERNEL_SOURCES]
  prog = (f"from typing import Any\n{inspect.getsource(cpu_search._dump)}\n{inspect.getsource(cpu_search.fingerprint_of)}\n"
          "import json, sys\nprint(fingerprint_of(json.load(sys.stdin)))\n")
  ran = 0
  for py in others:
    r = subprocess.run([py, "-c", prog], input=json.dumps(texts), capture_output=True, text=True, timeout=60)
    if r.returncode == 127:   # a pyenv shim for a version it does not select
      continue
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == cpu_search.code_fingerprint(), (py, r.stdout)
    ran += 1
  if not ran:
    pytest.skip("the other Pythons on PATH do not run")


def test_isa_level_from_cpuinfo():
  from artifact.cpu_info import cpu_info
  flags = "fpu sse2 avx f16c fma avx2"
  assert cpu_info(f"model name\t: AVX2 EPYC\nflags\t: {flags}\n").isa == "avx2"
  assert cpu_info(f"model name\t: Zen4\nflags\t: {flags} avx512f avx512dq avx512bw avx512vl\n").isa == "avx512"
  assert cpu_info(f"model name\t: odd\nflags\t: {flags} avx512f\n").isa == "avx2"   # AVX-512F alone is not the level -march builds for
  assert cpu_info("Hardware\t: Qualcomm SDM845\nFeatures\t: fp asimd asimdhp\n").isa == "neon"
  assert cpu_info("model name\t: old\nflags\t: sse2\n").isa == "base"
  d = cpu_info(f"model name\t: AVX2 EPYC\nflags\t: {flags}\n").as_dict()
  assert d["model"] == "AVX2 EPYC" and d["isa"] == "avx2" and "fma" in d["flags"] and "avx512f" not in d["flags"]


def test_shipped_table_is_well_formed():
  from tinygrad.codegen.opt import OptOps
  table = cpu_search.load_table()
  for s in table["sets"]:
    assert set(s["match"]) == {"tinygrad", "device", "precision", "layout", "camera", "threads", "models", "code", "isa"}
    if s["match"]["device"] == "CPU":
      assert s["match"]["isa"] in cpu_search.ISA_PREFERENCE
    else:   # a GPU's set: its architecture, one part per kernel, its kernels on that device
      assert s["match"]["device"] in cpu_search.GPU_DEVICES and s["match"]["isa"].startswith(("sm_", "gfx"))
      assert s["match"]["threads"] == 1 and {e["device"] for e in s["entries"]} == {s["match"]["device"]}
    assert s["match"]["code"] == cpu_search.code_fingerprint()   # a set for older code can never match: rekey or record it
    assert s["beam"] >= 1 and s["entries"]
    threads = s["match"]["threads"]
    for e in s["entries"]:
      assert len(bytes.fromhex(e["ast"])) == 32
      assert all(op in OptOps.__members__ for op, _, _ in e["opts"])
      # a kernel is split into at most the set's thread count: the count a compile must have for the set to match
      assert all(arg <= threads for op, _, arg in e["opts"] if op == "THREAD")
    if threads > 1:   # searched on that many cores (artifact/cpu_threads.py): the big kernels are split
      assert any(op == "THREAD" for e in s["entries"] for op, _, _ in e["opts"])


def test_install_puts_the_opts_where_tinygrads_search_reads_them(tmp_path):
  """In a child with its own cache file: what install writes, tinygrad's beam-search cache lookup returns as Opts."""
  entry = {"ast": "ab" * 32, "allow_test_size": True, "device": "CPU", "suffix": "", "opts": [["UPCAST", 0, 4], ["UNROLL", 1, 4]]}
  recorded = {"beam": 1, "entries": [entry]}
  code = ("import json, sys; from compile.cpu import search as cpu_search; from tinygrad.helpers import diskcache_get; "
          f"print(cpu_search.install(json.loads({json.dumps(recorded)!r}))); "
          "print(diskcache_get('beam_search', {'ast': bytes.fromhex('ab' * 32), 'amt': 1, 'allow_test_size': True, 'device': 'CPU', 'suffix': ''}))")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                     env={**os.environ, "CACHEDB": str(tmp_path / "cache.db")})
  assert r.returncode == 0, r.stderr
  assert r.stdout.split("\n")[:2] == ["1", "[Opt(op=OptOps.UPCAST, axis=0, arg=4), Opt(op=OptOps.UNROLL, axis=1, arg=4)]"]


def test_a_hand_edited_table_is_refused(tmp_path, monkeypatch):
  """The shipped table's sha256 lives in compile/cpu/search.py (so cached artifacts follow a re-recorded table): a table
  that does not match it is refused, not replayed."""
  table = tmp_path / "cpu_search_table.json"
  recorded = {"match": _key(), "beam": 1, "recorded_on": "test", "entries": []}
  monkeypatch.setattr(cpu_search, "TABLE", table)
  src = tmp_path / "cpu_search.py"
  src.write_text('TABLE_SHA256: str | None = None\n')
  monkeypatch.setattr(cpu_search, "__file__", str(src))
  monkeypatch.setattr(cpu_search, "TABLE_SHA256", None)   # store sets it in this process too: restored after the test
  cpu_search.store(recorded, table)
  sha = src.read_text().split('"')[1]
  assert cpu_search.TABLE_SHA256 == sha
  assert cpu_search.load_table(table)["sets"] == [json.loads(json.dumps(recorded))]
  table.write_text(table.read_text().replace('"beam": 1', '"beam": 2'))
  with pytest.raises(UserError, match="does not match the sha256"):
    cpu_search.load_table(table)


def test_store_replaces_its_own_set_and_drops_sets_of_other_kernel_code(tmp_path):
  table = tmp_path / "table.json"
  other_models = {"match": _key(model_sha256={"vision": "c", "policy": "d"}), "beam": 1, "recorded_on": "a", "entries": []}
  old_code = {"match": {**_key(), "code": "0" * 16}, "beam": 1, "recorded_on": "b", "entries": []}
  first = {"match": _key(), "beam": 1, "recorded_on": "c", "entries": []}
  for s in (old_code, other_models):
    cpu_search.store(s, table)
  assert [s["recorded_on"] for s in cpu_search.load_table(table)["sets"]] == ["a"]   # old_code went when a newer code's set came
  cpu_search.store(first, table)
  assert [s["recorded_on"] for s in cpu_search.load_table(table)["sets"]] == ["a", "c"]
  cpu_search.store({**first, "recorded_on": "d"}, table)
  assert [s["recorded_on"] for s in cpu_search.load_table(table)["sets"]] == ["a", "d"]


def test_code_fingerprint_follows_code_not_its_text(tmp_path, monkeypatch):
  """A docstring or comment fixed in the kernel-shaping sources keeps the recorded sets; a changed line of code retires them."""
  src = Path(cpu_search.__file__).parents[1]   # the sources are named under compile/
  for name in cpu_search.KERNEL_SOURCES:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text((src / name).read_text())
  monkeypatch.setattr(cpu_search, "__file__", str(tmp_path / "cpu" / "search.py"))
  base = cpu_search.code_fingerprint()
  assert base == cpu_search.code_fingerprint()
  f = tmp_path / "cpu" / "pointwise.py"
  text = f.read_text()
  f.write_text(text.replace('"""Pointwise (1x1)', '"""Reworded. Pointwise (1x1)', 1).replace("# a tile is", "# reworded: a tile is", 1))
  assert f.read_text() != text and cpu_search.code_fingerprint() == base
  f.write_text(text.replace("#define MR 6", "#define MR 4", 1))
  assert cpu_search.code_fingerprint() != base
