"""Master's combined driving model compiled (compile/build.py) and its per-frame program checked against 0.11's
split program with teeth: the combined model fused from a pair, run through SupercomboProgram's JITs, gives what the pair
gives through DrivingProgram's JITs, frame after frame, dropped frames included; planted bugs (the hidden state fed back a
frame late, action_t swapped, 25 past features) each fail that check."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tinygrad import Tensor

from artifact.kinds import KINDS
from compile.onnx_model import load_model_info
from compile.programs.driving import driving_inputs
from compile.programs.driving_step import DrivingProgram, _push
from compile.programs.supercombo_step import SupercomboProgram
from compile.refmodels.driving import POLICY_SLICES, VISION_SLICES, write_models
from compile.refmodels.supercombo import LAT_T_GAIN, LONG_T_GAIN, PLAN_A0, PLAN_V0, PLAN_YAW_RATE0, slices, write_supercombo_model
from modeld_msm.named_program import host_arrays, host_tensors
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import nv12_info
from tests.conftest import run_cli

PLAN = "PPWPPPPWPPPPP"   # 11 runs: h(t-4) and h(t-8) of the program's own runs are among the inputs by the end
NV = nv12_info(1928, 1208)


@pytest.fixture(scope="module")
def pair_and_combined(tmp_path_factory):
  d = tmp_path_factory.mktemp("supercombo")
  pair = write_models(d / "pair", "tiny", 7)
  combined = write_supercombo_model(d / "combined", "tiny", 7)
  return (load_model_info(pair["vision"].path, "vision"), load_model_info(pair["policy"].path, "policy"),
          load_model_info(combined.path, "supercombo"))


def _disagreement(split: DrivingProgram, combo: SupercomboProgram) -> str | None:
  """Run both programs' JITs over PLAN on the same frames and host inputs; -> where they first disagree, or None."""
  (sp, sw), (cp, cw) = split.jits(), combo.jits()
  steps = driving_inputs(NV, "CPU", 3, len(PLAN))
  host_np = host_arrays(KINDS["driving"].program("step").as_meta())
  host_t = host_tensors(host_np)
  at_np = np.zeros((1, 2), np.float32)
  at = Tensor(at_np, device="NPY")
  rng = np.random.default_rng(5)
  for i, kind in enumerate(PLAN):
    for k, a in host_np.items():
      a[...] = steps[i][k]
    frame, big = steps[i]["frame"], steps[i]["big_frame"]
    desire, tc, tfm, big_tfm = (host_t[k] for k in ("desire", "traffic_convention", "tfm", "big_tfm"))
    at_np[...] = [[rng.uniform(0.1, 0.5), rng.uniform(0.3, 0.8)]]
    if kind == "W":
      sw(frame, big, desire, tc, tfm, big_tfm)
      cw(frame, big, desire, tc, at, tfm, big_tfm)
      continue
    v, p = (t.numpy()[0] for t in sp(frame, big, desire, tc, tfm, big_tfm))
    out = cp(frame, big, desire, tc, at, tfm, big_tfm).numpy()[0]
    for name, s in slices().items():
      if name == "action":
        plan0 = p[:15]
        want = [plan0[PLAN_V0] * plan0[PLAN_YAW_RATE0] + LAT_T_GAIN * at_np[0, 0], plan0[PLAN_A0] + LONG_T_GAIN * at_np[0, 1]]
        if not np.allclose(out[s][:2], want, atol=5e-3):
          return f"step {i}: action {out[s][:2]} vs {want}"
        continue
      ref = v[VISION_SLICES[name]] if name in VISION_SLICES else p[POLICY_SLICES[name]]
      if not np.allclose(out[s], ref, atol=1e-4, rtol=1e-4):
        return f"step {i}: {name} differs by {np.abs(out[s] - ref).max():.3g}"
  return None


def test_combined_program_is_the_split_program_frame_after_frame(pair_and_combined):
  vinfo, pinfo, cinfo = pair_and_combined
  assert _disagreement(DrivingProgram(vinfo, pinfo, NV, "CPU"), SupercomboProgram(cinfo, NV, "CPU")) is None


class _LateFeedback(SupercomboProgram):
  """Planted: the hidden states reach the model one run late (h(t-5) ... h(t-97) instead of h(t-4) ... h(t-96))."""

  def __init__(self, *a, **kw):
    super().__init__(*a, **kw)
    self.feat_q = Tensor.zeros(97, 1, 512, device=self.device).contiguous().realize()

  def run_policy(self, frame, big_frame, desire, traffic_convention, action_t, tfm, big_tfm):
    img, big_img = self._warp(frame, big_frame, tfm, big_tfm)
    features = self.feat_q[:96][0::4].reshape(1, 24, 512).contiguous().realize()
    desire_q = _push(self.desire_q, desire.to(self.device).cast("float32"))
    pulses = desire_q.reshape(25, 4, 1, 8).max(1).reshape(1, 25, 8)
    feeds = {"img": img, "big_img": big_img, "features_buffer": features, "desire_pulse": pulses,
             "traffic_convention": traffic_convention.to(self.device), "action_t": action_t.to(self.device)}
    out = next(iter(self.model({k: v.cast(self.dtypes[k]) for k, v in feeds.items()}).values())).cast("float32").realize()
    _push(self.feat_q, out[:, self.hidden])
    Tensor.realize(self.img_q, self.big_img_q, self.feat_q, self.desire_q)
    return out


