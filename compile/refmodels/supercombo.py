"""openpilot master's combined driving model (`driving_supercombo.onnx`, PR #38173) made from a 0.11 vision + policy pair.

Master ships one graph where 0.11 shipped two (docs/openpilot-master-and-dm.md §A.2-A.3): inputs img, big_img (uint8
(1,12,128,256)), features_buffer (1,24,512) holding the 24 *past* hidden states, desire_pulse (1,25,8), traffic_convention
(1,2) and action_t (1,2) = [lateral, longitudinal] action delay in seconds; one output (1,2580) whose output_slices put the
vision heads, the plan, desire_state, an `action` head, the hidden state and a pad in master's order.

`fuse` wires the two models of a pair into that graph: the vision's hidden_state is appended to the past features as the
25th row the policy reads (the graph "appends the current frame's feature itself"), and the outputs are re-sliced into
master's layout. So the reference pair, and the trained stand-in pair, have a combined twin whose outputs on the same
inputs are the split pipeline's: the equivalence check (test_supercombo_compile) has something to compare against. The action
head is ours (master's weights are not public): computed from the plan's first point and action_t, lateral acceleration
= v0 * yaw_rate0 + 0.05 * lat_action_t and acceleration = a0 - 0.1 * long_action_t, so a swapped action_t shows.

Size `full` is master's budget, not 0.11.1's: the shipped file is 96,639,461 B (docs §A.1), the 0.11.1-sized pair fused is
60.7 MB. Where master spent the extra ~18 M fp16 weights is not public; ours go into the policy's summary layer (wider
`fc`), so the vision, which holds nearly all of the a630 time, stays at 0.11.1's 0.81 G MACs while the file, the weights
in GPU memory and the load time are master's. The fused graph is still the split pair's (that pair's policy is the wide one).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from compile.refmodels.driving import (
  FEATURE_LEN,
  IMG_SHAPE,
  POLICY_SLICES,
  SIZES,
  VISION_SLICES,
  WrittenModel,
  build_model,
  count_macs,
  count_params,
  encode_output_slices,
  stand_in_model,
)
from selfdrive_glue.errors import UserError
from selfdrive_glue.files import write_atomic

PAST = 24                       # past features the combined model is fed; the graph appends the 25th (this frame's)
ACTION_T = (1, 2)
# master's output layout (docs §A.3), each name taken from the vision (v) or the policy (p) output of the pair
ORDER = (("lane_lines", "v"), ("lane_lines_prob", "v"), ("road_edges", "v"), ("meta", "v"), ("desire_pred", "v"), ("pose", "v"),
         ("wide_from_device_euler", "v"), ("road_transform", "v"), ("plan", "p"), ("lead", "v"), ("lead_prob", "v"),
         ("desire_state", "p"), ("action", None), ("hidden_state", "v"), ("pad", "p"))
ACTION_WIDTH = 4                # 2 means + 2 log-stds; modeld reads [0,0] and [0,1]
# the action head's dependence on action_t (see the module docstring); its log-stds are constant
LAT_T_GAIN, LONG_T_GAIN, ACTION_LOG_STD = 0.05, -0.1, -2.0
PLAN_V0, PLAN_A0, PLAN_YAW_RATE0 = 3, 6, 14   # columns of the plan's first (t=0) row of means: vel x, acc x, yaw rate
MASTER_FILE_BYTES = 96_639_461  # openpilot master's driving_supercombo.onnx (LFS pointer @0302526b)
# full: 0.11.1's policy with a summary layer wide enough that the fused file is master's size (see the module docstring)
POLICY_SPECS = {"full": replace(SIZES["full"][1], fc=4224)}


def slices(action_head: bool = True) -> dict[str, slice]:
  widths = {**{k: s.stop - s.start for k, s in VISION_SLICES.items()}, **{k: s.stop - s.start for k, s in POLICY_SLICES.items()},
            "action": ACTION_WIDTH}
  out, at = {}, 0
  for name, _src in ORDER:
    if name == "action" and not action_head:
      continue
    out[name] = slice(at, at + widths[name])
    at += widths[name]
  return out


def _prefixed(graph, prefix: str, keep: set[str]) -> tuple[list, list]:
  """The graph's nodes and initializers with every tensor name prefixed, except the graph inputs in `keep`."""
  from onnx import helper
  inputs = {i.name for i in graph.input}
  name = lambda n: n if (not n or (n in inputs and n in keep)) else f"{prefix}{n}"   # noqa: E731
  nodes = []
  for n in graph.node:
    if any(a.type in (a.GRAPH, a.GRAPHS) for a in n.attribute):
      raise UserError(f"cannot fuse a model with control flow ({n.op_type} node {n.name!r})")
    new = helper.make_node(n.op_type, [name(x) for x in n.input], [name(x) for x in n.output], name=f"{prefix}{n.name}", domain=n.domain)
    new.attribute.extend(n.attribute)
    nodes.append(new)
  inits = []
  for t in graph.initializer:
    c = type(t)()
    c.CopyFrom(t)
    c.name = name(t.name)
    inits.append(c)
  return nodes, inits


