"""The car's program, executed: the tiny reference models compiled for QCOM under openpilot's flags run frame after frame
through ModelState on the emulated a630 (level B) and match the CPU artifact on the same frames.

Tolerance: the QCOM program keeps activations and weights in fp16 (FLOAT16=1, RGBA16F images), 11 significant bits, and
its reductions run in another order than the CPU's fp32 ones, so outputs agree to |a-b| <= 2e-2 + 2e-2*|ref| — the bound
the compile step already uses against onnxruntime. Measured: max |diff| ~5e-3 on outputs of magnitude ~3.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json

import numpy as np
import pytest
from test_ir3 import executing, fault_policy

from selfdrive_glue.nv12 import nv12_info

pytestmark = pytest.mark.xdist_group("qcom_artifact")
RTOL, ATOL = 2e-2, 2e-2
INFO = nv12_info(1928, 1208)
TFM = np.array([[2.9, 0.0, 219.0], [0.0, 2.9, 465.0], [0.0, 0.0, 1.0]], np.float32)
BIG = np.array([[1.25, 0.0, 645.0], [0.0, 1.25, 415.0], [0.0, 0.0, 1.0]], np.float32)


@contextlib.contextmanager
def _device(monkeypatch, dev: str):
  from tinygrad.helpers import DEV
  old = DEV.value
  monkeypatch.setenv("MODELD_DEV", dev)
  try:
    yield
  finally:
    DEV.value = old


def _frames(n: int) -> list[np.ndarray]:
  rng = np.random.default_rng(3)
  return [rng.integers(0, 256, INFO.size, dtype=np.uint8) for _ in range(n)]


def _steps(artifact, monkeypatch, dev: str, frames, plan="PPWPP") -> list[tuple[dict, np.ndarray]]:
  from modeld_msm.model_state import ModelState
  with _device(monkeypatch, dev):
    ms = ModelState(artifact)
    out = []
    for i, kind in enumerate(plan):
      parsed, raw = ms.run(frames[i % len(frames)], frames[(i + 1) % len(frames)], TFM, BIG, np.eye(8, dtype=np.float32)[i % 8],
                           np.array([[1, 0]], np.float32), kind == "W")
      if kind == "P":
        out.append(({k: np.array(v, copy=True) for k, v in parsed.items()}, raw.copy()))
    return out


def _excess(ref: np.ndarray, got: np.ndarray) -> tuple[float, int]:
  e = np.abs(got.astype(np.float64) - ref) - (ATOL + RTOL * np.abs(ref.astype(np.float64)))
  return float(e.max()), int(np.argmax(e))


@pytest.fixture(scope="module")
def cpu_reference(cpu_artifact_1928):
  mp = pytest.MonkeyPatch()
  try:
    return _steps(cpu_artifact_1928, mp, "CPU", _frames(3))
  finally:
    mp.undo()


def test_compile_checks_the_a630_numbers(qcom_artifact):
  """compile --device QCOM runs the onnxruntime rows and the JIT check on the executing emulator, like a CPU compile."""
  checks = {c: (r, d) for c, r, d in json.loads((qcom_artifact / "metadata.json").read_text())["validation"]["checks"]}
  for row in ("vision vs onnxruntime", "policy vs onnxruntime", "jit == unjitted"):
    assert checks[row][0] == "ok", (row, checks[row])
  assert "executed (level B)" in checks["pickle replay (EMU)"][1]


def test_tiny_models_on_the_emulated_a630_match_the_cpu(qcom_artifact, cpu_reference, monkeypatch):
  with executing() as node:
    tex0 = node.exec_total.tex
    got = _steps(qcom_artifact, monkeypatch, "EMU+QCOM:IR3", _frames(3))
    assert node.exec_total.tex > tex0, "the program's IMAGE=2 texture reads did not execute"
  assert len(got) == len(cpu_reference) == 4
  for step, ((p_ref, r_ref), (p_got, r_got)) in enumerate(zip(cpu_reference, got)):
    assert np.isfinite(r_got).all()
    ex, i = _excess(r_ref, r_got)
    assert ex <= 0, f"step {step}: raw output {i}: emulated {r_got[i]} vs CPU {r_ref[i]}"
    for field in ("plan", "lane_lines", "lead", "pose", "road_transform", "desire_state", "meta"):
      ex, i = _excess(p_ref[field].reshape(-1), p_got[field].reshape(-1))
      assert ex <= 0, f"step {step}: modelV2 source field {field}[{i}] differs beyond fp16 tolerance"
  # the comparison would see a broken program: consecutive steps differ (the inputs change) and so do both devices alike
  assert not np.allclose(got[0][1], got[1][1])


def test_native_runs_give_the_closures_bits_on_the_cars_program(qcom_artifact, monkeypatch):
  """The program with its isam fetches (IMAGE=2 weights), conv loops and predicated tails: EMU_NATIVE=1 and =0 give the
  same bits and the same executed work, and the native side did run texel fetches."""
  from test_ir3_compiled import native_calls
  runs = {}
  with executing() as node:
    for flag in ("0", "1"):
      monkeypatch.setenv("EMU_NATIVE", flag)
      before = dataclasses.replace(node.exec_total)
      with native_calls() as calls:
        runs[flag] = (_steps(qcom_artifact, monkeypatch, "EMU+QCOM:IR3", _frames(3)), dict(calls))
      after = node.exec_total
      runs[flag] += ((after.instrs - before.instrs, after.tex - before.tex, after.mem_load - before.mem_load),)
  (closures, c_calls, c_work), (nat, n_calls, n_work) = runs["0"], runs["1"]
  assert c_calls == {} and n_calls["isam"] > 0, (c_calls, n_calls)
  assert c_work == n_work and c_work[1] > 0
  for (p_c, r_c), (p_n, r_n) in zip(closures, nat):
    assert r_c.tobytes() == r_n.tobytes()
    assert all(np.asarray(p_c[k]).tobytes() == np.asarray(p_n[k]).tobytes() for k in p_c)


def test_frames_imported_as_dmabufs_give_the_copied_frames_bits(qcom_artifact, monkeypatch):
  """The warp reading the camera's own dma-buf pages (imported, no copy) computes what it computes from a copy of the same
  frames, bit for bit, on the executing a630; and the frames were imported, once per buffer."""
  import mmap
  import os

  from backend.emu import dmabuf
  from selfdrive_glue import visionipc
  frames = _frames(3)
  fds, maps, views = [], [], []
  for f in frames:
    fds.append(fd := dmabuf.export(INFO.size + 8, "road"))
    maps.append(m := mmap.mmap(fd, INFO.size + 8))
    views.append(v := np.frombuffer(m, dtype=np.uint8, count=INFO.size))
    v[:] = f
    visionipc.register_dmabuf(v, fd)
  try:
    with executing() as node:
      it = _emu_iface()
      imports = it.stats["import"]
      shared = _steps(qcom_artifact, monkeypatch, "EMU+QCOM:IR3", views)
      assert it.stats["import"] - imports == 3 and node is it.node
      copied = _steps(qcom_artifact, monkeypatch, "EMU+QCOM:IR3", [f.copy() for f in frames])
    for (p_s, r_s), (p_c, r_c) in zip(shared, copied):
      assert r_s.tobytes() == r_c.tobytes()
      assert all(np.asarray(p_s[k]).tobytes() == np.asarray(p_c[k]).tobytes() for k in p_s)
  finally:
    for v in views:
      visionipc._DMABUF_FDS.pop(v.ctypes.data, None)
    del views, maps
    for fd in fds:
      os.close(fd)


def _emu_iface():
  from test_ir3 import _emu
  return _emu().iface


def _flip_first_mad_source(kernel_has: str = "mad.f32"):
  """A tamper hook: in the first kernel that has a `mad.f32` with a register source, that source reads the next component."""
  from backend.emu.ir3.decode import decode
  hit: dict[str, str] = {}

  def tamper(d):
    prog = decode(d.shader)
    ins = next((i for i in prog.instrs if i.name == kernel_has and i.srcs[0].kind == "r" and not i.srcs[0].half), None)
    if ins is None or (hit and hit["shader"] != d.shader):
      return d
    hit["shader"] = d.shader
    raw = bytearray(d.shader)
    raw[ins.index * 8] ^= 1          # SRC1's component bit: rN.x <-> rN.y
    hit["before"], hit["after"] = ins.text, decode(bytes(raw)).instrs[ins.index].text
    return dataclasses.replace(d, shader=bytes(raw))
  return tamper, hit


def _worst_excess_when_tampered(tamper, artifact, cpu_reference, monkeypatch) -> float:
  """The car's program run with `tamper` rewriting its dispatches: how far its raw outputs leave the fp16 bound (> 0: out).
  Strict fault policy: a tamper that made the GPU fault must raise, not pass as "outputs left the bound" (under the kernel
  policy a page fault is silent and abandons the dispatch, which would break the outputs for another reason)."""
  with executing() as node, fault_policy(node, "strict"):
    node.tamper = tamper
    try:
      got = _steps(artifact, monkeypatch, "EMU+QCOM:IR3", _frames(3))
    finally:
      node.tamper = None
  return max(_excess(r_ref, r_got)[0] for (_, r_ref), (_, r_got) in zip(cpu_reference, got))


def test_a_flipped_source_register_breaks_the_comparison(qcom_artifact, cpu_reference, monkeypatch):
  """The check has teeth: one source register changed in one kernel of the car's program and the outputs leave the bound."""
  tamper, hit = _flip_first_mad_source()
  worst = _worst_excess_when_tampered(tamper, qcom_artifact, cpu_reference, monkeypatch)
  assert hit["before"] != hit["after"]
  assert worst > 0, f"flipping '{hit['before']}' -> '{hit['after']}' went unnoticed"


