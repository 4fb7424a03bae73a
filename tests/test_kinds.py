"""The model kinds as data (artifact/kinds.py): the registry, programs recorded and bound by name, and the refusals when an
artifact's recorded programs are not its kind's."""
from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import clone_artifact, rewrite_file

from artifact import kinds
from artifact.format import MANIFEST, METADATA, ArtifactError, verify_artifact
from compile.programs import check_signature, recipe_of
from modeld_msm.named_program import NamedProgram, host_arrays
from selfdrive_glue.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def _reseal(d: Path, fn) -> None:
  meta = json.loads((d / METADATA).read_text())
  fn(meta)
  rewrite_file(d / METADATA, json.dumps(meta).encode())
  import hashlib
  m = json.loads((d / MANIFEST).read_text())
  m["files"] = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in m["files"]}
  rewrite_file(d / MANIFEST, json.dumps(m).encode())


def test_every_spelling_names_one_kind():
  for name in kinds.choices():
    assert kinds.get(name).name in kinds.KINDS
  assert kinds.get("combined") is kinds.KINDS["supercombo"] and kinds.get("dm") is kinds.KINDS["dmonitoring"]
  with pytest.raises(KeyError):
    kinds.get("stateful-ish")
  spellings = kinds.choices()
  assert len(spellings) == len(set(spellings))   # an alias never shadows another kind


def test_each_kind_has_its_compile_recipe():
  """compile.programs.<kind> exists for every kind, its step plan has a warp-only step exactly where the kind has a warp
  program, and its unjitted methods take the inputs the kind's spec lists, in its order (the order the artifact records is
  the one the JIT was captured with)."""
  import inspect
  for kind in kinds.KINDS.values():
    recipe = recipe_of(kind)
    assert recipe.plan and set(recipe.plan) <= {"P", "W"}
    assert ("W" in recipe.plan) == any(p.role == "warp" for p in kind.programs)
    prog_cls = inspect.signature(recipe.build).return_annotation
    prog_cls = getattr(inspect.getmodule(recipe), prog_cls) if isinstance(prog_cls, str) else prog_cls
    probe = SimpleNamespace(**{n: getattr(prog_cls, n) for n in dir(prog_cls) if n.startswith("run")})   # its methods, unbound
    for role, fn in recipe.unjitted(probe).items():
      check_signature(fn, [io.name for io in kind.program(role).inputs], f"{kind.name} {role}")


def test_a_signature_drift_is_refused():
  def run(calib, frame):   # frame and calib swapped against the DM spec
    pass
  with pytest.raises(UserError, match=r"takes \(calib, frame\), the kind's spec lists \(frame, calib\)"):
    check_signature(run, [io.name for io in kinds.KINDS["dmonitoring"].program("step").inputs], "the DM step")


def test_named_program_binds_by_the_recorded_order():
  """Whatever order the artifact records, each tensor reaches the argument of its name, and the outputs come back named."""
  seen = []

  def jit(*args):
    seen.append(args)
    return ("V", "P")
  spec = {"inputs": [{"name": n, "role": "host"} for n in ("tfm", "frame", "desire")], "outputs": [{"name": "vision"}, {"name": "policy"}]}
  out = NamedProgram(jit, spec)({"desire": "d", "frame": "f", "tfm": "t", "extra": "x"})
  assert seen == [("t", "f", "d")] and out == {"vision": "V", "policy": "P"}
  with pytest.raises(UserError, match="reads the input 'tfm'"):
    NamedProgram(jit, spec, "x.pkl").require({"frame", "desire"})


def test_host_arrays_follow_the_spec():
  arrays = host_arrays(kinds.KINDS["supercombo"].program("step").as_meta())
  assert {k: v.shape for k, v in arrays.items()} == {"desire": (8,), "traffic_convention": (1, 2), "action_t": (1, 2), "tfm": (3, 3),
                                                     "big_tfm": (3, 3)}
  assert all(v.dtype == np.float32 for v in arrays.values())


def test_mismatch_names_the_first_difference():
  kind = kinds.KINDS["driving"]
  good = kind.specs()
  assert kinds.mismatch(good, kind) is None
  permuted = json.loads(json.dumps(good))
  permuted["driving_policy.pkl"]["inputs"].reverse()   # any order: the runtime binds by name
  assert kinds.mismatch(permuted, kind) is None
  renamed = json.loads(json.dumps(good))
  renamed["driving_policy.pkl"]["inputs"][2]["name"] = "wish"
  assert kinds.mismatch(renamed, kind) == "driving_policy.pkl has no input 'desire' (host float32 8), which the driving kind has"
  reshaped = json.loads(json.dumps(good))
  reshaped["driving_warp.pkl"]["inputs"][4]["shape"] = [4, 4]
  assert kinds.mismatch(reshaped, kind) == "driving_warp.pkl's input 'tfm' is host float32 4x4, the driving kind's is host float32 3x3"
  assert "programs" in kinds.mismatch(kinds.KINDS["supercombo"].specs() | {"extra.pkl": {}}, kinds.KINDS["supercombo"])
  assert "not a table" in kinds.mismatch(["x"], kind)


