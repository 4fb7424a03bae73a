"""The compile step: compile -> verify -> load round trips, tinygrad vs onnxruntime, the queue semantics of the fused
program, and bad input to `modeld-msm compile` (one-line error, exit 2, nothing written)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from artifact.format import verify_artifact
from artifact.load import frame_tensor
from cli.main import main as cli_main
from compile.checks import ORT_ATOL, ORT_RTOL
from compile.onnx_model import load_model_info
from compile.programs.driving_step import FRAME_SKIP, DrivingProgram
from compile.refmodels.driving import POLICY_SLICES, VISION_SLICES, encode_output_slices, write_models
from modeld_msm.named_program import host_of, host_tensors
from selfdrive_glue.nv12 import nv12_info

CAM_1344 = pytest.param((1344, 760), marks=pytest.mark.xdist_group("cpu_artifact_1344"), id="1344x760")


def _random_host(rng: np.random.Generator, host: dict[str, np.ndarray]) -> None:
  host["tfm"][:] = [[2.9, 0.02, 219.0], [-0.01, 2.9, 465.0], [0.0, 0.0, 1.0]]
  host["tfm"][:2] += rng.normal(0, [[0.05, 0.05, 30.0]], (2, 3))
  host["big_tfm"][:] = [[1.25, 0.0, 645.0], [0.0, 1.25, 415.0], [0.0, 0.0, 1.0]]
  host["big_tfm"][:2] += rng.normal(0, [[0.02, 0.02, 20.0]], (2, 3))
  host["desire"][:] = rng.random(8) > 0.7
  host["traffic_convention"][:] = 0
  host["traffic_convention"][0, int(rng.integers(0, 2))] = 1


def _unjitted(models: Path, camera: tuple[int, int], compute: str = "fp16") -> DrivingProgram:
  """The program as compile builds it, in the given compute precision (an artifact records its own in metadata)."""
  from compile.programs.driving import build_program
  return build_program(load_model_info(models / "driving_vision.onnx", "vision"), load_model_info(models / "driving_policy.onnx", "policy"),
                       nv12_info(*camera), "CPU", compute)


# ---------------------------------------------------------------------------------------------------------------- round trips

@pytest.mark.xdist_group("cpu_artifact_1928")
def test_cli_compile_then_verify_1928(cpu_artifact_1928, tiny_models, cli):
  log = (cpu_artifact_1928.parent / "compile.log").read_text()
  for check in ("model contract", "vision vs onnxruntime", "policy vs onnxruntime", "jit == unjitted", "pickle reload"):
    assert any(line.startswith(check) and " ok " in line for line in log.splitlines()), f"{check} not ok in:\n{log}"
  r = cli("verify", cpu_artifact_1928, "--device", "CPU", "--camera", "1928x1208")
  assert r.returncode == 0 and r.stderr == "", r.stderr
  assert f"{cpu_artifact_1928}: OK" in r.stdout and "1928x1208" in r.stdout
  sha = hashlib.sha256((tiny_models / "driving_vision.onnx").read_bytes()).hexdigest()
  assert sha[:16] in r.stdout


@pytest.mark.xdist_group("cpu_artifact_1344")
def test_api_compile_then_verify_1344(cpu_artifact_1344, tiny_models):
  art = verify_artifact(cpu_artifact_1344, device="CPU", camera=(1344, 760))
  nv = nv12_info(1344, 760)
  assert art.camera == (1344, 760) and art.meta["camera"]["size"] == nv.size and art.meta["camera"]["stride"] == nv.stride
  for kind in ("vision", "policy"):
    path = tiny_models / f"driving_{kind}.onnx"
    assert art.meta["models"][kind]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
  assert art.output_slices("vision") == VISION_SLICES and art.output_slices("policy") == POLICY_SLICES
  assert sorted(os.listdir(cpu_artifact_1344)) == sorted(["manifest.json", "metadata.json", "driving_policy.pkl", "driving_warp.pkl"])
  assert not [p for p in os.listdir(cpu_artifact_1344.parent) if ".tmp-" in p], "temp dir left behind"


# the 1928 case adds ~25 s of first-run kernel codegen for its own unjitted program; its artifact comes from another process
CAM_1928_SLOW = pytest.param((1928, 1208), marks=(pytest.mark.xdist_group("cpu_artifact_1928"), pytest.mark.slow), id="1928x1208")


@pytest.mark.parametrize("camera", [CAM_1928_SLOW, CAM_1344])
def test_loaded_artifact_equals_fresh_unjitted_program(camera, tiny_models, request):
  """ModelState (verify + unpickle + run, the runtime path) against DrivingProgram built from the ONNX files in this
  process: bit-exact outputs over full and dropped (warp-only) frames with new buffers and host inputs each step."""
  from modeld_msm.model_state import ModelState
  art = request.getfixturevalue(f"cpu_artifact_{camera[0]}")
  state = ModelState(art, device="CPU", camera=camera)
  prog = _unjitted(tiny_models, camera, state.artifact.meta["precision"]["compute"])
  nv, rng = nv12_info(*camera), np.random.default_rng(1)
  host, prev_desire, outs = host_of(), np.zeros(8, np.float32), []
  host_t = host_tensors(host)
  for step, kind in enumerate("PWP"):  # a full step after a dropped frame is where aliasing JIT buffers showed up
    bufs = [rng.integers(0, 256, nv.size, dtype=np.uint8) for _ in range(2)]
    desire_in = np.zeros(8, np.float32)
    desire_in[1 + step % 3] = 1
    _random_host(rng, host)
    host["desire"][:] = np.where(desire_in - prev_desire > .99, desire_in, 0)  # the pulse ModelState makes from desire_in
    prev_desire = desire_in
    parsed, raw = state.run(bufs[0], bufs[1], host["tfm"].copy(), host["big_tfm"].copy(), desire_in, host["traffic_convention"].copy(), kind == "W")
    args = (frame_tensor(bufs[0], "CPU"), frame_tensor(bufs[1], "CPU"), host_t["desire"], host_t["traffic_convention"], host_t["tfm"],
            host_t["big_tfm"])
    if kind == "W":
      assert parsed is None and raw is None
      prog.run_warp(*args)
      continue
    v, p = prog.run_policy(*args)
    want = np.concatenate([v.numpy().reshape(-1), p.numpy().reshape(-1)])
    assert raw.shape == (1576 + 1000,) and np.isfinite(raw).all()
    assert np.array_equal(raw, want), f"step {step}: max |diff| {np.abs(raw - want).max()}"
    assert {"plan", "lane_lines", "lead", "pose", "desire_state", "meta"} <= set(parsed)
    outs.append(raw)
  assert not np.array_equal(outs[-1], outs[-2]), "outputs must follow the inputs"


@pytest.mark.parametrize("kind", ["vision", "policy"])
def test_tinygrad_matches_onnxruntime_within_compile_tolerance(tiny_models, tmp_path, kind):
  """OnnxRunner vs onnxruntime on the raw models with the tolerance compile enforces, and that tolerance is not vacuous:
  the same architecture with other weights falls outside it."""
  ort = pytest.importorskip("onnxruntime")
  from tinygrad import Tensor
  from tinygrad.nn.onnx import OnnxRunner
  path = tiny_models / f"driving_{kind}.onnx"
  other = write_models(tmp_path, "tiny", seed=1)[kind].path
  info = load_model_info(path, kind)
  rng = np.random.default_rng(5)
  feeds = {n: rng.integers(0, 256, s, dtype=np.uint8) if info.input_dtypes[n] == "uint8" else rng.standard_normal(s).astype(np.float16)
           for n, s in info.input_shapes.items()}
  got = next(iter(OnnxRunner(path)({k: Tensor(v) for k, v in feeds.items()}).values())).float().numpy()

  def within(ref_path: Path) -> np.ndarray:
    ref = ort.InferenceSession(str(ref_path), providers=["CPUExecutionProvider"]).run(None, feeds)[0].astype(np.float32)
    assert ref.shape == got.shape == (1, info.output_width)
    return np.abs(got - ref) <= ORT_ATOL + ORT_RTOL * np.abs(ref)

  assert within(path).all()
  assert not within(other).all()


# ---------------------------------------------------------------------------------------------------------------- queue semantics

def _probe_models(d: Path) -> Path:
  """Contract-shaped models whose outputs are copies of their inputs, so the queues can be read off the outputs.
  vision: [img[0,c,0,0] for 12 c, big_img[0,c,0,0] for 12 c, zeros, hidden_state = img[0,6:8,0,:] (the current frame)]
  policy: [features_buffer[0,:,0] (25), desire_pulse (25*8), traffic_convention (2), zeros] -- all exact in fp16."""
  d.mkdir(parents=True, exist_ok=True)
  f16, u8 = TensorProto.FLOAT16, TensorProto.UINT8

  def const(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)

  def save(kind, inputs, nodes, inits, width, slices):
    graph = helper.make_graph(nodes, f"probe_{kind}", inputs, [helper.make_tensor_value_info("outputs", f16, (1, width))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(model, {"output_slices": encode_output_slices(slices)})
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, d / f"driving_{kind}.onnx")

  V = helper.make_node
  vin = [helper.make_tensor_value_info(n, u8, (1, 12, 128, 256)) for n in ("img", "big_img")]
  vinits = [const("s0", [0, 0, 0, 0]), const("e0", [1, 12, 1, 1]), const("sh", [0, 6, 0, 0]), const("eh", [1, 8, 1, 256]),
            const("r12", [1, 12]), const("r512", [1, 512]), const("zv", np.zeros((1, 1064 - 24), np.float16))]
  vnodes = [V("Slice", ["img", "s0", "e0"], ["a"]), V("Reshape", ["a", "r12"], ["a2"]), V("Cast", ["a2"], ["a3"], to=f16),
            V("Slice", ["big_img", "s0", "e0"], ["b"]), V("Reshape", ["b", "r12"], ["b2"]), V("Cast", ["b2"], ["b3"], to=f16),
            V("Slice", ["img", "sh", "eh"], ["h"]), V("Reshape", ["h", "r512"], ["h2"]), V("Cast", ["h2"], ["h3"], to=f16),
            V("Concat", ["a3", "b3", "zv", "h3"], ["outputs"], axis=1)]
  save("vision", vin, vnodes, vinits, 1576, VISION_SLICES)
  pin = [helper.make_tensor_value_info("features_buffer", f16, (1, 25, 512)), helper.make_tensor_value_info("desire_pulse", f16, (1, 25, 8)),
         helper.make_tensor_value_info("traffic_convention", f16, (1, 2))]
  pinits = [const("s0", [0, 0, 0]), const("e0", [1, 25, 1]), const("r25", [1, 25]), const("r200", [1, 200]),
            const("zp", np.zeros((1, 1000 - 227), np.float16))]
  pnodes = [V("Slice", ["features_buffer", "s0", "e0"], ["f"]), V("Reshape", ["f", "r25"], ["f2"]),
            V("Reshape", ["desire_pulse", "r200"], ["d2"]), V("Concat", ["f2", "d2", "traffic_convention", "zp"], ["outputs"], axis=1)]
  save("policy", pin, pnodes, pinits, 1000, POLICY_SLICES)
  return d


class _QueueModel:
  """The contract's queues in plain Python: image queues advance every frame, features and desire on full steps only."""

  def __init__(self):
    self.img, self.big = [None] * 5, [None] * 5
    self.feat, self.desire = [0.0] * 97, [np.zeros(8, np.float32)] * 100

  def step(self, t: int, desire: np.ndarray, full: bool) -> None:
    self.img, self.big = self.img[1:] + [t], self.big[1:] + [t]
    if full:
      self.feat = self.feat[1:] + [float(_base(t))]  # hidden_state[0] = ch0 of the current frame
      self.desire = self.desire[1:] + [desire.copy()]

  def expected(self, tc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    px = [0 if t is None else _base(t) + c for t in (self.img[0], self.img[4]) for c in range(6)]
    big = [0 if t is None else _big_base(t) + c for t in (self.big[0], self.big[4]) for c in range(6)]
    features = self.feat[0::FRAME_SKIP]
    pulses = np.stack([np.max(self.desire[FRAME_SKIP * k:FRAME_SKIP * (k + 1)], axis=0) for k in range(25)])
    return np.array(px + big, np.float32), np.concatenate([features, pulses.reshape(-1), tc.reshape(-1)]).astype(np.float32)


def _base(t: int) -> int:
  return 2 + 8 * t


def _big_base(t: int) -> int:
  return 245 - 8 * t


def _parity_frame(nv, base: int) -> np.ndarray:
  """Y = base + row parity + 2 * column parity, U = base + 4, V = base + 5: an identity warp then gives channel c == base + c."""
  f = np.zeros(nv.size, np.uint8)
  y = f[:nv.stride * nv.y_height].reshape(nv.y_height, nv.stride)
  y[:] = base + (np.arange(nv.y_height)[:, None] % 2) + 2 * (np.arange(nv.stride)[None, :] % 2)
  uv = f[nv.uv_offset:nv.uv_offset + nv.stride * nv.uv_height].reshape(nv.uv_height, nv.stride)
  uv[:, 0::2], uv[:, 1::2] = base + 4, base + 5
  return f


PLAN = "PPWPPWWPPPPPPPPPPP"  # 18 frames, 14 full steps: enough to fill several stride-4 feature slots


@pytest.mark.parametrize("jitted", [False, True], ids=["unjitted", "tinyjit"])
def test_queue_semantics(tmp_path, jitted):
  """img = frames t-4 and t; features = hidden states at stride 4 ending with the current one; desire max-pooled over
  groups of 4; warp-only steps advance only the image queues. Checked on every step, for the program and its JIT."""
  models = _probe_models(tmp_path / "probe")
  nv = nv12_info(1344, 760)
  prog = _unjitted(models, (1344, 760))
  run_policy, run_warp = prog.jits() if jitted else (prog.run_policy, prog.run_warp)
  host, model, rng = host_of(), _QueueModel(), np.random.default_rng(0)
  host_t = host_tensors(host)
  host["tfm"][:], host["big_tfm"][:] = np.eye(3), np.eye(3)
  frames = [(_parity_frame(nv, _base(t)), _parity_frame(nv, _big_base(t))) for t in range(len(PLAN))]  # a new buffer every frame
  for t, kind in enumerate(PLAN):
    host["desire"][:] = np.eye(8, dtype=np.float32)[t % 8] * (rng.random() < .5)
    host["traffic_convention"][:] = [[t % 2, 1 - t % 2]]
    args = (frame_tensor(frames[t][0], "CPU"), frame_tensor(frames[t][1], "CPU"), host_t["desire"], host_t["traffic_convention"],
            host_t["tfm"], host_t["big_tfm"])
    model.step(t, host["desire"], kind == "P")
    if kind == "W":
      img = run_warp(*args).numpy()
      want_px, _ = model.expected(host["traffic_convention"])
      assert np.array_equal(img[0, :, 0, 0], want_px[:12]), f"frame {t} (warp-only): image pair"
      continue
    v, p = (x.numpy().reshape(-1) for x in run_policy(*args))
    want_v, want_p = model.expected(host["traffic_convention"])
    assert np.array_equal(v[:24], want_v), f"frame {t}: image pair {v[:24]} != {want_v}"
    assert np.array_equal(v[1064:1064 + 256], np.full(256, _base(t))), f"frame {t}: hidden_state is not the current frame's"
    assert np.array_equal(p[:25], want_p[:25]), f"frame {t}: features_buffer {p[:25]} != {want_p[:25]}"
    assert np.array_equal(p[25:225], want_p[25:225]), f"frame {t}: desire_pulse"
    assert np.array_equal(p[225:227], want_p[225:227]), f"frame {t}: traffic_convention"
  # 14 full steps: slots 21..24 hold pushes 2, 6, 10, 14 (the current frame); older slots are still zero
  assert p[24] == _base(len(PLAN) - 1) and p[23] == _base(len(PLAN) - 5) and (p[:21] == 0).all() and (p[21:25] > 0).all()


# ---------------------------------------------------------------------------------------------------------------- bad input

def _compile_cli(capsys, vision, policy, out, camera="1928x1208") -> tuple[int, str]:
  rc = cli_main(["compile", "--vision", str(vision), "--policy", str(policy), "--camera", camera, "--device", "CPU", "-o", str(out)])
  err = capsys.readouterr().err
  return rc, err


def _edit(src: Path, dst: Path, fn) -> Path:
  m = onnx.load(str(src))
  fn(m)
  onnx.save(m, str(dst))
  return dst


def _rename_input(m, old: str, new: str) -> None:
  for i in m.graph.input:
    if i.name == old:
      i.name = new
  for n in m.graph.node:
    n.input[:] = [new if x == old else x for x in n.input]


def _set_dim(m, name: str, axis: int, value: int) -> None:
  next(i for i in m.graph.input if i.name == name).type.tensor_type.shape.dim[axis].dim_value = value


def _set_dtype(m, name: str, elem: int) -> None:
  next(i for i in m.graph.input if i.name == name).type.tensor_type.elem_type = elem


def _unsupported_op(m) -> None:
  """Route the output through GlobalLpPool (an opset-17 op tinygrad 0.14 lacks): (1,1576) -> (1,1576,1) -> |x| -> (1,1576)."""
  node = next(n for n in m.graph.node if n.output[0] == "outputs")
  m.graph.initializer.extend([numpy_helper.from_array(np.array([1, 1576, 1], np.int64), "lp_in"),
                              numpy_helper.from_array(np.array([1, 1576], np.int64), "lp_out")])
  nodes = [helper.make_node("Reshape", [node.input[0], "lp_in"], ["lp_x"]), helper.make_node("GlobalLpPool", ["lp_x"], ["lp_y"], p=2),
           helper.make_node("Reshape", ["lp_y", "lp_out"], ["outputs"])]
  m.graph.node.remove(node)
  m.graph.node.extend(nodes)
  onnx.checker.check_model(m, full_check=True)  # a valid model: only tinygrad's op coverage rejects it


def _no_slices(m) -> None:
  props = [p for p in m.metadata_props if p.key != "output_slices"]
  del m.metadata_props[:]
  m.metadata_props.extend(props)


BAD_MODELS = {
  # case: (which file, how to break it, words the message must contain)
  "missing_file": ("vision", None, ["not found", "missing.onnx"]),
  "random_bytes": ("policy", lambda src, dst: dst.write_bytes(np.random.default_rng(0).bytes(4096)), ["not a readable ONNX", "policy"]),
  "truncated": ("vision", lambda src, dst: dst.write_bytes(src.read_bytes()[:len(src.read_bytes()) // 3]), ["not a readable ONNX", "vision"]),
  "missing_input": ("vision", lambda s, d: _edit(s, d, lambda m: _rename_input(m, "big_img", "wide_img")), ["no input 'big_img'"]),
  "wrong_shape": ("vision", lambda s, d: _edit(s, d, lambda m: _set_dim(m, "img", 3, 512)), ["'img'", "shape", "(1, 12, 128, 512)"]),
  "wrong_dtype": ("policy", lambda s, d: _edit(s, d, lambda m: _set_dtype(m, "desire_pulse", TensorProto.INT32)), ["'desire_pulse'", "int32"]),
  "wrong_model": ("policy", lambda s, d: d.write_bytes((s.parent / "driving_vision.onnx").read_bytes()), ["is the vision model", "as --vision"]),
  "unsupported_op": ("vision", lambda s, d: _edit(s, d, _unsupported_op), ["GlobalLpPool", "tinygrad"]),
  "no_output_slices": ("policy", lambda s, d: _edit(s, d, _no_slices), ["output_slices"]),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_bad_model_is_one_line_error_and_nothing_written(case, tiny_models, tmp_path, capsys):
  which, breaker, words = BAD_MODELS[case]
  paths = {k: tiny_models / f"driving_{k}.onnx" for k in ("vision", "policy")}
  bad = tmp_path / ("missing.onnx" if breaker is None else f"bad_{which}.onnx")
  if breaker is not None:
    breaker(paths[which], bad)
  paths[which] = bad
  out = tmp_path / "out" / "artifact"
  before = sorted(os.listdir(tmp_path))
  rc, err = _compile_cli(capsys, paths["vision"], paths["policy"], out)
  assert rc == 2, err
  assert err.count("\n") == 1 and err.startswith("modeld-msm compile: error: ") and "Traceback" not in err, err
  for w in words:
    assert w in err, f"{w!r} not in {err!r}"
  assert sorted(os.listdir(tmp_path)) == before, "something was written"


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_output_fails_before_compiling(where, tiny_models, tmp_path, capsys):
  """We run as root, so permissions stop nothing: use a path under a regular file and one in /proc."""
  (tmp_path / "plain_file").write_text("x")
  out = tmp_path / "plain_file" / "artifact" if where == "under_a_file" else Path(f"/proc/modeld-msm-test-{os.getpid()}/artifact")
  before = sorted(os.listdir(tmp_path))
  rc, err = _compile_cli(capsys, tiny_models / "driving_vision.onnx", tiny_models / "driving_policy.onnx", out)
  assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err and str(out) in err, err
  assert "choose another -o" in err
  assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "plain_file").read_text() == "x"
  assert "[compile] loading" not in capsys.readouterr().out  # refused before any model was loaded


def test_bad_input_in_a_real_process(tmp_path, cli):
  """The in-process cases above, once as a real process: exit status 2, one stderr line, no traceback."""
  r = cli("compile", "--vision", tmp_path / "nope.onnx", "--policy", tmp_path / "nope2.onnx", "-o", tmp_path / "out")
  assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
  assert "nope.onnx" in r.stderr and not (tmp_path / "out").exists()
  r = cli("compile", "--vision", tmp_path / "nope.onnx", "--policy", tmp_path / "nope2.onnx", "--camera", "640x480", "-o", tmp_path / "out")
  assert r.returncode == 2 and "640x480" in r.stderr and r.stderr.count("\n") == 1
