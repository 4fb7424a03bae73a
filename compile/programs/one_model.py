"""What a program around one ONNX model needs, shared by the driver-monitoring program (compile/programs/dmonitoring_step.py) and master's
combined driving model (compile/programs/supercombo_step.py): the tinygrad runner, and the program built from the model file as
tinygrad runs it in the compile's precision and layout."""
from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from tinygrad.nn.onnx import OnnxRunner

from compile import image_layout
from compile import precision as precision_mod
from compile.cpu import layout as cpu_layout
from compile.onnx_model import OnnxModelInfo
from selfdrive_glue.nv12 import NV12Info

P = TypeVar("P")


def runner_model(path: Path, compute: str, layout: bool, workdir: Path, image: bool = False) -> tuple[Path, dict[str, int]]:
  """The ONNX file tinygrad runs for one model: widened to fp32, with the image layout's graph rewrites (compile/image_layout.py)
  when tinygrad lays activations in images, and/or with the CPU layout's, as written into workdir (onnxruntime always
  checks the original). -> (path, {rewrite: count})."""
  counts: dict[str, int] = {}
  if compute == "fp32":
    path = precision_mod.widen_to_fp32(path, workdir / f"fp32_{path.name}")
  if image:
    out = workdir / f"image_{path.name}"
    counts.update(image_layout.rewrite(path, out))
    path = out if any(counts.values()) else path
  if not layout:
    return path, counts
  out = workdir / f"cpu_{path.name}"
  return out, {**counts, **cpu_layout.rewrite(path, out)}


def runner(info: OnnxModelInfo, device: str, cpu_ops: bool) -> tuple[OnnxRunner, dict[str, Any]]:
  """-> (the model's runner on `device`, with the CPU layout's op table when cpu_ops, its graph inputs' dtypes)."""
  model = OnnxRunner(info.path).to(device)
  if cpu_ops:   # the caller built it from a file the CPU layout rewrote (build below)
    cpu_layout.apply(model)
  return model, {k: v.dtype for k, v in model.graph_inputs.items()}


def build(cls: type[P], info: OnnxModelInfo, nv: NV12Info, device: str, compute: str, layout: bool, tag: str, **kw: Any) -> P:
  """cls(info, nv, device, cpu_ops=) over the model as tinygrad runs it: widened to fp32 and/or rewritten for the CPU layout
  (runner_model; onnxruntime still checks the original). The rewrite counts go on the program as `layout_rewrites`,
  each named tag_<rewrite>, and the image layout's as `image_rewrites`. kw: the program's own options."""
  image = image_layout.images()
  if compute != "fp32" and not layout and not image:
    return cls(info, nv, device, **kw)   # type: ignore[call-arg]
  with tempfile.TemporaryDirectory(prefix="modeld-msm-build-") as td:
    path, counts = runner_model(info.path, compute, layout, Path(td), image)
    prog = cls(replace(info, path=path), nv, device, cpu_ops=layout, **kw)   # type: ignore[call-arg]
  prog.layout_rewrites, prog.image_rewrites = image_layout.split_counts(counts, tag)   # type: ignore[attr-defined]
  return prog
