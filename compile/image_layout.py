"""Graph rewrites for QCOM artifacts, whose activations live in images of four channels per texel (tinygrad's IMAGE=2).

space_to_depth_stems: a convolution whose window equals its stride (no padding, dilation 1, group 1) over an input of
C channels, C not a multiple of 4, is the same sums as a 1x1 convolution over the C*k*k channels of its input cut into
k x k blocks. The image layout pads C to a multiple of 4: the driver-monitoring stem (1 channel, 4x4 stride 4, on the
1440x960 frame) writes an image four times its data and fetches three padding channels of every texel in the
convolution. Cut into blocks the input has 16 channels, a whole number of texels, and the convolution reads each texel
once. Only the order of the k*k*C products of each output changes.

elu_as_select: tinygrad writes Elu as relu(x) - alpha*relu(1 - exp(x)). Under images, where an Elu of an elementwise
result (the DM's stem normalisation) feeds a grouped convolution, its two uses of x keep that result in a buffer of its
own: one more kernel, and an fp32 image (16 bytes a texel) written and read between them. Where(x > 0, x,
alpha*(exp(x) - 1)) is the same value for every x (exp(x) - 1 is -(1 - exp(x)) exactly) and fuses into the kernel that
writes the convolution's fp16 image. An Elu of a convolution is left alone: it runs in that convolution's kernel, whose
register tile the shipped sets hold, and the select form there costs registers that the tile search then refuses.
"""
from __future__ import annotations

import os
from pathlib import Path

from selfdrive_glue.errors import UserError

ENV = "MODELD_IMAGE_LAYOUT"   # auto (rewrite where the capture uses images) or off (the models' graphs as they are)


def enabled() -> bool:
  mode = os.environ.get(ENV, "auto")
  if mode not in ("auto", "off"):
    raise UserError(f"{ENV}={mode}: use auto or off")
  return mode == "auto"


def images() -> bool:
  """Whether a program built now is laid out for images: the capture lays activations in images (tinygrad's IMAGE, set by
  the QCOM capture flags) and MODELD_IMAGE_LAYOUT is not off."""
  from tinygrad.helpers import IMAGE
  return IMAGE.value > 0 and enabled()


def split_counts(counts: dict[str, int], tag: str) -> tuple[dict[str, int], dict[str, int]]:
  """A model's rewrite counts as ({tag_<rewrite>: n} of the CPU layout's, the same of this module's)."""
  named = {k: (f"{tag}_{k}", n) for k, n in counts.items()}
  return ({t: n for k, (t, n) in named.items() if k not in REWRITES}, {t: n for k, (t, n) in named.items() if k in REWRITES})


def summary(counts: dict[str, int]) -> str:
  """The compile report's line: what was rewritten, by model."""
  if not enabled():
    return f"the models' graphs as they are ({ENV}=off)"
  done = {k: n for k, n in counts.items() if n}
  if not done:
    return "the models' graphs as they are (nothing to rewrite)"
  return "; ".join(f"{k.replace('_', ' ', 1)}: {n}" for k, n in done.items())


def rewrite(src: Path, dst: Path) -> dict[str, int]:
  """Write src with every rewrite of REWRITES applied into dst, where one rewrote anything; returns {rewrite: count}."""
  import onnx
  m = onnx.load(str(src))
  counts = {name: fn(m) for name, fn in REWRITES.items()}
  if any(counts.values()):
    onnx.save(m, str(dst))
  return counts


def _static_shape(vi) -> list[int] | None:
  dims = vi.type.tensor_type.shape.dim
  if not dims or any(not d.HasField("dim_value") for d in dims):
    return None
  return [d.dim_value for d in dims]