def test_a_corrupt_image_descriptor_breaks_the_comparison(qcom_artifact, cpu_reference, monkeypatch):
  """Halving every texture's width in its descriptor makes isam read other texels (or none): the outputs leave the bound."""
  from tinygrad.runtime.autogen import mesa
  mask = mesa.A6XX_TEX_CONST_1_WIDTH__MASK   # width sits at bit 0 of the descriptor's second dword

  def narrow(d):
    t = bytearray(d.textures)
    for off in range(0, len(t), 64):
      w = int.from_bytes(t[off + 4:off + 8], "little")
      t[off + 4:off + 8] = ((w & ~mask) | max(1, (w & mask) // 2)).to_bytes(4, "little")
    return dataclasses.replace(d, textures=bytes(t))
  assert _worst_excess_when_tampered(narrow, qcom_artifact, cpu_reference, monkeypatch) > 0


def test_locator_names_the_first_divergent_kernel():
  """tinygrad's per-kernel CPU validation on the executing emulator points at the tampered kernel by name."""
  from tinygrad import Tensor
  from tinygrad.helpers import Context

  from backend.emu.ir3.locate import first_divergent_kernel
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal((1, 12, 16, 32)).astype(np.float32), rng.standard_normal((16, 12, 3, 3)).astype(np.float32)
  tamper, hit = _flip_first_mad_source()
  with executing() as node, fault_policy(node, "strict"), Context(FLOAT16=1, NOLOCALS=1, IMAGE=2):   # a fault raises, not diverges
    xt, wt = Tensor(x, device="QCOM").realize(), Tensor(w, device="QCOM").realize()
    assert first_divergent_kernel(lambda: xt.conv2d(wt, padding=1).relu().numpy(), node) is None
    node.tamper = tamper
    try:
      where = first_divergent_kernel(lambda: (xt.conv2d(wt, padding=1).relu() + 1).numpy(), node)
    finally:
      node.tamper = None
    names = [n for n, _ in node.counts]
  assert where is not None and "first kernel whose output diverged from the CPU" in where, where
  assert where.split(": ")[1].split(" (")[0] in names, (where, names[-5:])


@pytest.mark.slow
def test_modeld_process_publishes_the_a630_numbers(qcom_artifact, cpu_artifact_1928, prefix):
  """`python -m modeld_msm.modeld` on the QCOM artifact with EMU_EXEC=1 publishes what the CPU artifact publishes for the
  same frames. The camera sends one constant image, so once the feature queue has turned over (> 25 steps) both processes
  hold the same state whatever their start-up, and the published plan and lane lines must agree within the fp16 bound."""
  from conftest import ModeldHarness, stop_process
  last = {}
  for name, art, env in (("cpu", cpu_artifact_1928, {"MODELD_DEV": "CPU"}),
                         ("emu", qcom_artifact, {"MODELD_DEV": "EMU+QCOM:IR3", "EMU_EXEC": "1"})):
    h = ModeldHarness(art, env=env)
    try:
      m, _ = h.start(1, tries=1200)   # up to 5 min: the QCOM artifact loads and its first steps run interpreted
      for n in range(2, 32):
        m, _ = h.step(n, timeout=60)
        assert m is not None, stop_process(h.proc)
      last[name] = {f: np.array(list(getattr(m.position, f))) for f in ("x", "y", "z")}
      last[name]["lanes"] = np.array([list(ln.y) for ln in m.laneLines])
    finally:
      h.close()
  for f in last["cpu"]:
    ref, got = last["cpu"][f], last["emu"][f]
    assert ref.shape == got.shape and np.isfinite(got).all()
    ex, i = _excess(ref.reshape(-1), got.reshape(-1))
    assert ex <= 0, f"modelV2 {f}[{i}]: emulated a630 {got.reshape(-1)[i]} vs CPU {ref.reshape(-1)[i]}"


@pytest.mark.slow
def test_full_size_program_on_the_emulated_a630_matches_the_cpu(tmp_path_factory, cli, monkeypatch):
  """The full reference models (openpilot 0.11.1's compute budget), compiled for QCOM under openpilot's flags with the compile
  step's own numerics checks executed on the emulated a630, run through ModelState and match their CPU artifact."""
  from compile.refmodels.driving import write_models
  d = tmp_path_factory.mktemp("full")
  write_models(d / "models", "full", 0)
  arts = {}
  for dev in ("CPU", "QCOM"):
    arts[dev] = d / dev
    r = cli("compile", "--vision", d / "models" / "driving_vision.onnx", "--policy", d / "models" / "driving_policy.onnx",
            "--camera", "1928x1208", "--device", dev, "-o", arts[dev], timeout=3000)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  checks = {c: res for c, res, _ in json.loads((arts["QCOM"] / "metadata.json").read_text())["validation"]["checks"]}
  assert checks["vision vs onnxruntime"] == checks["policy vs onnxruntime"] == checks["pickle replay (EMU)"] == "ok"
  frames = _frames(3)
  ref = _steps(arts["CPU"], monkeypatch, "CPU", frames, plan="PWP")
  with executing():
    got = _steps(arts["QCOM"], monkeypatch, "EMU+QCOM:IR3", frames, plan="PWP")
  for step, ((_, r_ref), (_, r_got)) in enumerate(zip(ref, got)):
    ex, i = _excess(r_ref, r_got)
    assert np.isfinite(r_got).all() and ex <= 0, f"step {step}: raw output {i}: emulated {r_got[i]} vs CPU {r_ref[i]}"
  assert not np.allclose(got[0][1], got[1][1])
