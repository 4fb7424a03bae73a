"""Master's stateful driving model as we make it from a 0.11 pair (compile/refmodels/stateful.py) and its contract
(compile/stateful_contract.py, through compile/onnx_model.py).

The model runs under onnxruntime with its states fed back, frame after frame, beside two references run the way our
runtimes run them: the split pair with 0.11's queues (compile/programs/driving_step.py's rules, here in numpy) and June's combined model
with its 96-row feature queue (compile/programs/supercombo_step.py's rules). On frames without drops all three agree exactly;
each planted runtime bug makes the stateful model disagree within a few frames."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from compile.onnx_model import contract_of, load_model_info
from compile.refmodels.driving import POLICY_SLICES, VISION_SLICES, build_model, stand_in_model
from compile.refmodels.stateful import STATES, statefulize
from compile.refmodels.supercombo import fuse, slices
from compile.stateful_contract import HOST_INPUTS, check_stateful, states_of
from selfdrive_glue.errors import UserError
from tests.conftest import run_cli

FRAMES = 14
ACTION_T = np.array([[0.25, 0.5]], np.float32)     # exact in fp16, so June's fp16 input and master's float32 one agree
TRAFFIC = np.array([[1, 0]], np.float32)


def _session(model) -> ort.InferenceSession:
  return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _pair(which: str):
  return tuple(build_model(k, "tiny", 3) for k in ("vision", "policy")) if which == "reference" else tuple(map(stand_in_model, ("vision", "policy")))


def _frames(seed: int, n: int = FRAMES) -> list[dict[str, np.ndarray]]:
  """n frames: both cameras' warped images and the desire pulse (a lane change pulse now and then, mostly zeros)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    desire = np.zeros(8, np.float32)
    if i % 5 == 2:
      desire[1 + i % 7] = 1
    out.append({"new_img": rng.integers(0, 256, (2, 6, 128, 256), dtype=np.uint8), "desire": desire})
  return out


def _push(q: np.ndarray, row: np.ndarray, axis: int = 0) -> np.ndarray:
  return np.concatenate([np.take(q, range(1, q.shape[axis]), axis=axis), np.expand_dims(row, axis)], axis=axis)


def split_pipeline(vision, policy, frames) -> list[np.ndarray]:
  """0.11's runtime: 5-row image queues, a 97-row feature queue (pushed, then every 4th row), a 100-row desire queue
  max-pooled by 4. Returns master's `outputs` layout rebuilt from the two models' outputs (action head excluded)."""
  sv, sp = _session(vision), _session(policy)
  img_q = np.zeros((2, 5, 6, 128, 256), np.uint8)
  feat_q, desire_q = np.zeros((97, 512), np.float16), np.zeros((100, 8), np.float32)
  outs = []
  for f in frames:
    img_q = _push(img_q, f["new_img"], axis=1)
    v = sv.run(None, {"img": img_q[0, [0, 4]].reshape(1, 12, 128, 256), "big_img": img_q[1, [0, 4]].reshape(1, 12, 128, 256)})[0]
    feat_q = _push(feat_q, v[0, VISION_SLICES["hidden_state"]])
    desire_q = _push(desire_q, f["desire"])
    pulses = desire_q.reshape(25, 4, 8).max(1)[None].astype(np.float16)
    p = sp.run(None, {"features_buffer": feat_q[0::4][None], "desire_pulse": pulses, "traffic_convention": TRAFFIC.astype(np.float16)})[0]
    row = np.zeros((1, 2580), np.float32)
    for name, s in slices().items():
      if name != "action":
        src, where = (v, VISION_SLICES) if name in VISION_SLICES else (p, POLICY_SLICES)
        row[:, s] = src[:, where[name]]
    outs.append(row)
  return outs


def june_pipeline(combined, frames) -> list[np.ndarray]:
  """June's runtime (compile/programs/supercombo_step.py): the 24 past features from a 96-row queue, h(t) pushed after the run."""
  sess = _session(combined)
  img_q = np.zeros((2, 5, 6, 128, 256), np.uint8)
  feat_q, desire_q = np.zeros((96, 512), np.float16), np.zeros((100, 8), np.float32)
  outs = []
  for f in frames:
    img_q = _push(img_q, f["new_img"], axis=1)
    desire_q = _push(desire_q, f["desire"])
    out = sess.run(None, {"img": img_q[0, [0, 4]].reshape(1, 12, 128, 256), "big_img": img_q[1, [0, 4]].reshape(1, 12, 128, 256),
                          "features_buffer": feat_q[0::4][None], "desire_pulse": desire_q.reshape(25, 4, 8).max(1)[None].astype(np.float16),
                          "traffic_convention": TRAFFIC.astype(np.float16), "action_t": ACTION_T.astype(np.float16)})[0]
    feat_q = _push(feat_q, out[0, slices()["hidden_state"]])
    outs.append(out.astype(np.float32))
  return outs


