"""Master's stateful driving model (since 2026-09) compiled and served as a kind of the registry: its per-frame program, states
on the device fed back in place, gives what 0.11's split program gives frame after frame on drop-free sequences; with drops
it follows master (a dropped frame is not in the history, no warp-only step); planted runtime bugs each break that. The
artifact records its kind, program and the graph's states; modeld serves it, every frame publishing."""
from __future__ import annotations

import json
from contextlib import contextmanager

import numpy as np
import pytest
from tinygrad import Tensor

from artifact import kinds
from compile.onnx_model import load_model_info
from compile.programs.driving import driving_inputs
from compile.programs.driving_step import DrivingProgram
from compile.programs.stateful_step import StatefulProgram
from compile.refmodels.driving import POLICY_SLICES, VISION_SLICES, write_models
from compile.refmodels.stateful import write_stateful_model
from compile.refmodels.supercombo import slices
from modeld_msm.named_program import host_of, host_tensors
from selfdrive_glue.nv12 import nv12_info
from tests.conftest import clone_artifact, rewrite_file, run_cli

CAMERA = (1344, 760)
NV = nv12_info(*CAMERA)
FRAMES = 11     # from the 5th on, rows t-4 of the image state are frames the program pushed itself
# fp32 on the CPU: the split and the stateful graph compute the same network, in kernels fused differently, so reductions
# may be ordered differently; 1e-4 is orders above that rounding (~1e-6 at these magnitudes) and far below what a state
# fed wrong moves (the planted bugs below differ by > 1e-2)
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def infos(tmp_path_factory):
  d = tmp_path_factory.mktemp("stateful")
  pair = write_models(d / "pair", "tiny", 7)
  model = write_stateful_model(d / "stateful", "tiny", 7)
  return (load_model_info(pair["vision"].path, "vision"), load_model_info(pair["policy"].path, "policy"),
          load_model_info(model.path, "stateful"))


def _run(program, frames: list[dict], received: list[bool], stateful: bool, dropped_as_warp: bool = False) -> list[np.ndarray]:
  """Outputs per received frame: the split program runs its full step on received frames and nothing on dropped ones (so the
  two see the same history, master's semantics); the stateful one its step on the packed buffer, written by member name
  (or, planted, a warp-only push on a drop)."""
  host, packed = host_of(), host_of(kinds.KINDS["stateful"], CAMERA)
  host_t, packed_t = host_tensors(host), Tensor(packed["packed"], device="NPY")
  outs = []
  for f, got in zip(frames, received):
    for k in host:
      host[k][...] = f[k]
    for k in ("desire", "traffic_convention", "action_t"):
      packed[k][...] = f[k]
    packed["tfm"][...] = (f["tfm"], f["big_tfm"])
    for k in ("frame", "big_frame"):
      packed[k][...] = f[k].numpy()[:packed[k].size]
    if not got:
      if dropped_as_warp:
        program.push_only(packed_t)
      continue
    if stateful:
      outs.append(program.run_step(packed_t).numpy()[0])
    else:
      args = (f["frame"], f["big_frame"], host_t["desire"], host_t["traffic_convention"])
      v, p = (t.numpy()[0] for t in program.run_policy(*args, host_t["tfm"], host_t["big_tfm"]))
      outs.append(_place(v, p))
  return outs


def _place(v: np.ndarray, p: np.ndarray) -> np.ndarray:
  """The split pair's outputs laid out as the combined model's (supercombo slices), the action head (which the pair has
  not) left zero and out of the comparison."""
  out = np.zeros(2580, np.float32)
  for name, s in slices().items():
    if name != "action":
      out[s] = v[VISION_SLICES[name]] if name in VISION_SLICES else p[POLICY_SLICES[name]]
  return out


_KEEP: list = []   # the numpy frames the CPU frame tensors alias, alive for the module


def _frames(seed: int = 3) -> list[dict]:
  steps = driving_inputs(NV, "CPU", seed, FRAMES)
  _KEEP.append(steps.buffers)
  rng = np.random.default_rng(seed)
  return [{**s, "action_t": np.array([[rng.uniform(0.1, 0.5), rng.uniform(0.3, 0.8)]], np.float32)} for s in steps]


def _first_mismatch(got: list[np.ndarray], want: list[np.ndarray]) -> int | None:
  keep = np.ones(2580, bool)
  keep[slices()["action"]] = False
  for i, (g, w) in enumerate(zip(got, want)):
    if not np.allclose(g[keep], w[keep], atol=ATOL, rtol=RTOL):
      return i
  return None


class _NotFedBack(StatefulProgram):
  """Planted: the feature state is read but next_state_feat_q never written back."""

  def run_step(self, *a):
    keep = self.states["state_feat_q"].numpy().copy()
    out = super().run_step(*a)
    self.states["state_feat_q"].assign(Tensor(keep)).realize()
    return out


