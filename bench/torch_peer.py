"""The PyTorch peer for bench_gpu.py: openpilot's per-frame step rebuilt in torch from the same ONNX files and weights.

A small ONNX interpreter over torch ops (only the ops the driving models use; anything else is refused by name) plus the
same NV12 warp and device queues as compile/programs/driving_step.py, so both runtimes do the same work per step: warp x 2, queue shifts,
vision, policy, outputs read back to the host. Captured once as a CUDA graph, as a tuned torch deployment would run it.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

_DTYPES = {1: torch.float32, 10: torch.float16, 2: torch.uint8, 6: torch.int32, 7: torch.int64, 9: torch.bool}


class TorchOnnx:
  """Runs an ONNX graph with torch ops. Shape-like inputs (Slice, Reshape) are read once at load, not per call."""

  def __init__(self, path: Path, device: str):
    m = onnx.load(str(path))
    self.inits = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()).to(device) for t in m.graph.initializer}
    self.consts = {t.name: numpy_helper.to_array(t).tolist() for t in m.graph.initializer if t.data_type in (6, 7)}
    self.nodes = [(n.op_type, list(n.input), n.output[0], {a.name: helper.get_attribute_value(a) for a in n.attribute}) for n in m.graph.node]
    if unknown := sorted({op for op, *_ in self.nodes} - set(_OPS)):
      raise NotImplementedError(f"{path.name}: no torch rule for {', '.join(unknown)}")
    self.input_names = [i.name for i in m.graph.input if i.name not in self.inits]
    self.input_dtypes = {i.name: _DTYPES[i.type.tensor_type.elem_type] for i in m.graph.input}
    self.output = m.graph.output[0].name

  def __call__(self, **feeds: torch.Tensor) -> torch.Tensor:
    env = {**self.inits, **feeds}
    for op, ins, out, attrs in self.nodes:
      env[out] = _OPS[op](self, [env.get(i) if i else None for i in ins], ins, attrs)
    return env[self.output]


def _gemm(self, x, names, a):
  A, B = x[0], x[1]
  A, B = (A.t() if a.get("transA") else A), (B.t() if a.get("transB") else B)
  y = a.get("alpha", 1.0) * (A @ B)
  return y + a.get("beta", 1.0) * x[2] if len(x) > 2 and x[2] is not None else y


def _slice(self, x, names, a):
  starts, ends = self.consts[names[1]], self.consts[names[2]]
  axes = self.consts[names[3]] if len(names) > 3 and names[3] else list(range(len(starts)))
  steps = self.consts[names[4]] if len(names) > 4 and names[4] else [1] * len(starts)
  idx = [slice(None)] * x[0].dim()
  for s, e, ax, st in zip(starts, ends, axes, steps):
    idx[ax] = slice(s, min(e, x[0].shape[ax]), st)
  return x[0][tuple(idx)]


def _flatten(self, x, names, a):
  ax = a.get("axis", 1)
  return x[0].reshape(math.prod(x[0].shape[:ax]), -1)


def _conv(self, x, names, a):
  p = a.get("pads", [0, 0, 0, 0])
  assert p[:2] == p[2:], "asymmetric padding"
  return F.conv2d(x[0], x[1], x[2] if len(x) > 2 else None, stride=a.get("strides", 1), padding=p[:2], dilation=a.get("dilations", 1),
                  groups=a.get("group", 1))


_OPS = {
  "Identity": lambda s, x, n, a: x[0],
  "Cast": lambda s, x, n, a: x[0].to(_DTYPES[a["to"]]),
  "Add": lambda s, x, n, a: x[0] + x[1], "Sub": lambda s, x, n, a: x[0] - x[1],
  "Mul": lambda s, x, n, a: x[0] * x[1], "Div": lambda s, x, n, a: x[0] / x[1],
  "Sqrt": lambda s, x, n, a: torch.sqrt(x[0]), "Tanh": lambda s, x, n, a: torch.tanh(x[0]),
  "Elu": lambda s, x, n, a: F.elu(x[0], a.get("alpha", 1.0)),
  "Softmax": lambda s, x, n, a: torch.softmax(x[0], a.get("axis", -1)),
  "ReduceMean": lambda s, x, n, a: x[0].mean(dim=a["axes"], keepdim=bool(a.get("keepdims", 1))),
  "Concat": lambda s, x, n, a: torch.cat(x, a["axis"]),
  "MatMul": lambda s, x, n, a: x[0] @ x[1],
  "Gemm": _gemm, "Slice": _slice, "Flatten": _flatten, "Conv": _conv,
  "Reshape": lambda s, x, n, a: x[0].reshape(s.consts[n[1]]),
  "Transpose": lambda s, x, n, a: x[0].permute(a["perm"]),
}

MODEL_W, MODEL_H = 512, 256
UV_SCALE = [[1.0, 1.0, 0.5], [1.0, 1.0, 0.5], [2.0, 2.0, 1.0]]
IMG_Q, FEAT_Q, DESIRE_Q, FRAME_SKIP, HISTORY = 5, 97, 100, 4, 25


def _sample(M: torch.Tensor, out_w: int, out_h: int, src_w: int, src_h: int):
  ys, xs = torch.meshgrid(torch.arange(out_h, device=M.device, dtype=torch.float32), torch.arange(out_w, device=M.device, dtype=torch.float32),
                          indexing="ij")
  w = M[2, 0] * xs + M[2, 1] * ys + M[2, 2]
  sx = torch.round((M[0, 0] * xs + M[0, 1] * ys + M[0, 2]) / w).clamp(0, src_w - 1).long()   # round: half to even, like tinygrad
  sy = torch.round((M[1, 0] * xs + M[1, 1] * ys + M[1, 2]) / w).clamp(0, src_h - 1).long()
  return sx, sy


def warp_nv12(frame: torch.Tensor, M: torch.Tensor, width: int, height: int, stride: int, uv_offset: int,
              uv_scale: torch.Tensor | None = None) -> torch.Tensor:
  """uv_scale: the (3,3) S*M*S^-1 factors already on M's device (nothing may come from the host inside a CUDA graph)."""
  sx, sy = _sample(M, MODEL_W, MODEL_H, width, height)
  y = frame[(sy * stride + sx).flatten()].reshape(MODEL_H, MODEL_W)
  if uv_scale is None:
    uv_scale = torch.tensor(UV_SCALE, device=M.device)
  Muv = M * uv_scale
  ux, uy = _sample(Muv, MODEL_W // 2, MODEL_H // 2, width // 2, height // 2)
  uv = (uv_offset + uy * stride + ux * 2).flatten()
  u, v = frame[uv].reshape(MODEL_H // 2, MODEL_W // 2), frame[uv + 1].reshape(MODEL_H // 2, MODEL_W // 2)
  return torch.stack([y[0::2, 0::2], y[1::2, 0::2], y[0::2, 1::2], y[1::2, 1::2], u, v])


class TorchStep:
  """The fused step (warp x 2 + queues + vision + policy) on static buffers, replayed as one CUDA graph."""

  def __init__(self, vision: Path, policy: Path, nv, device: str = "cuda"):
    self.vision, self.policy, self.nv, self.dev = TorchOnnx(vision, device), TorchOnnx(policy, device), nv, device
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
    self.frame, self.big_frame = z(nv.size, dt=torch.uint8), z(nv.size, dt=torch.uint8)
    # identity transforms until the first call: a zero matrix divides by zero and indexes out of the frame while capturing
    self.tfm, self.big_tfm, self.desire, self.tc = torch.eye(3, device=device), torch.eye(3, device=device), z(1, 8), z(1, 2)
    self.img_q, self.big_img_q = z(IMG_Q, 6, 128, 256, dt=torch.uint8), z(IMG_Q, 6, 128, 256, dt=torch.uint8)
    self.feat_q, self.desire_q = z(FEAT_Q, 1, 512), z(DESIRE_Q, 1, 8)
    self.uv_scale = torch.tensor(UV_SCALE, device=device)
    self.graph: torch.cuda.CUDAGraph | None = None

  def _push(self, q: torch.Tensor, x: torch.Tensor) -> None:
    q.copy_(torch.cat([q[1:], x.reshape(1, *q.shape[1:]).to(q.dtype)]))

  def _step(self):
    nv = self.nv
    self._push(self.img_q, warp_nv12(self.frame, self.tfm, nv.width, nv.height, nv.stride, nv.uv_offset, self.uv_scale))
    self._push(self.big_img_q, warp_nv12(self.big_frame, self.big_tfm, nv.width, nv.height, nv.stride, nv.uv_offset, self.uv_scale))
    img, big = (q[0::IMG_Q - 1].reshape(1, 12, 128, 256) for q in (self.img_q, self.big_img_q))   # rows t-4 and t
    vd = self.vision.input_dtypes
    v = self.vision(img=img.to(vd["img"]), big_img=big.to(vd["big_img"])).float()
    self._push(self.feat_q, v[:, 1064:1576])
    self._push(self.desire_q, self.desire)
    feats = self.feat_q[0::FRAME_SKIP].reshape(1, HISTORY, 512)
    pulses = self.desire_q.reshape(HISTORY, FRAME_SKIP, 1, 8).amax(1).reshape(1, HISTORY, 8)
    pd = self.policy.input_dtypes
    p = self.policy(features_buffer=feats.to(pd["features_buffer"]), desire_pulse=pulses.to(pd["desire_pulse"]),
                    traffic_convention=self.tc.to(pd["traffic_convention"])).float()
    return v, p

  def capture(self, warmup: int = 3) -> None:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
      for _ in range(warmup):
        self._step()
    torch.cuda.current_stream().wait_stream(s)
    self.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(self.graph):
      self.out = self._step()

  def __call__(self, frame: torch.Tensor, big_frame: torch.Tensor, tfm: np.ndarray, big_tfm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    assert self.graph is not None
    self.frame.copy_(frame)
    self.big_frame.copy_(big_frame)
    self.tfm.copy_(torch.from_numpy(tfm))
    self.big_tfm.copy_(torch.from_numpy(big_tfm))
    self.graph.replay()
    return self.out[0].cpu().numpy(), self.out[1].cpu().numpy()