def stateful_runtime(sess, frames, bug: str | None = None, dropped: frozenset[int] = frozenset()) -> list[np.ndarray]:
  """Master's runtime (docs §4.5-4.7): states start at zero, each frame runs once and its next_X becomes the next X.
  A dropped frame is not run at all. `bug` plants one runtime mistake."""
  names = [i.name for i in sess.get_inputs()]
  states = {k: np.zeros(shape, np.uint8 if t == "uint8" else np.float32) for k, (shape, t) in STATES.items()}
  host_copy = dict(states)                # for "host copy": what a host keeping its own copy would feed
  outs = []
  for i, f in enumerate(frames):
    if i in dropped:
      if bug == "dropped frame as warp-only":   # 0.11's prepare_only: the image queue advances, nothing else
        states["state_img_q"] = _push(states["state_img_q"], f["new_img"], axis=1)
      continue
    feeds = {"new_img": f["new_img"], "desire": f["desire"], "traffic_convention": TRAFFIC, "action_t": ACTION_T}
    fed = dict(host_copy) if bug == "host copy" else states
    res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, **fed})))
    if bug == "advanced twice":
      res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, **{k: res[f"next_{k}"] for k in states}})))
    nxt = {k: res[f"next_{k}"] for k in states}
    if bug and bug.startswith("not fed back: "):
      nxt[bug.removeprefix("not fed back: ")] = states[bug.removeprefix("not fed back: ")]
    if bug == "cameras swapped once" and i == 5:
      # once: swapped on every frame the two rows read (ages 4 and 0) are each swapped an even number of times, which no
      # output can show; a copy that binds the wrong camera once (after a model switch, say) shows for 4 frames
      nxt["state_img_q"] = nxt["state_img_q"][::-1].copy()
    if bug == "host copy":   # the host refreshes its own copy a frame late, from what the device had before this run
      host_copy = dict(states)
    states = nxt
    outs.append(res["outputs"])
    assert set(names) == {"new_img", "desire", "traffic_convention", "action_t", *states}
  return outs


def first_mismatch(got: list[np.ndarray], want: list[np.ndarray], skip=("action",)) -> int | None:
  """The first frame whose outputs differ anywhere outside `skip` (None: all equal)."""
  assert len(got) == len(want)
  keep = np.ones(2580, bool)
  for name in skip:
    keep[slices()[name]] = False
  for i, (g, w) in enumerate(zip(got, want)):
    if not np.array_equal(g[:, keep], w[:, keep]):
      return i
  return None


@pytest.fixture(scope="module", params=["reference", "stand-in"])
def models(request):
  vision, policy = _pair(request.param)
  combined = fuse(vision, policy)
  return vision, policy, combined, statefulize(combined)


def test_stateful_equals_the_split_pair_and_junes_model_frame_after_frame(models):
  """Exact equality, not a tolerance: the same fp16 network reads the same values (uint8 images copied, the fp16 hidden
  state widened to the float32 queue and narrowed back, 0/1 desire and traffic values, action_t exact in fp16), so any
  difference is a wrong row, not rounding."""
  vision, policy, combined, stateful = models
  frames = _frames(0)
  split, june = split_pipeline(vision, policy, frames), june_pipeline(combined, frames)
  got = stateful_runtime(_session(stateful), frames)
  assert len(got) == FRAMES >= 10 and got[0].dtype == np.float32 and got[0].shape == (1, 2580)
  assert first_mismatch(got, split) is None
  assert first_mismatch(got, june, skip=()) is None      # the action head too: June's and ours are the same nodes
  # the history matters: frame 5 on is fed frames the first four never saw; a model ignoring it would not tell
  assert not np.array_equal(got[6], stateful_runtime(_session(stateful), frames[4:])[2])


PLANTED = ["not fed back: state_img_q", "not fed back: state_desire_q", "not fed back: state_feat_q", "cameras swapped once",
           "advanced twice", "host copy"]