class _AdvancedTwice(StatefulProgram):
  """Planted: the step runs twice per frame, so every state moves two rows."""

  def run_step(self, *a):
    super().run_step(*a)
    return super().run_step(*a)


class _HostCopy(StatefulProgram):
  """Planted: the host keeps its own copy of the states and feeds it back, refreshed a frame late."""

  def run_step(self, *a):
    if (copy := getattr(self, "_copy", None)) is not None:
      for k, t in self.states.items():
        t.assign(Tensor(copy[k])).realize()
    self._copy = {k: t.numpy().copy() for k, t in self.states.items()}
    return super().run_step(*a)


class _CamerasSwapped(StatefulProgram):
  """Planted: the two cameras' rows of the image state swapped (the wide camera read as the road one)."""

  def unpack(self, packed):
    v = super().unpack(packed)
    return {**v, "frame": v["big_frame"], "big_frame": v["frame"], "tfm": v["tfm"].flip(0)}


class _WarpOnly(StatefulProgram):
  """Planted: a dropped frame pushed into the image state as 0.11's warp-only step did."""

  def push_only(self, packed):
    from compile.programs.warp import warp_nv12
    v = self.unpack(packed.to(self.device))
    new = Tensor.stack(warp_nv12(v["frame"], v["tfm"][0], self.nv12), warp_nv12(v["big_frame"], v["tfm"][1], self.nv12)).reshape(2, 1, 6, 128, 256)
    q = self.states["state_img_q"]
    q.assign(q[:, 1:].cat(new.cast(q.dtype), dim=1).contiguous()).realize()


def test_stateful_program_is_the_split_program_frame_after_frame(infos):
  vinfo, pinfo, sinfo = infos
  frames, all_frames = _frames(), [True] * FRAMES
  want = _run(DrivingProgram(vinfo, pinfo, NV, "CPU"), frames, all_frames, stateful=False)
  got = _run(StatefulProgram(sinfo, NV, "CPU"), frames, all_frames, stateful=True)
  assert _first_mismatch(got, want) is None
  assert not np.allclose(got[0], got[-1])   # the outputs move: the check compares something


def test_drops_follow_master_the_history_skips_them(infos):
  """A dropped frame is not in master's history: the stateful program equals the split program fed only the received
  frames (not 0.11's, whose warp-only step pushes the dropped frame's image)."""
  vinfo, pinfo, sinfo = infos
  frames = _frames(5)
  received = [i not in (3, 4, 7) for i in range(FRAMES)]
  want = _run(DrivingProgram(vinfo, pinfo, NV, "CPU"), frames, received, stateful=False)
  assert _first_mismatch(_run(StatefulProgram(sinfo, NV, "CPU"), frames, received, stateful=True), want) is None
  warp_only = _run(_WarpOnly(sinfo, NV, "CPU"), frames, received, stateful=True, dropped_as_warp=True)
  assert _first_mismatch(warp_only, want) is not None


@pytest.mark.parametrize("bug", [_NotFedBack, _AdvancedTwice, _HostCopy, _CamerasSwapped], ids=lambda c: c.__name__.strip("_"))
def test_planted_state_bugs_break_the_equivalence(infos, bug):
  vinfo, pinfo, sinfo = infos
  frames, all_frames = _frames(), [True] * FRAMES
  want = _run(DrivingProgram(vinfo, pinfo, NV, "CPU"), frames, all_frames, stateful=False)
  assert _first_mismatch(_run(bug(sinfo, NV, "CPU"), frames, all_frames, stateful=True), want) is not None


def _reseal(d, edit) -> None:
  """Edit an artifact's metadata and re-hash its manifest (no signature): only the programs' record is wrong."""
  import hashlib
  meta = json.loads((d / "metadata.json").read_text())
  edit(meta)
  rewrite_file(d / "metadata.json", json.dumps(meta).encode())
  m = json.loads((d / "manifest.json").read_text())
  m["files"] = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in m["files"]}
  rewrite_file(d / "manifest.json", json.dumps(m).encode())


@contextmanager
def _uploads():
  """The bytes of each host->device copy tinygrad makes inside the block: from a host buffer (NPY, PYTHON) into device
  memory, by either path its copy takes (the source's copyout into mappable memory, else the device's copyin)."""
  from tinygrad import Device
  sizes: list[int] = []
  undo = []

  def count(alloc, name: str, nbytes):
    orig = getattr(alloc, name)
    setattr(alloc, name, lambda *a: (sizes.append(nbytes(*a)), orig(*a))[1])
    undo.append((alloc, name))
  for host in ("NPY", "PYTHON"):
    count(Device[host].allocator, "_copyout", lambda dest, src: memoryview(dest).nbytes)
  count(Device[Device.DEFAULT].allocator, "_copyin", lambda dest, src: memoryview(src).nbytes)
  try:
    yield sizes
  finally:
    for alloc, name in undo:
      delattr(alloc, name)


