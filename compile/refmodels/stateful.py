"""openpilot master's stateful driving model (`driving_supercombo.onnx` since 2026-09) made from a 0.11 vision + policy pair.

Master moved the history queues into the graph (docs: openpilot-master-2026-09.md §3.1): the host feeds this frame's two
warped images `new_img` (2,6,128,256) u8 (row 0 the road camera, row 1 the wide one), the desire pulse (8,),
traffic_convention and action_t; each queue is a state input `state_X` whose next value comes back as `next_state_X`, and
the runtime feeds it back unchanged. One flat `outputs` (1,N) float32 vector, sliced by `output_slices`, as June's.

`statefulize` rewrites our June combined graph (compile/supercombo_refmodel.fuse, itself the pair wired together) so that
its inputs are computed inside the graph from the queues, exactly as our split runtime computes them on the device
(compile/programs/driving_step.py):
- images: per camera a 5-row queue; the new row is pushed, rows 0 and 4 (frames t-4 and t) make img / big_img;
- desire: a 100-row queue; the pulse is pushed, groups of 4 rows max-pooled give the policy's 25 desire rows;
- features: a 96-row queue of past hidden states; rows 0, 4, ..., 92 (h(t-96) ... h(t-4)) are fed, the graph appends
  h(t) (June's wiring), and h(t) is pushed for the next frame.
So, on a frame sequence without drops, the stateful model gives the split pair's outputs and the June model's, frame after
frame. The queues are float32 (the features are the fp16 hidden state widened, exact both ways); the host inputs are
float32 and cast to the graph's fp16 inside, as master's add_history does.

Size `full` is the 0.11.1-sized pair (the shipped stateful file is ~60.9 MB by third-party reports; ours is 60.7 MB), not
the June model's 96.6 MB budget.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from compile.refmodels.driving import FEATURE_LEN, WrittenModel, build_model, count_macs, count_params, encode_output_slices, stand_in_model
from compile.refmodels.supercombo import PAST, fuse, slices
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import write_atomic

FRAME_SKIP = 4
CAMERAS = 2
IMG_ROWS = FRAME_SKIP + 1                 # 5: rows 0 and 4 are frames t-4 and t
DESIRE_ROWS = FRAME_SKIP * (PAST + 1)     # 100: 25 groups of 4, max-pooled
FEAT_ROWS = FRAME_SKIP * PAST             # 96: rows 0, 4, ..., 92 are h(t-96) ... h(t-4)
DESIRE_LEN = 8
NEW_IMG = (CAMERAS, 6, 128, 256)
# state input -> (shape, ONNX dtype name); the runtime reads the real ones from the graph, these are what we write
STATES = {"state_img_q": ((CAMERAS, IMG_ROWS, 6, 128, 256), "uint8"), "state_desire_q": ((DESIRE_ROWS, 1, DESIRE_LEN), "float32"),
          "state_feat_q": ((FEAT_ROWS, 1, FEATURE_LEN), "float32")}
# the June graph's inputs this rewrite computes inside the graph
_JUNE_INPUTS = ("img", "big_img", "features_buffer", "desire_pulse", "traffic_convention", "action_t")


def statefulize(combined, checkpoint: str = "modeld-msm-stateful", out_slices: dict[str, slice] | None = None):
  """June's combined ModelProto (compile/supercombo_refmodel.fuse) -> the same network in master's stateful contract.
  out_slices: the combined model's layout, fuse's (with its action head) unless given; passed in rather than read back
  from the metadata, which only compile/onnx_model.py reads."""
  import onnx
  from onnx import TensorProto, helper, numpy_helper

  graph = combined.graph
  if sorted(i.name for i in graph.input) != sorted(_JUNE_INPUTS) or [o.name for o in graph.output] != ["outputs"]:
    raise UserError("statefulize takes the June combined model (inputs " + ", ".join(_JUNE_INPUTS) + "; one output 'outputs')")
  out_slices = slices() if out_slices is None else out_slices
  hidden = out_slices["hidden_state"]
  width = graph.output[0].type.tensor_type.shape.dim[1].dim_value
  f16, f32, u8 = TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.UINT8
  nodes: list = []
  inits: list = []

  def const(name: str, value, dtype=np.int64) -> str:
    inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
    return name

  def node(op: str, inputs: list[str], out: str, **attrs) -> str:
    nodes.append(helper.make_node(op, inputs, [out], name=f"s:{out}", **attrs))
    return out

  def rows(src: str, start: int, stop: int, axis: int, out: str, step: int = 1) -> str:
    return node("Slice", [src, const(f"{out}/starts", [start]), const(f"{out}/ends", [stop]), const(f"{out}/axes", [axis]),
                          const(f"{out}/steps", [step])], out)

  def push(state: str, row: str, axis: int, out: str) -> str:
    """Drop the state's oldest row along axis, append row: the queue's next value."""
    length = dict(STATES)[state][0][axis]
    return node("Concat", [rows(state, 1, length, axis, f"{out}/older"), row], out, axis=axis)

  # images: one new row per camera, rows 0 and 4 of the pushed queue are the pair each vision stem reads
  new_rows = node("Reshape", ["new_img", const("s/img_row_shape", [CAMERAS, 1, *NEW_IMG[1:]])], "s/new_rows")
  img_q = push("state_img_q", new_rows, 1, "next_state_img_q")
  pair = node("Gather", [img_q, const("s/img_pick", [0, IMG_ROWS - 1])], "s/pairs", axis=1)          # (2, 2, 6, 128, 256)
  for cam, name in enumerate(("img", "big_img")):
    node("Reshape", [rows(pair, cam, cam + 1, 0, f"s/{name}_rows"), const(f"s/{name}_shape", [1, 2 * 6, 128, 256])], f"j/{name}")
  # desire: push the pulse, max-pool groups of 4 rows into the policy's 25
  desire_row = node("Reshape", ["desire", const("s/desire_row_shape", [1, 1, DESIRE_LEN])], "s/desire_row")
  desire_q = push("state_desire_q", desire_row, 0, "next_state_desire_q")
  groups = node("Reshape", [desire_q, const("s/desire_groups", [PAST + 1, FRAME_SKIP, DESIRE_LEN])], "s/desire_grouped")
  pooled = node("ReduceMax", [groups], "s/desire_pooled", axes=[1], keepdims=0)
  node("Cast", [node("Reshape", [pooled, const("s/pulse_shape", [1, PAST + 1, DESIRE_LEN])], "s/pulses")], "j/desire_pulse", to=f16)
  # features: every 4th past hidden state, oldest first; the June graph appends h(t) as the 25th row
  past = rows("state_feat_q", 0, FEAT_ROWS, 0, "s/feat_rows", step=FRAME_SKIP)
  node("Cast", [node("Reshape", [past, const("s/feat_shape", [1, PAST, FEATURE_LEN])], "s/features")], "j/features_buffer", to=f16)
  for name in ("traffic_convention", "action_t"):
    node("Cast", [name], f"j/{name}", to=f16)
  # the June graph, reading what was computed above where it read its own inputs
  june = {name: f"j/{name}" for name in _JUNE_INPUTS}
  for n in graph.node:
    c = type(n)()
    c.CopyFrom(n)
    c.input[:] = [june.get(x, x) for x in c.input]
    nodes.append(c)
  # June's outputs (fp16) renamed: master's vector is float32, and h(t) is taken from it and pushed into the feature queue
  for n in nodes:
    n.output[:] = ["s/outputs_f16" if o == "outputs" else o for o in n.output]
  node("Cast", ["s/outputs_f16"], "outputs", to=f32)
  h_now = node("Cast", [rows("s/outputs_f16", hidden.start, hidden.stop, 1, "s/hidden")], "s/hidden_f32", to=f32)
  push("state_feat_q", node("Reshape", [h_now, const("s/hidden_row_shape", [1, 1, FEATURE_LEN])], "s/hidden_row"), 0, "next_state_feat_q")

  inputs = [helper.make_tensor_value_info("new_img", u8, NEW_IMG), helper.make_tensor_value_info("desire", f32, (DESIRE_LEN,)),
            helper.make_tensor_value_info("traffic_convention", f32, (1, 2)), helper.make_tensor_value_info("action_t", f32, (1, 2))]
  onnx_type = {"uint8": u8, "float32": f32}
  inputs += [helper.make_tensor_value_info(k, onnx_type[t], shape) for k, (shape, t) in STATES.items()]
  outputs = [helper.make_tensor_value_info("outputs", f32, (1, width))]
  outputs += [helper.make_tensor_value_info(f"next_{k}", onnx_type[t], shape) for k, (shape, t) in STATES.items()]
  new_graph = helper.make_graph(nodes, "driving_supercombo", inputs, outputs, list(graph.initializer) + inits)
  model = helper.make_model(new_graph, opset_imports=list(combined.opset_import), producer_name="modeld-msm", producer_version="ref")
  model.ir_version = combined.ir_version
  helper.set_model_props(model, {"output_slices": encode_output_slices(out_slices), "model_checkpoint": checkpoint})
  onnx.checker.check_model(model, full_check=True)
  return model


def write_stateful_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, stand_in: bool = False) -> WrittenModel:
  """driving_supercombo.onnx in master's stateful contract into out_dir (atomically): the reference pair of (size, seed), or the
  trained stand-in, fused (June's wiring) and given its queues."""
  if stand_in and size != "tiny":
    raise UserError(f"the trained stand-in exists for size 'tiny' only, not '{size}'")
  # full: 0.11.1's pair as it is (the shipped stateful file is that size class), not the June model's wider policy
  vision, policy = (stand_in_model(k) if stand_in else build_model(k, size, seed) for k in ("vision", "policy"))
  what = "stand-in" if stand_in else f"ref-{size}-seed{seed}"
  model = statefulize(fuse(vision, policy), checkpoint=f"modeld-msm-stateful-{what}")
  out_dir = Path(out_dir)
  if out_dir.exists() and not out_dir.is_dir():
    raise UserError(f"output path {out_dir} exists and is not a directory; pass a directory with -o")
  try:
    out_dir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create output directory {out_dir}: {e.strerror}; choose a writable path") from None
  data = model.SerializeToString()
  path = out_dir / "driving_supercombo.onnx"
  write_atomic(path, data)
  return WrittenModel(path, len(data), count_macs(model), count_params(model))