def test_a_packed_input_is_laid_out_from_the_registry_and_checked_member_by_member():
  """The stateful kind's one packed host buffer: master's order (both transforms, the host inputs, both frames), each member
  at a multiple of 128 bytes, the frames as the camera's NV12 planes; the runtime's arrays are views of the one buffer; a
  record that places a member elsewhere, or an artifact from before the packing, is refused naming what differs."""
  kind, cam = kinds.KINDS["stateful"], (1928, 1208)
  with pytest.raises(ValueError, match="camera size"):
    kind.specs()
  (packed,) = kind.specs(cam)["driving_step.pkl"]["inputs"]
  frame = 2048 * (1216 + 608)
  assert [(m["name"], m["offset"], m["shape"]) for m in packed["members"]] == [
    ("tfm", 0, [2, 3, 3]), ("desire", 128, [8]), ("traffic_convention", 256, [1, 2]), ("action_t", 384, [1, 2]),
    ("frame", 512, [frame]), ("big_frame", 512 + frame, [frame])]
  assert packed["shape"] == [512 + 2 * frame] and packed["dtype"] == "uint8"
  host = host_arrays(kind.program("step").as_meta(cam))
  host["desire"][3], host["big_frame"][0] = 1.5, 7
  assert np.frombuffer(host["packed"][128 + 12:128 + 16].tobytes(), np.float32)[0] == 1.5 and host["packed"][512 + frame] == 7
  good = kind.specs(cam)
  assert kinds.mismatch(good, kind, cam) is None
  assert "holds frame uint8" in kinds.mismatch(good, kind, (1344, 760))   # another camera: other frame sizes and places
  moved = json.loads(json.dumps(good))
  moved["driving_step.pkl"]["inputs"][0]["members"][2]["offset"] = 260
  assert kinds.mismatch(moved, kind, cam) == ("driving_step.pkl's packed input 'packed' holds traffic_convention float32 1x2 at byte 260 "
                                             "where the stateful kind's layout has traffic_convention float32 1x2 at byte 256")
  old = json.loads(json.dumps(good))
  old["driving_step.pkl"]["inputs"] = [{"name": n, "role": "host", "shape": None, "dtype": "float32"} for n in ("frame", "big_frame", "desire")]
  assert "compiled before the stateful kind took them in one packed host buffer 'packed'" in kinds.mismatch(old, kind, cam)


@pytest.mark.xdist_group("cpu_artifact_1928")
def test_the_artifact_records_its_programs_and_verify_checks_them(cpu_artifact_1928, tmp_path, cli):
  meta = json.loads((cpu_artifact_1928 / METADATA).read_text())
  assert meta["programs"] == kinds.KINDS["driving"].specs()
  d = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  _reseal(d, lambda m: m["programs"]["driving_policy.pkl"]["inputs"].__setitem__(4, {**m["programs"]["driving_policy.pkl"]["inputs"][4],
                                                                                     "name": "action_t"}))
  with pytest.raises(ArtifactError, match="driving_policy.pkl has no input 'tfm'"):
    verify_artifact(d)
  r = cli("verify", d)
  assert r.returncode == 2 and "has no input 'tfm'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.xdist_group("cpu_artifact_1928")
def test_an_artifact_from_before_the_programs_were_recorded_still_runs(cpu_artifact_1928, tmp_path):
  """Without "programs" in its metadata the artifact's kind's specs stand in: same outputs as with them."""
  from modeld_msm.model_state import ModelState
  d = clone_artifact(cpu_artifact_1928, tmp_path / "a")
  _reseal(d, lambda m: m.pop("programs"))
  art = verify_artifact(d)
  assert art.programs == kinds.KINDS["driving"].specs()
  frame = np.random.default_rng(0).integers(0, 256, art.meta["camera"]["size"], dtype=np.uint8)
  eye, tc = np.eye(3, dtype=np.float32), np.array([[1, 0]], np.float32)
  outs = []
  for path in (cpu_artifact_1928, d):
    ms = ModelState(path)
    outs.append(ms.run(frame, frame, eye, eye, np.zeros(8, np.float32), tc, False)[1])
  assert np.array_equal(*outs)


def test_kind_names_stand_only_in_the_registry_and_the_user_facing_spots():
  """The kind names appear as string literals only in artifact/kinds.py (and the modules named after a kind, which are
  that kind's): everything else looks them up. Tests, benches and the CLI's help text are out of scope."""
  names = set(kinds.KINDS) | {a for k in kinds.KINDS.values() for a in k.aliases}
  allowed = {ROOT / "artifact" / "kinds.py"} | {ROOT / "compile" / "programs" / f"{n}.py" for n in kinds.KINDS}
  found = []
  for pkg in ("artifact", "modeld_msm", "compile", "offcar", "release"):
    for f in (ROOT / pkg).rglob("*.py"):
      if f in allowed:
        continue
      for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Compare):
          for c in (x for x in [node.left, *node.comparators] if isinstance(x, ast.Constant) and x.value in names):
            found.append(f"{f.relative_to(ROOT)}:{c.lineno} {c.value!r}")
  assert not found, "kinds switched on by name outside the registry:\n" + "\n".join(found)