@pytest.mark.parametrize("bug", PLANTED)
def test_each_planted_runtime_bug_breaks_the_equivalence(models, bug):
  vision, policy, _, stateful = models
  frames = _frames(1)
  at = first_mismatch(stateful_runtime(_session(stateful), frames, bug=bug), split_pipeline(vision, policy, frames))
  assert at is not None, f"{bug}: still equal to the split pair over {FRAMES} frames"


def test_two_states_swapped_are_refused_by_the_runtime(models):
  """States of different shapes fed in each other's place: onnxruntime refuses the run (a shape error), so that swap cannot pass
  silently; the swap that could (the two cameras' rows of one queue) is a planted bug above."""
  sess = _session(models[3])
  feeds = {"new_img": np.zeros((2, 6, 128, 256), np.uint8), "desire": np.zeros(8, np.float32), "traffic_convention": TRAFFIC, "action_t": ACTION_T,
           "state_img_q": np.zeros(STATES["state_img_q"][0], np.uint8), "state_desire_q": np.zeros((96, 1, 512), np.float32),
           "state_feat_q": np.zeros((100, 1, 8), np.float32)}
  with pytest.raises(Exception, match="(?i)dimension|shape"):
    sess.run(None, feeds)


def test_dropped_frames_are_skipped_as_master_does_not_run_warp_only(models):
  """Master (docs §4.7) runs every received frame and never fills in a dropped one: the history just skips it. So with drops
  the stateful model equals the split pair fed only the received frames, and differs from 0.11's warp-only handling."""
  vision, policy, _, stateful = models
  frames, dropped = _frames(2), frozenset({3, 7, 8})
  received = [f for i, f in enumerate(frames) if i not in dropped]
  got = stateful_runtime(_session(stateful), frames, dropped=dropped)
  assert first_mismatch(got, split_pipeline(vision, policy, received)) is None
  warp_only = stateful_runtime(_session(stateful), frames, bug="dropped frame as warp-only", dropped=dropped)
  assert first_mismatch(warp_only, split_pipeline(vision, policy, received)) is not None


def test_the_graph_declares_masters_contract_and_the_cli_writes_it_reproducibly(tmp_path):
  for d in ("a", "b"):
    r = run_cli("models", "--contract", "stateful", "-o", tmp_path / d, "--seed", "2", timeout=120)
    assert r.returncode == 0, r.stderr
  a, b = (tmp_path / d / "driving_supercombo.onnx" for d in ("a", "b"))
  assert a.read_bytes() == b.read_bytes() and sorted(p.name for p in (tmp_path / "a").iterdir()) == ["driving_supercombo.onnx"]
  info = load_model_info(a, "stateful")
  assert info.kind == "stateful" and info.output_width == 2580 and info.output_slices == slices()
  assert info.input_shapes == {"new_img": (2, 6, 128, 256), "desire": (8,), "traffic_convention": (1, 2), "action_t": (1, 2),
                               "state_img_q": (2, 5, 6, 128, 256), "state_desire_q": (100, 1, 8), "state_feat_q": (96, 1, 512)}
  assert info.input_dtypes["new_img"] == "uint8" and info.input_dtypes["desire"] == "float32" and info.input_dtypes["state_feat_q"] == "float32"
  assert list(info.output_shapes) == ["outputs", "next_state_img_q", "next_state_desire_q", "next_state_feat_q"]
  # 2.2 MB of state each way, as the third-party DSP port measured for the shipped model (docs §3.1)
  model = onnx.load(str(a))
  contract = check_stateful(*_tables(model))
  assert contract.state_bytes == 1_966_080 + 3_200 + 196_608
  # the June file is named as what it is, not taken for this one
  june = tmp_path / "june"
  assert run_cli("models", "--contract", "supercombo", "-o", june, timeout=120).returncode == 0
  with pytest.raises(UserError, match="is the supercombo model"):
    load_model_info(june / "driving_supercombo.onnx", "stateful")
  with pytest.raises(UserError, match="is the stateful model"):
    load_model_info(a, "supercombo")


@pytest.mark.slow
def test_full_is_the_shipped_size_class(tmp_path):
  r = run_cli("models", "--contract", "stateful", "--size", "full", "-o", tmp_path, timeout=600)
  assert r.returncode == 0, r.stderr
  size = (tmp_path / "driving_supercombo.onnx").stat().st_size
  assert size == pytest.approx(60.9e6, rel=0.02), size
  assert load_model_info(tmp_path / "driving_supercombo.onnx", "stateful").output_width == 2580


def _tables(model):
  def spec(v):
    return tuple(d.dim_value for d in v.type.tensor_type.shape.dim), helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
  return {i.name: spec(i) for i in model.graph.input}, {o.name: spec(o) for o in model.graph.output}


