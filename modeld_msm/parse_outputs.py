"""Turn the flat vision/policy output vectors into named, shaped heads (MDN means/stds, probabilities).

Every head keeps the batch axis: `parse_*` take `{name: (1, width)}` (from `slice_outputs`) and return a new dict where
the heads they know are replaced by their parsed form; other entries (hidden_state, pad) pass through untouched.
Inputs are never modified. Arithmetic stays in the input dtype (float32 from the model) like openpilot's parser.
"""
from __future__ import annotations

import math

import numpy as np

from modeld_msm import constants as C
from selfdrive_glue.errors import UserError

EXP_CLIP = 11.  # exp(11) ~ 6e4, just under float16's max; larger logits are saturation, not signal


def safe_exp(x: np.ndarray) -> np.ndarray:
  return np.exp(np.minimum(x, EXP_CLIP))


def sigmoid(x: np.ndarray) -> np.ndarray:
  return 1. / (1. + safe_exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
  e = safe_exp(x - np.max(x, axis=axis, keepdims=True))
  return e / np.sum(e, axis=axis, keepdims=True)


def slice_outputs(flat: np.ndarray, output_slices: dict[str, slice]) -> dict[str, np.ndarray]:
  """Cut the model's flat output into heads, each with a leading batch axis of 1 (views, no copies)."""
  flat = np.asarray(flat)
  if flat.ndim != 1:
    raise UserError(f"model output must be a flat vector, got shape {flat.shape}; flatten it before slicing")
  out = {}
  for name, s in output_slices.items():
    if not isinstance(s, slice):
      raise UserError(f"output slice for '{name}' is {s!r}, not a slice; the model metadata is malformed, recompile it")
    start, stop, _ = s.indices(len(flat))
    wanted = s.stop if s.stop is not None else len(flat)
    if wanted > len(flat) or stop < start:
      raise UserError(f"output slice '{name}' {s} does not fit a {len(flat)}-wide output; metadata and model do not match")
    out[name] = flat[np.newaxis, s]
  return out


def _head(outs: dict[str, np.ndarray], name: str) -> np.ndarray:
  if name not in outs:
    raise UserError(f"model output has no '{name}' head (heads: {', '.join(sorted(outs))}); "
                    "use a driving model whose metadata lists it")
  raw = np.asarray(outs[name])
  if raw.ndim < 2:
    raise UserError(f"head '{name}' must have a batch axis, got shape {raw.shape}; pass slice_outputs() results")
  return raw


def _last_argmax(w: np.ndarray) -> int:
  # among equal weights take the highest index, as a stable ascending sort read from the top does
  return len(w) - 1 - int(np.argmax(w[::-1]))


def parse_mdn(outs: dict[str, np.ndarray], name: str, in_N: int, out_N: int, out_shape: tuple[int, ...]) -> None:
  """Mixture-density head: per hypothesis [mu(n), log_std(n), weight logits(out_N)], n = prod(out_shape).

  in_N > 1 (multi-hypothesis): for each of the out_N selections keep the hypothesis with the largest softmax weight.
  Writes `name`, `name_stds` and, for multi-hypothesis heads, `name_weights`, `name_hypotheses`, `name_stds_hypotheses`.
  """
  raw = _head(outs, name)
  batch = raw.shape[0]
  n_hyp = max(in_N, 1)
  n_values = math.prod(out_shape)
  width = raw[0].size
  if width != n_hyp * (2 * n_values + out_N):
    raise UserError(f"head '{name}' is {width} wide, expected {n_hyp} x (2 x {n_values} + {out_N}) = "
                    f"{n_hyp * (2 * n_values + out_N)}; the model does not match this parser")
  raw = raw.reshape((batch, n_hyp, -1))
  mu = raw[:, :, :n_values]
  std = safe_exp(raw[:, :, n_values:2 * n_values])

  if in_N > 1:
    weights = np.zeros((batch, in_N, out_N), dtype=raw.dtype)
    for i in range(out_N):
      col = i - out_N  # weight logits are the last out_N values of each hypothesis
      weights[:, :, col] = softmax(raw[:, :, col], axis=-1)
    if out_N == 1:
      # single selection: hypotheses are also reported best-first
      mu, std = mu.copy(), std.copy()
      for b in range(batch):
        order = np.argsort(weights[b, :, 0], kind="stable")[::-1]
        weights[b], mu[b], std[b] = weights[b][order], mu[b][order], std[b][order]
    full_shape = (batch, in_N, *out_shape)
    outs[name + "_weights"] = weights
    outs[name + "_hypotheses"] = mu.reshape(full_shape)
    outs[name + "_stds_hypotheses"] = std.reshape(full_shape)

    mu_final = np.zeros((batch, out_N, n_values), dtype=raw.dtype)
    std_final = np.zeros((batch, out_N, n_values), dtype=raw.dtype)
    for b in range(batch):
      for j in range(out_N):
        best = _last_argmax(weights[b, :, j])
        mu_final[b, j], std_final[b, j] = mu[b, best], std[b, best]
  else:
    mu_final, std_final = mu, std

  final_shape = (batch, out_N, *out_shape) if out_N > 1 else (batch, *out_shape)
  outs[name] = mu_final.reshape(final_shape)
  outs[name + "_stds"] = std_final.reshape(final_shape)


def parse_binary_crossentropy(outs: dict[str, np.ndarray], name: str) -> None:
  outs[name] = sigmoid(_head(outs, name))


def parse_categorical_crossentropy(outs: dict[str, np.ndarray], name: str, out_shape: tuple[int, ...] | None = None) -> None:
  raw = _head(outs, name)
  if out_shape is not None:
    if raw[0].size != math.prod(out_shape):
      raise UserError(f"head '{name}' is {raw[0].size} wide, expected {math.prod(out_shape)} for shape {out_shape}")
    raw = raw.reshape((raw.shape[0], *out_shape))
  outs[name] = softmax(raw, axis=-1)


def _is_mhp(outs: dict[str, np.ndarray], name: str, n_values: int) -> bool:
  # a single-hypothesis MDN head is exactly mu + std wide
  return _head(outs, name)[0].size != 2 * n_values


def parse_vision_outputs(outs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  d = dict(outs)
  parse_mdn(d, "pose", 0, 0, (C.POSE_WIDTH,))
  parse_mdn(d, "wide_from_device_euler", 0, 0, (C.WIDE_FROM_DEVICE_WIDTH,))
  parse_mdn(d, "road_transform", 0, 0, (C.POSE_WIDTH,))
  parse_mdn(d, "lane_lines", 0, 0, (C.NUM_LANE_LINES, C.IDX_N, C.LANE_LINES_WIDTH))
  parse_mdn(d, "road_edges", 0, 0, (C.NUM_ROAD_EDGES, C.IDX_N, C.ROAD_EDGES_WIDTH))
  parse_binary_crossentropy(d, "lane_lines_prob")
  parse_categorical_crossentropy(d, "desire_pred", (C.DESIRE_PRED_LEN, C.DESIRE_PRED_WIDTH))
  parse_binary_crossentropy(d, "meta")
  parse_binary_crossentropy(d, "lead_prob")
  lead_traj = (C.LEAD_TRAJ_LEN, C.LEAD_WIDTH)
  if _is_mhp(d, "lead", C.LEAD_MHP_SELECTION * math.prod(lead_traj)):
    parse_mdn(d, "lead", C.LEAD_MHP_N, C.LEAD_MHP_SELECTION, lead_traj)
  else:
    parse_mdn(d, "lead", 0, 0, (C.LEAD_MHP_SELECTION, *lead_traj))
  return d


def parse_policy_outputs(outs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  d = dict(outs)
  plan_shape = (C.IDX_N, C.PLAN_WIDTH)
  if _is_mhp(d, "plan", math.prod(plan_shape)):
    parse_mdn(d, "plan", C.PLAN_MHP_N, C.PLAN_MHP_SELECTION, plan_shape)
  else:
    parse_mdn(d, "plan", 0, 0, plan_shape)
  parse_categorical_crossentropy(d, "desire_state", (C.DESIRE_PRED_WIDTH,))
  return d