def test_the_kind_is_a_registry_entry_with_the_graphs_states(infos, tmp_path):
  """compile --model detects the contract; the artifact records kind, program and the graph's states; verify shows them;
  modeld's state runs it on every frame, a frame after drops included (no warp-only program), with one host->device copy per
frame (the packed buffer); a record whose packed layout is not the kind's is refused by verify."""
  from modeld_msm.model_state import ModelState
  _, _, sinfo = infos
  out = tmp_path / "art"
  r = run_cli("compile", "--model", sinfo.path, "--camera", "1344x760", "--device", "CPU", "-o", out, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "states state_img_q uint8 2x5x6x128x256" in r.stdout and "jit == unjitted" in r.stdout
  meta = json.loads((out / "metadata.json").read_text())
  assert meta["kind"] == "stateful" and meta["programs"] == kinds.KINDS["stateful"].specs(CAMERA)
  assert meta["states"] == {"state_img_q": {"shape": [2, 5, 6, 128, 256], "dtype": "uint8"},
                            "state_desire_q": {"shape": [100, 1, 8], "dtype": "float32"},
                            "state_feat_q": {"shape": [96, 1, 512], "dtype": "float32"}}
  v = run_cli("verify", out, timeout=120)
  assert v.returncode == 0 and "kind     stateful" in v.stdout and "driving_step.pkl (step)" in v.stdout, v.stdout + v.stderr
  assert "tfm @0, desire @128, traffic_convention @256, action_t @384, frame @512, big_frame @1622528" in v.stdout, v.stdout
  ms = ModelState(out)
  assert ms.warp is None and ms.reads_action_t
  buf = np.random.default_rng(0).integers(0, 256, NV.size, dtype=np.uint8)
  eye, tc = np.eye(3, dtype=np.float32), np.array([[1, 0]], np.float32)
  packed_bytes = meta["programs"]["driving_step.pkl"]["inputs"][0]["shape"][0]
  with _uploads() as first_copies:
    first, _ = ms.run(buf, buf, eye, eye, np.zeros(8, np.float32), tc, prepare_only=False, action_t=np.array([[0.2, 0.3]], np.float32))
  with _uploads() as drop_copies:
    after_drop, _ = ms.run(buf, buf, eye, eye, np.zeros(8, np.float32), tc, prepare_only=True, action_t=np.array([[0.2, 0.3]], np.float32))
  assert first is not None and after_drop is not None and "action" in after_drop
  # master's one upload per frame: the packed buffer, both frames inside it, and nothing else
  assert first_copies == drop_copies == [packed_bytes] and packed_bytes > 2 * NV.stride * (NV.y_height + NV.uv_height)
  # the layout the runtime would fill, moved by 4 bytes in the record: refused by verify in one line
  moved = clone_artifact(out, tmp_path / "moved")
  _reseal(moved, lambda m: m["programs"]["driving_step.pkl"]["inputs"][0]["members"][1].__setitem__("offset", 132))
  bad = run_cli("verify", moved, timeout=120)
  assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
  assert "holds desire float32 8 at byte 132 where the stateful kind's layout has desire float32 8 at byte 128" in bad.stderr
  dm = run_cli("serve-dm", "--artifact", out, timeout=120)
  assert dm.returncode == 2 and "stateful driving model" in dm.stderr and "Traceback" not in dm.stderr, dm.stderr


def test_a_graph_whose_host_inputs_pack_otherwise_is_refused(infos, tmp_path):
  """The layout the program reads comes from the graph's inputs (their order included); the artifact records the kind's and
  the runtime fills that one: a graph declaring action_t before desire would have both read from the wrong bytes, so the
  compile refuses it by name before anything is captured."""
  import onnx

  from compile.programs import recipe_of
  from selfdrive_glue.errors import UserError
  _, _, sinfo = infos
  m = onnx.load(str(sinfo.path))
  ins = {i.name: i for i in m.graph.input}
  order = [n if n not in ("desire", "action_t") else {"desire": "action_t", "action_t": "desire"}[n] for n in ins]
  reordered = [onnx.helper.make_tensor_value_info(n, ins[n].type.tensor_type.elem_type, [d.dim_value for d in ins[n].type.tensor_type.shape.dim])
               for n in order]
  del m.graph.input[:]
  m.graph.input.extend(reordered)
  onnx.save(m, str(tmp_path / "driving_supercombo.onnx"))
  info = load_model_info(tmp_path / "driving_supercombo.onnx", "stateful")
  want = r"pack as \(tfm 2x3x3, action_t 1x2, traffic_convention 1x2, desire 8, .*the stateful kind's buffer as \(tfm 2x3x3, desire 8"
  with pytest.raises(UserError, match=want):
    recipe_of(kinds.KINDS["stateful"]).build({"stateful": info}, NV, "CPU", "fp32", False, "master")