class _SwappedActionT(SupercomboProgram):
  """Planted: action_t fed as [longitudinal, lateral]."""

  def run_policy(self, frame, big_frame, desire, traffic_convention, action_t, tfm, big_tfm):
    return super().run_policy(frame, big_frame, desire, traffic_convention, action_t.to(self.device)[:, ::-1].contiguous(), tfm, big_tfm)


def test_planted_bugs_fail_the_equivalence(pair_and_combined):
  vinfo, pinfo, cinfo = pair_and_combined
  late = _disagreement(DrivingProgram(vinfo, pinfo, NV, "CPU"), _LateFeedback(cinfo, NV, "CPU"))
  assert late is not None and "action" not in late, late   # the features, hence the plan and heads, drift
  swapped = _disagreement(DrivingProgram(vinfo, pinfo, NV, "CPU"), _SwappedActionT(cinfo, NV, "CPU"))
  assert swapped is not None and "action" in swapped, swapped


def test_25_past_features_are_refused_by_the_contract(pair_and_combined, tmp_path):
  """The last planted bug, 25 past rows fed: the model declares 24, so a combined model built for it is not master's."""
  _, _, cinfo = pair_and_combined
  import onnx
  m = onnx.load(str(cinfo.path))
  for i in m.graph.input:
    if i.name == "features_buffer":
      i.type.tensor_type.shape.dim[1].dim_value = 25
  bad = tmp_path / "driving_supercombo.onnx"
  onnx.save(m, str(bad))
  with pytest.raises(UserError, match=r"'features_buffer' has shape \(1, 25, 512\), expected \(1, 24, 512\)"):
    load_model_info(bad, "supercombo")


def test_compile_cli_writes_a_supercombo_artifact_verify_names(pair_and_combined, tmp_path):
  _, _, cinfo = pair_and_combined
  out = tmp_path / "art"
  r = run_cli("compile", "--model", cinfo.path, "--device", "CPU", "-o", out, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  for row in ("model contract", "supercombo vs onnxruntime", "jit == unjitted", "pickle reload"):
    assert row in r.stdout, (row, r.stdout)
  meta = json.loads((out / "metadata.json").read_text())
  assert meta["kind"] == meta["contract"] == "supercombo" and meta["feature_feedback"] == "device"
  assert meta["models"]["supercombo"]["input_shapes"]["action_t"] == [1, 2]
  v = run_cli("verify", out, timeout=120)
  assert v.returncode == 0 and "kind     supercombo" in v.stdout, v.stdout + v.stderr
  dm = run_cli("serve-dm", "--artifact", out, timeout=120)
  assert dm.returncode == 2 and "combined driving model of openpilot master" in dm.stderr and "Traceback" not in dm.stderr, dm.stderr
  both = run_cli("compile", "--model", cinfo.path, "--vision", cinfo.path, "--policy", cinfo.path, "-o", tmp_path / "x", timeout=120)
  assert both.returncode == 2 and "in place of 0.11's --vision/--policy" in both.stderr and not (tmp_path / "x").exists()
  master = run_cli("compile", "--model", cinfo.path, "--openpilot", "0.11", "-o", tmp_path / "y", timeout=120)
  assert master.returncode == 2 and "is master's driving model" in master.stderr and not (tmp_path / "y").exists(), master.stderr


@pytest.mark.slow
def test_qcom_capture_builds_under_masters_image1_flags_and_matches_onnxruntime(pair_and_combined, tmp_path):
  """Master's modeld builds QCOM with IMAGE=1 (0.11: IMAGE=2): the combined model's capture takes master's flags, and its
  IMAGE=1 kernels run on the emulated a630 (level B) within onnxruntime's tolerance, jitted == unjitted, replayed from the
  pickles through the MSM submit path."""
  _, _, cinfo = pair_and_combined
  out = tmp_path / "qcom"
  r = run_cli("compile", "--model", cinfo.path, "--device", "QCOM", "-o", out, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "capture flags (openpilot master's): FLOAT16=1 NOLOCALS=1 JIT_BATCH_SIZE=0 OPENPILOT_HACKS=1 IMAGE=1" in r.stdout, r.stdout
  rows = {line.split("  ")[0].strip(): line for line in r.stdout.splitlines()}
  for row in ("supercombo vs onnxruntime", "jit == unjitted", "pickle replay (EMU)"):
    assert row in rows and " ok " in rows[row], (row, r.stdout)
  meta = json.loads((out / "metadata.json").read_text())
  assert meta["flags"]["IMAGE"] == 1 and meta["openpilot"] == "master" and meta["kernel_us"]
  assert "IMAGE_PITCH_ALIGNMENT" in meta["arch"]   # the device opened under IMAGE
