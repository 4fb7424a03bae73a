"""Training: the graph that is trained computes what the shipped ONNX computes, and training moves it toward the truth."""
from __future__ import annotations

import json

import numpy as np
import pytest

from compile.refmodels.driving import POLICY_WIDTH, VISION_SLICES, VISION_WIDTH, build_model


def _feeds(kind: str, rng, batch: int = 1) -> dict[str, np.ndarray]:
  if kind == "vision":
    return {k: rng.integers(0, 256, (batch, 12, 128, 256), dtype=np.uint8) for k in ("img", "big_img")}
  return {"features_buffer": rng.standard_normal((batch, 25, 512)).astype(np.float16), "desire_pulse": np.zeros((batch, 25, 8), np.float16),
          "traffic_convention": np.tile(np.array([[1, 0]], np.float16), (batch, 1))}


def _ort(model, feeds):
  import onnxruntime as ort
  return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0].astype(np.float32)


@pytest.mark.parametrize("kind,width", [("vision", VISION_WIDTH), ("policy", POLICY_WIDTH)])
def test_trainable_graph_matches_onnxruntime_and_exports_its_fold(kind, width):
  from tinygrad import Tensor

  from offcar.train.graph import TrainableGraph
  rng = np.random.default_rng(1)
  model = build_model(kind, "tiny", 3)
  g = TrainableGraph(model, width)
  feeds = _feeds(kind, rng)
  ref = _ort(model, feeds)
  out = g({k: Tensor(v) for k, v in feeds.items()}).numpy()
  assert np.abs(out - ref).max() < 2e-2 * (1 + np.abs(ref).max())   # fp32 here, fp16 inside onnxruntime's run

  # a scale/offset on every foldable column is carried by the exported fp16 graph, not by extra ops
  scale, offset = np.ones(width, np.float32), np.zeros(width, np.float32)
  cols = np.concatenate([c[c >= 0] for c in g.fold.values()])
  scale[cols], offset[cols] = 4.0, -2.5
  g.set_output_affine(scale, offset)
  folded = g({k: Tensor(v) for k, v in feeds.items()}).numpy()
  np.testing.assert_allclose(folded, out * scale + offset, rtol=1e-5, atol=1e-4)
  exported = g.export()
  assert [n.op_type for n in exported.graph.node] == [n.op_type for n in model.graph.node]
  assert np.abs(_ort(exported, feeds) - folded).max() < 5e-2 * (1 + np.abs(folded).max())
  if kind == "vision":   # hidden_state ends in a normalisation: it cannot carry a fold
    hs = VISION_SLICES["hidden_state"]
    assert not np.isin(np.arange(hs.start, hs.stop), cols).any()
    bad = scale.copy()
    bad[hs.start] = 2.0
    with pytest.raises(ValueError, match="outside a head Gemm"):
      g.set_output_affine(bad, offset)


def test_feature_buffers_are_the_queue_modeld_keeps():
  from offcar.train.data import Drives, feature_buffers
  n = 60
  drives = Drives(np.zeros((n, 2, 6, 128, 256), np.uint8), np.repeat([0, 1], 30), np.tile(np.arange(30), 2), [None] * n, [0, 1], "1928x1208")
  hidden = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 512), np.float32) + 1
  buf = feature_buffers(hidden, drives, np.array([0, 10, 29, 31]))
  assert (buf[0, :24] == 0).all() and (buf[0, 24] == 1).all()                 # first frame: only itself, zeros before
  np.testing.assert_array_equal(buf[1, 14:, 0], np.arange(1, 12))            # frames 0..10 in order, newest last
  np.testing.assert_array_equal(buf[2, :, 0], np.arange(6, 31))              # a full history
  assert (buf[3, :23] == 0).all() and list(buf[3, 23:, 0]) == [31, 32]       # a new drive does not see the previous one


@pytest.mark.slow
def test_training_reduces_the_loss_and_writes_a_loadable_pair(tmp_path):
  import onnx

  from offcar.train.recipe import Recipe, train
  recipe = Recipe(seed=1, train_drives=3, eval_drives=1, frames_per_drive=6, vision_steps=30, policy_steps=30, batch=4, lr=3e-3)
  logs: list[str] = []
  info = train(recipe, tmp_path, log=logs.append)
  for kind in ("vision", "policy"):
    m = onnx.load(str(tmp_path / f"driving_{kind}.onnx"))
    onnx.checker.check_model(m)
    assert {p.key: p.value for p in m.metadata_props}["model_checkpoint"] == "modeld-msm-stand-in-tiny-seed1"
  saved = json.loads((tmp_path / "recipe.json").read_text())
  assert saved["recipe"]["seed"] == 1 and saved["metrics"] == info["metrics"] and saved["metrics"]["frames"] == 5
  for label in ("vision", "policy"):
    line = next(x for x in logs if x.startswith(f"[train] {label}: loss"))
    first, last = (float(v) for v in line.split("loss ")[1].split(" over")[0].split(" -> "))
    assert last < first, line
  assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))


def test_dm_targets_follow_the_cabin_truth():
  from compile.refmodels.dmonitoring import DM_SLICES
  from offcar.train.dm_data import render_cabins
  from offcar.train.dm_targets import dm_targets
  c = render_cabins([20_000_001, 20_000_002], 8, 0.1, progress=False)
  t = dm_targets(c)
  face = np.array([tr.face for tr in c.truths])
  assert 0 < face.sum() < len(face) and any(tr.eyes_closed for tr in c.truths)   # training oversamples both rare classes
  d = DM_SLICES["face_descs_lhd"].start
  np.testing.assert_allclose(t.y[:, d + 1], [tr.yaw for tr in c.truths], rtol=1e-6)
  assert np.all(t.w[~face, d:d + 6] == 0)                                       # no pose loss without a face
  blink = DM_SLICES["left_blink_prob_lhd"].start
  assert np.all(t.w[[tr.sunglasses for tr in c.truths], blink] == 0)            # eyes behind sunglasses are not judged
  assert np.all(t.y[:, DM_SLICES["face_prob_rhd"].start] == 0) and np.all(t.w[:, DM_SLICES["features"]] == 0)
  assert set(c.camera) == {"1928x1208", "1344x760"} and np.all(np.abs(c.position) < 0.5)


@pytest.mark.slow
def test_dm_training_reduces_the_loss_and_writes_a_loadable_model(tmp_path, cli):
  import onnx

  from compile.onnx_model import load_model_info
  r = cli("train-dm", "-o", str(tmp_path), "--seed", "2", "--scenes", "2", "--frames", "6", "--steps", "12", "--batch", "4",
          "--eval-scenes", "1", "--eval-frames", "6", timeout=600)
  assert r.returncode == 0, r.stderr
  assert "held-out face orientation error p50" in r.stdout
  m = onnx.load(str(tmp_path / "dmonitoring_model.onnx"))
  assert {p.key: p.value for p in m.metadata_props}["model_checkpoint"] == "modeld-msm-dm-stand-in-tiny-seed2"
  load_model_info(tmp_path / "dmonitoring_model.onnx", "dmonitoring")
  saved = json.loads((tmp_path / "dm_recipe.json").read_text())
  first, last = saved["loss_first_last"]
  assert saved["recipe"]["seed"] == 2 and saved["metrics"]["dm_frames"] == 6 and last < first
  assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))