def space_to_depth_stems(m) -> int:
  """Rewrite every qualifying convolution of model m in place (see the module docstring); returns how many."""
  import numpy as np
  import onnx
  from onnx import helper, numpy_helper

  g = m.graph
  inferred = onnx.shape_inference.infer_shapes(m)
  shapes = {vi.name: _static_shape(vi) for vi in [*inferred.graph.value_info, *inferred.graph.input]}
  inits = {i.name: i for i in g.initializer}
  uses: dict[str, int] = {}
  for n in g.node:
    for i in n.input:
      uses[i] = uses.get(i, 0) + 1

  count, nodes = 0, []
  for n in g.node:
    nodes.append(n)
    if n.op_type != "Conv" or len(n.input) < 2 or n.input[1] not in inits or uses.get(n.input[1]) != 1:
      continue
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    w = numpy_helper.to_array(inits[n.input[1]])
    xs = shapes.get(n.input[0])
    if w.ndim != 4 or xs is None or len(xs) != 4 or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
      continue
    o, c, kh, kw = w.shape
    if (attrs.get("group", 1) != 1 or c % 4 == 0 or (kh, kw) == (1, 1) or list(attrs.get("strides", [1, 1])) != [kh, kw]
        or any(attrs.get("pads", [0] * 4)) or any(d != 1 for d in attrs.get("dilations", [1, 1]))
        or xs[2] % kh or xs[3] % kw):
      continue
    nb, h, wd = xs[0], xs[2] // kh, xs[3] // kw
    base = n.name or n.output[0]
    shape_in, shape_out = f"{base}__s2d_blocks", f"{base}__s2d_shape"
    g.initializer.extend([numpy_helper.from_array(np.array([nb, c, h, kh, wd, kw], np.int64), shape_in),
                          numpy_helper.from_array(np.array([nb, kh * kw * c, h, wd], np.int64), shape_out)])
    blocks, moved, cut = f"{base}__s2d_b", f"{base}__s2d_t", f"{base}__s2d"
    # channel (ky*kw + kx)*c + ci of the cut input holds x[ci, y*kh + ky, x*kw + kx]; the weights follow the same order
    nodes[-1:] = [helper.make_node("Reshape", [n.input[0], shape_in], [blocks], name=f"{base}__s2d_reshape_in"),
                  helper.make_node("Transpose", [blocks], [moved], name=f"{base}__s2d_transpose", perm=[0, 3, 5, 1, 2, 4]),
                  helper.make_node("Reshape", [moved, shape_out], [cut], name=f"{base}__s2d_reshape_out"), n]
    inits[n.input[1]].CopyFrom(numpy_helper.from_array(
      np.ascontiguousarray(w.transpose(0, 2, 3, 1).reshape(o, kh * kw * c, 1, 1)), n.input[1]))
    n.input[0] = cut
    for a in list(n.attribute):
      if a.name in ("kernel_shape", "strides", "pads"):
        n.attribute.remove(a)
    n.attribute.extend([helper.make_attribute("kernel_shape", [1, 1]), helper.make_attribute("strides", [1, 1])])
    count += 1
  del g.node[:]
  g.node.extend(nodes)
  return count


def elu_as_select(m) -> int:
  """Rewrite in place each Elu of model m over an elementwise result that feeds a grouped convolution, as Where(x > 0, x,
  alpha*(Exp(x) - 1)) (module docstring); returns how many."""
  import numpy as np
  import onnx
  from onnx import helper, numpy_helper

  g = m.graph
  producer = {o: n for n in g.node for o in n.output}
  grouped = {i for n in g.node if n.op_type == "Conv"
             and next((helper.get_attribute_value(a) for a in n.attribute if a.name == "group"), 1) > 1 for i in n.input[:1]}
  chosen = {n.output[0] for n in g.node if n.op_type == "Elu" and n.domain in ("", "ai.onnx") and n.output[0] in grouped
            and getattr(producer.get(n.input[0]), "op_type", None) not in ("Conv", None)}
  if not chosen:
    return 0
  inferred = onnx.shape_inference.infer_shapes(m).graph
  elem = {vi.name: vi.type.tensor_type.elem_type for vi in [*inferred.value_info, *inferred.input]}
  count, nodes = 0, []
  consts: dict[tuple[float, type], str] = {}

  def const(value: float, like: str) -> str:
    dt = np.float16 if elem.get(like) == onnx.TensorProto.FLOAT16 else np.float32   # the operands' type, as ONNX requires
    if (value, dt) not in consts:
      consts[value, dt] = f"__elu_select_c{len(consts)}"
      # shape (1,) as the models' own scalars: tinygrad copies a 0-d initializer with a kernel when the runner moves to the device
      g.initializer.append(numpy_helper.from_array(np.array([value], dt), consts[value, dt]))
    return consts[value, dt]

  for n in g.node:
    if n.op_type != "Elu" or n.output[0] not in chosen:
      nodes.append(n)
      continue
    alpha = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "alpha"), 1.0)
    x, y, base = n.input[0], n.output[0], n.name or n.output[0]
    pos, e, em1 = f"{base}__sel_pos", f"{base}__sel_exp", f"{base}__sel_expm1"
    nodes += [helper.make_node("Greater", [x, const(0.0, x)], [pos], name=f"{base}__sel_gt"),
              helper.make_node("Exp", [x], [e], name=f"{base}__sel_exp"),
              helper.make_node("Sub", [e, const(1.0, x)], [em1], name=f"{base}__sel_sub")]
    if alpha != 1.0:
      scaled = f"{base}__sel_scaled"
      nodes.append(helper.make_node("Mul", [em1, const(float(alpha), x)], [scaled], name=f"{base}__sel_mul"))
      em1 = scaled
    nodes.append(helper.make_node("Where", [pos, x, em1], [y], name=f"{base}__sel_where"))
    count += 1
  del g.node[:]
  g.node.extend(nodes)
  return count


# every rewrite, in the order applied, by the name its count goes under in the report and the metadata
REWRITES = {"stems_space_to_depth": space_to_depth_stems, "elu_as_select": elu_as_select}