def _good_tables():
  inputs = {k: (shape, "float32" if k != "new_img" else "uint8") for k, (shape, _) in HOST_INPUTS.items()}
  inputs.update({k: (shape, t) for k, (shape, t) in STATES.items()})
  outputs = {"outputs": ((1, 2580), "float32"), **{f"next_{k}": (shape, t) for k, (shape, t) in STATES.items()}}
  return inputs, outputs


def test_states_are_whatever_the_graph_pairs_not_a_fixed_list():
  inputs, outputs = _good_tables()
  assert set(states_of(inputs, outputs)) == set(STATES)
  # a retrained model with a fourth queue of its own name and a shorter feature queue is still the contract
  inputs["hidden_q"], outputs["next_hidden_q"] = ((3, 64), "float16"), ((3, 64), "float16")
  inputs["state_feat_q"] = outputs["next_state_feat_q"] = ((48, 1, 512), "float32")
  c = check_stateful(inputs, outputs)
  assert c.states["hidden_q"] == ((3, 64), "float16") and c.states["state_feat_q"][0] == (48, 1, 512)
  assert contract_of(inputs, outputs) == "stateful"
  assert contract_of({"x": 0, "state": 0}, {"next_state"}) == "stateful" and contract_of({"img": 0}) == "vision"


@pytest.mark.parametrize("edit,needle", [
  ("next without its input", "output 'next_state_desire_q' has no input 'state_desire_q'"),
  ("next of another shape", "output 'next_state_feat_q' is float32 (95, 1, 512) but its state input 'state_feat_q' is float32 (96, 1, 512)"),
  ("next of another dtype", "output 'next_state_img_q' is float32 (2, 5, 6, 128, 256) but its state input 'state_img_q' is uint8"),
  ("an input nobody feeds", "neither fed by modeld nor paired with a next_ output: state_extra"),
  ("no new_img", "has no input 'new_img'"),
  ("desire (1, 8)", "input 'desire' has shape (1, 8), expected (8,)"),
  ("an unread output", "output(s) modeld neither reads nor feeds back: debug"),
  ("outputs (2580,)", "output 'outputs' has shape (2580,), expected (1, N)"),
])
def test_off_contract_tables_are_refused_by_name(edit, needle):
  inputs, outputs = _good_tables()
  if edit == "next without its input":
    inputs["state_desire"] = inputs.pop("state_desire_q")
    outputs["next_state_desire"] = outputs["next_state_desire_q"]
  elif edit == "next of another shape":
    outputs["next_state_feat_q"] = ((95, 1, 512), "float32")
  elif edit == "next of another dtype":
    outputs["next_state_img_q"] = (STATES["state_img_q"][0], "float32")
  elif edit == "an input nobody feeds":
    inputs["state_extra"] = ((4,), "float32")
  elif edit == "no new_img":
    del inputs["new_img"]
  elif edit == "desire (1, 8)":
    inputs["desire"] = ((1, 8), "float32")
  elif edit == "an unread output":
    outputs["debug"] = ((1, 4), "float32")
  elif edit == "outputs (2580,)":
    outputs["outputs"] = ((2580,), "float32")
  with pytest.raises(UserError) as e:
    check_stateful(inputs, outputs)
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("edit,needle", [
  ("rename state input", "output 'next_state_desire_q' has no input 'state_desire_q'"),
  ("next of another shape", "output 'next_state_feat_q' is float32 (95, 1, 512)"),
])
def test_off_contract_files_are_refused_by_name_in_one_line(tmp_path, edit, needle):
  """Through the loader and the CLI's error path: the contract check runs before the full type check, so the named state
  is what the user reads, not an inference error."""
  m = statefulize(fuse(*(build_model(k, "tiny", 0) for k in ("vision", "policy"))))
  if edit == "rename state input":
    for i in m.graph.input:
      if i.name == "state_desire_q":
        i.name = "state_desire"
    for n in m.graph.node:
      n.input[:] = ["state_desire" if x == "state_desire_q" else x for x in n.input]
  else:
    for o in m.graph.output:
      if o.name == "next_state_feat_q":
        o.CopyFrom(helper.make_tensor_value_info("next_state_feat_q", TensorProto.FLOAT, (95, 1, 512)))
  path = tmp_path / "driving_supercombo.onnx"
  onnx.save(m, str(path))
  with pytest.raises(UserError) as e:
    load_model_info(path, "stateful")
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)