def fuse(vision, policy, action_head: bool = True, checkpoint: str = "modeld-msm-supercombo"):
  """vision + policy ModelProtos (0.11's contract) -> one ModelProto with master's combined contract."""
  import onnx
  from onnx import TensorProto, helper, numpy_helper

  v_nodes, v_inits = _prefixed(vision.graph, "v/", {"img", "big_img"})
  p_nodes, p_inits = _prefixed(policy.graph, "p/", {"desire_pulse", "traffic_convention"})
  f16 = TensorProto.FLOAT16
  nodes, inits = list(v_nodes), v_inits + p_inits
  v_out, p_out = f"v/{vision.graph.output[0].name}", f"p/{policy.graph.output[0].name}"

  def const(name: str, value, dtype=np.int64) -> str:
    inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
    return name

  def take(src: str, start: int, stop: int, out: str) -> str:
    nodes.append(helper.make_node("Slice", [src, const(f"{out}/starts", [start]), const(f"{out}/ends", [stop]), const(f"{out}/axes", [1])],
                                  [out], name=out))
    return out

  # the policy's 25 rows: the 24 past features fed in, then this frame's hidden state
  hs = VISION_SLICES["hidden_state"]
  take(v_out, hs.start, hs.stop, "c/hidden")
  nodes.append(helper.make_node("Reshape", ["c/hidden", const("c/hidden_shape", [1, 1, FEATURE_LEN])], ["c/hidden_row"], name="c/hidden_row"))
  nodes.append(helper.make_node("Concat", ["features_buffer", "c/hidden_row"], ["p/features_buffer"], axis=1, name="c/features"))
  nodes += p_nodes
  if action_head:
    v0, a0, r0 = (take(p_out, c, c + 1, f"c/plan{c}") for c in (PLAN_V0, PLAN_A0, PLAN_YAW_RATE0))
    lat_t, long_t = take("action_t", 0, 1, "c/lat_t"), take("action_t", 1, 2, "c/long_t")
    half = lambda name, x: const(name, [[x]], np.float16)   # noqa: E731
    nodes += [helper.make_node("Mul", [v0, r0], ["c/lat_acc"], name="c/lat_acc"),
              helper.make_node("Mul", [lat_t, half("c/lat_gain", LAT_T_GAIN)], ["c/lat_d"], name="c/lat_d"),
              helper.make_node("Add", ["c/lat_acc", "c/lat_d"], ["c/lat"], name="c/lat"),
              helper.make_node("Mul", [long_t, half("c/long_gain", LONG_T_GAIN)], ["c/long_d"], name="c/long_d"),
              helper.make_node("Add", [a0, "c/long_d"], ["c/long"], name="c/long"),
              helper.make_node("Concat", ["c/lat", "c/long", const("c/action_std", [[ACTION_LOG_STD] * 2], np.float16)], ["c/action"], axis=1,
                               name="c/action")]
  parts = []
  for name, src in ORDER:
    if name == "action":
      if action_head:
        parts.append("c/action")
      continue
    s = (VISION_SLICES if src == "v" else POLICY_SLICES)[name]
    parts.append(take(v_out if src == "v" else p_out, s.start, s.stop, f"c/{name}"))
  out_slices = slices(action_head)
  width = max(s.stop for s in out_slices.values())
  nodes.append(helper.make_node("Concat", parts, ["outputs"], axis=1, name="outputs"))
  inputs = [helper.make_tensor_value_info(n, TensorProto.UINT8, IMG_SHAPE) for n in ("img", "big_img")]
  inputs += [helper.make_tensor_value_info("features_buffer", f16, (1, PAST, FEATURE_LEN)),
             helper.make_tensor_value_info("desire_pulse", f16, (1, PAST + 1, 8)),
             helper.make_tensor_value_info("traffic_convention", f16, (1, 2)),
             helper.make_tensor_value_info("action_t", f16, ACTION_T)]
  graph = helper.make_graph(nodes, "driving_supercombo", inputs, [helper.make_tensor_value_info("outputs", f16, (1, width))], inits)
  model = helper.make_model(graph, opset_imports=list(vision.opset_import), producer_name="modeld-msm", producer_version="ref")
  model.ir_version = vision.ir_version
  helper.set_model_props(model, {"output_slices": encode_output_slices(out_slices), "model_checkpoint": checkpoint})
  onnx.checker.check_model(model, full_check=True)
  return model


def write_supercombo_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, stand_in: bool = False,
                           action_head: bool = True) -> WrittenModel:
  """driving_supercombo.onnx into out_dir (atomically): the reference pair of (size, seed), or the trained stand-in, fused."""
  if stand_in and size != "tiny":
    raise UserError(f"the trained stand-in exists for size 'tiny' only, not '{size}'")
  vision, policy = (stand_in_model(k) if stand_in else build_model(k, size, seed, POLICY_SPECS.get(size)) for k in ("vision", "policy"))
  what = "stand-in" if stand_in else f"ref-{size}-seed{seed}"
  model = fuse(vision, policy, action_head=action_head, checkpoint=f"modeld-msm-supercombo-{what}")
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
