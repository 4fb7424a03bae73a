"""The smoke test a bundle carries: a fixed recorded input and the outputs its own artifact produced at build time.

Recorded by the release build into `<bundle>/smoke/<camera>/`, replayed by `modeld-msm smoke` on the device:
  frames.nv12.zst   4 (road, wide) NV12 frame pairs of a procedurally rendered drive, zstd-compressed. 100 raw frames
                    at 1928x1208 would be ~960 MB; 4 distinct pairs cycled through the 100 steps are ~60 kB compressed,
                    and the feature/desire queues still carry 100 frames of history, so the recurrent path is exercised;
  inputs.npz        per frame: which pair, the warp matrices (jittered around the scene's calibration), desire pulses,
                    traffic convention (LHD then RHD) and whether the frame is dropped (warp only, every 10th);
  expected.npz      the raw outputs (vision ++ policy) of every non-dropped frame, float32;
  smoke.json        what produced them (device, target; a QCOM bundle's are the emulated a630 executing the bundle's
                    own IR3 program, level B) and the tolerance a replay must meet.

A replay runs the same frames through `ModelState`, the code `serve` runs, and stops at the first output outside the
tolerance, naming it by the artifact's output slices.

A driver-monitoring artifact's smoke test (`<bundle>/smoke/dmonitoring/<camera>/`) has the same files: its 8 distinct
frames are stored as the 4 pairs, each step reads one of them (`pair`, `which`) under its own calib and warp matrix
(jittered around the camera's), through `DMonitoringCore`, the code `serve-dm` runs; expected.npz holds its raw outputs.
"""
from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from artifact.format import verify_artifact
from modeld_msm.constants import DESIRE_LEN
from modeld_msm.dm_core import DMonitoringCore
from modeld_msm.model_state import ModelState
from release.bundle import sha256_bytes
from selfdrive_glue.camera import model_transforms, sensor_and_device
from selfdrive_glue.errors import UserError
from selfdrive_glue.road_render import RoadScene

FRAMES_FILE, INPUTS_FILE, EXPECTED_FILE, META_FILE = "frames.nv12.zst", "inputs.npz", "expected.npz", "smoke.json"
SMOKE_FORMAT = 1
SMOKE_FRAMES = 100
DM_SMOKE_FRAMES = 20   # the DM program keeps no state between frames: a few frames cover it (a QCOM build executes each)
DISTINCT_PAIRS = 4
DROP_EVERY = 10
SEED = 7
# (rtol, atol): |got - expected| <= atol + rtol * |expected| elementwise.
# CPU: the replay runs the very machine code that produced the expectation, so anything but rounding noise is a fault.
# QCOM: the expectation is the emulator's execution of the same IR3; a real a630's transcendental and fp16 rounding may
# differ in the last bits, so the fp16 bound the compile step uses against onnxruntime applies.
TOLERANCE = {"CPU": (1e-5, 1e-5), "QCOM": (2e-2, 2e-2)}


@dataclass
class SmokeInput:
  pairs: list[tuple[np.ndarray, np.ndarray]]   # (road, wide) NV12 buffers
  inputs: dict[str, np.ndarray]

  @property
  def frames(self) -> int:
    return int(len(self.inputs["pair"]))


def make_input(camera: str, frames: int = SMOKE_FRAMES, seed: int = SEED) -> SmokeInput:
  scene = RoadScene(seed, camera)
  pairs: list[tuple[np.ndarray, np.ndarray]] = []
  for k in range(DISTINCT_PAIRS):
    road, wide = np.zeros(scene.info.size, np.uint8), np.zeros(scene.info.size, np.uint8)
    scene.render_into(road, 0.5 * k, "road")
    scene.render_into(wide, 0.5 * k, "wide")
    pairs.append((road, wide))
  sensor, device_type = sensor_and_device(camera)
  tfm, big = model_transforms(scene.calib_rpy, device_type, sensor, main_wide=False)
  rng = np.random.default_rng(seed)
  n = frames
  jitter = lambda m, s: (m[None] * (1 + rng.normal(0, s, (n, 3, 3)) * np.array([[1, 1, 0], [1, 1, 0], [0, 0, 0]]))).astype(np.float32)  # noqa: E731
  desire = np.zeros((n, DESIRE_LEN), np.float32)
  for start in range(15, n, 30):   # a held desire (e.g. a lane change) for 8 frames every 30: rising edges make pulses
    desire[start:start + 8, 1 + (start // 30) % (DESIRE_LEN - 1)] = 1
  tc = np.zeros((n, 1, 2), np.float32)
  tc[:, 0, 0] = 1
  tc[n // 2:, 0] = (0, 1)   # right-hand traffic for the second half
  inputs = {
    "pair": (np.arange(n) % DISTINCT_PAIRS).astype(np.int16),
    "tfm": jitter(tfm, 0.01), "big_tfm": jitter(big, 0.01),
    "desire": desire, "traffic_convention": tc,
    "prepare_only": (np.arange(n) % DROP_EVERY) == DROP_EVERY - 1,
  }
  return SmokeInput(pairs, inputs)


def make_dm_input(camera: str, frames: int = SMOKE_FRAMES, seed: int = SEED) -> SmokeInput:
  """The driver-monitoring smoke input: 8 distinct rendered frames, per step one of them with a calib (the warp matrix is the
  camera's, built into the program)."""
  base = make_input(camera, 1, seed)
  rng = np.random.default_rng([seed, 1])
  n = frames
  step = np.arange(n)
  inputs: dict[str, np.ndarray] = {"pair": (step % DISTINCT_PAIRS).astype(np.int16), "which": ((step // DISTINCT_PAIRS) % 2).astype(np.int16),
                                                          "calib": rng.normal(0, 0.05, (n, 3)).astype(np.float32)}
  return SmokeInput(base.pairs, inputs)


def replay(state, inp: SmokeInput) -> Iterator[tuple[int, np.ndarray | None]]:
  """(frame, raw outputs or None on a dropped frame) for each recorded frame, through `state` (a ModelState, or a
  DMonitoringCore for a driver-monitoring artifact)."""
  x = inp.inputs
  if isinstance(state, DMonitoringCore):
    for i in range(inp.frames):
      state.host["calib"][0] = x["calib"][i]
      yield i, state.run(inp.pairs[int(x["pair"][i])][int(x["which"][i])])
    return
  for i in range(inp.frames):
    road, wide = inp.pairs[int(x["pair"][i])]
    # a combined model's action_t stays zero: the recording and every later check feed the same
    _, raw = state.run(road, wide, x["tfm"][i], x["big_tfm"][i], x["desire"][i], x["traffic_convention"][i], bool(x["prepare_only"][i]))
    yield i, raw


def _npz_bytes(**arrays) -> bytes:
  b = io.BytesIO()
  np.savez_compressed(b, **arrays)
  return b.getvalue()


def record(artifact_dir: Path, out_dir: Path, frames: int = SMOKE_FRAMES, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
  """Run the just-built artifact over the recorded input and write the smoke files into out_dir.
  -> the bundle.json entry: file hashes, producer, frame counts, seconds."""
  import zstandard

  t0 = time.perf_counter()
  art = verify_artifact(artifact_dir, pubkey="")
  camera = f"{art.camera[0]}x{art.camera[1]}"
  inp = make_dm_input(camera, frames) if art.spec.process == "dmonitoringmodeld" else make_input(camera, frames)
  state = load_state(art)
  from tinygrad import Device
  producer = _producer(Device.DEFAULT)
  if art.device == "QCOM" and not producer["executes"]:
    raise UserError("internal error: the QCOM smoke expectation would come from an emulator that does not execute (level A); please report it")
  outs, idx = [], []
  for i, raw in replay(state, inp):
    if raw is not None:
      if not np.isfinite(raw).all():
        raise UserError(f"the artifact produces non-finite outputs on the smoke input at frame {i}; check the model files")
      outs.append(raw.astype(np.float32))
      idx.append(i)
    if progress:
      progress(i + 1, inp.frames)
  rtol, atol = TOLERANCE[art.device]
  files = {
    FRAMES_FILE: zstandard.ZstdCompressor(level=19).compress(b"".join(b.tobytes() for pair in inp.pairs for b in pair)),
    INPUTS_FILE: _npz_bytes(**inp.inputs),
    EXPECTED_FILE: _npz_bytes(raw=np.stack(outs), frame=np.array(idx, np.int32)),
  }
  meta = {"format": SMOKE_FORMAT, "camera": camera, "frames": inp.frames, "outputs": len(idx), "distinct_pairs": DISTINCT_PAIRS,
          "drop_every": DROP_EVERY, "seed": SEED, "frame_bytes": int(inp.pairs[0][0].size), "producer": producer,
          "tolerance": {"rtol": rtol, "atol": atol}, "artifact_manifest_sha256": sha256_bytes((artifact_dir / "manifest.json").read_bytes())}
  files[META_FILE] = json.dumps(meta, indent=1, sort_keys=True).encode()
  out_dir.mkdir(parents=True, exist_ok=True)
  for name, data in files.items():   # out_dir is inside the release build's temp dir, swapped in whole
    (out_dir / name).write_bytes(data)
  return {"files": {name: sha256_bytes(data) for name, data in files.items()}, "frames": inp.frames, "outputs": len(idx),
          "producer": producer, "bytes": sum(len(d) for d in files.values()), "seconds": round(time.perf_counter() - t0, 1)}


def load_state(art):
  """What runs the artifact the way its process does: ModelState (modeld) or DMonitoringCore (dmonitoringmodeld)."""
  return DMonitoringCore(art) if art.spec.process == "dmonitoringmodeld" else ModelState(art)


def _producer(device: str) -> dict[str, Any]:
  from tinygrad import Device
  iface = getattr(Device[device], "iface", None)
  node = getattr(iface, "node", None)
  executes = node is None or bool(getattr(node, "execute", False))   # no node: a real device (or the CPU) computes
  kind = type(iface).__name__ if iface is not None else device
  return {"device": device, "interface": kind, "executes": executes,
          "what": "emulated a630 executing the IR3 program (level B)" if node is not None else device if iface is None else f"{device} ({kind})"}


def load_input(d: Path, meta: dict[str, Any]) -> SmokeInput:
  import zstandard
  with np.load(d / INPUTS_FILE) as z:
    inputs = {k: z[k] for k in z.files}
  raw = zstandard.ZstdDecompressor().decompress((d / FRAMES_FILE).read_bytes())
  n = int(meta["frame_bytes"])
  if len(raw) != 2 * DISTINCT_PAIRS * n:
    raise UserError(f"smoke frames in {d} have {len(raw)} bytes, expected {2 * DISTINCT_PAIRS * n}; rebuild the bundle")
  bufs = [np.frombuffer(raw, np.uint8, n, k * n).copy() for k in range(2 * DISTINCT_PAIRS)]
  return SmokeInput([(bufs[2 * k], bufs[2 * k + 1]) for k in range(DISTINCT_PAIRS)], inputs)


@dataclass
class SmokeResult:
  camera: str
  ok: bool
  frames: int = 0
  outputs: int = 0
  load_s: float = 0.0
  run_s: float = 0.0
  frame_ms: list[float] | None = None
  max_diff: float = 0.0
  mismatch: str | None = None
  target: str = ""

  def line(self) -> str:
    if not self.ok:
      return f"{self.camera}: FAIL {self.mismatch}"
    ms = sorted(self.frame_ms or [0.0])
    return (f"{self.camera}: PASS  {self.frames} frames ({self.outputs} outputs) on {self.target}: load {self.load_s:.1f} s, "
            f"run {self.run_s:.1f} s (median {ms[len(ms) // 2]:.1f} ms/frame), max |diff| {self.max_diff:.3g}")


def output_name(art, index: int) -> str:
  """The named output slice that raw index `index` (the step's outputs one after another: vision ++ policy, or the one
  model's) falls in, e.g. "policy 'plan'[37]"."""
  j = index
  for out in art.program("step")[1]["outputs"]:
    model = out["slices"]
    width = int(sum(int(np.prod(s)) for s in art.meta["models"][model]["output_shapes"].values()))
    if j < width:
      for name, sl in sorted(art.output_slices(model).items(), key=lambda kv: kv[1].start):
        if sl.start <= j < sl.stop:
          return f"{model} '{name}'[{j - sl.start}]"
      return f"{model} output [{j}] (in no named slice)"
    j -= width
  return f"output [{index}] (past the step's outputs)"


def check(art, smoke_dir: Path, frames: int | None = None, tolerance: tuple[float, float] | None = None,
          progress: Callable[[int, int], None] | None = None) -> SmokeResult:
  """Replay the recorded input on the artifact's device; stop at the first output outside the tolerance."""
  camera = f"{art.camera[0]}x{art.camera[1]}"
  meta = json.loads((smoke_dir / META_FILE).read_text())
  if meta.get("format") != SMOKE_FORMAT:
    raise UserError(f"smoke data in {smoke_dir} is of format {meta.get('format')}, this modeld-msm reads {SMOKE_FORMAT}; rebuild the bundle")
  inp = load_input(smoke_dir, meta)
  with np.load(smoke_dir / EXPECTED_FILE) as z:
    expected, exp_frames = z["raw"], z["frame"]
  want = dict(zip(exp_frames.tolist(), range(len(exp_frames))))
  # the device's own tolerance: smoke.json's is a record of the build, never what a replay is held to (a bundle could say 1e9)
  rtol, atol = tolerance or TOLERANCE[art.device]
  n = min(frames or inp.frames, inp.frames)
  t0 = time.perf_counter()
  state = load_state(art)
  res = SmokeResult(camera, True, load_s=time.perf_counter() - t0, frame_ms=[], target=os.environ.get("MODELD_DEV") or art.meta["load_target"])
  t1 = time.perf_counter()
  last = t1
  for i, raw in replay(state, SmokeInput(inp.pairs, {k: v[:n] for k, v in inp.inputs.items()})):
    now = time.perf_counter()
    assert res.frame_ms is not None
    res.frame_ms.append((now - last) * 1e3)
    last = now
    res.frames = i + 1
    if progress:
      progress(i + 1, n)
    if raw is None:
      continue
    if i not in want:
      res.ok, res.mismatch = False, f"at frame {i}: the artifact produced outputs where the recording has a dropped frame"
      break
    ref = expected[want[i]].astype(np.float64)
    res.outputs += 1
    if raw.shape != ref.shape:
      res.ok, res.mismatch = False, f"at frame {i}: {raw.size} outputs, the recording has {ref.size}"
      break
    got = raw.astype(np.float64)
    diff = np.abs(got - ref)
    excess = np.where(np.isfinite(got), diff - (atol + rtol * np.abs(ref)), np.inf)
    if (excess > 0).any():
      k = int(np.argmax(excess > 0))   # the first diverging output in output order
      res.ok = False
      res.mismatch = (f"at frame {i}: first diverging output is {output_name(art, k)}: got {got[k]:.6g}, expected {ref[k]:.6g} "
                      f"(|diff| {diff[k]:.3g} > {atol:g} + {rtol:g}*|expected|; {int((excess > 0).sum())} of {got.size} outputs off)")
      break
    res.max_diff = max(res.max_diff, float(diff.max()))
  res.run_s = time.perf_counter() - t1
  return res
