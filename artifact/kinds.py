"""The model kinds: the one place a kind is named and everything that differs between kinds is written down as data.

A kind is a contract between a compiled artifact and the process that serves it: the ONNX models it is compiled from, the
programs it holds, and each program's inputs and outputs by name, dtype, shape and role. The compile writes these specs into
the artifact's metadata ("programs"); the loader checks them against the kind's and the runtime binds its buffers by name,
so no code reads a program's argument order but from the artifact (the compile checks the programs' signatures against it).

What is behaviour rather than data is found from the kind by its name in the floor that owns it: its compile recipe (the
program it builds, its step plan, its reference models) is `compile.programs.<name>`, and the process that serves it is
`process` (modeld runs every kind whose process is "modeld"). The kind names stand as literals here and where a user types
them.
"""
from __future__ import annotations

from dataclasses import dataclass

from selfdrive_glue.nv12 import nv12_info

# input roles: a camera frame (flat uint8 NV12, its size the artifact's camera), an array the host writes in place every
# frame, or one packed uint8 host buffer holding several of those (its members) that goes up in one copy; state the
# programs keep on the device between frames is no argument: the artifact records it apart ("states")
FRAME, HOST, PACKED = "frame", "host", "packed"
# every member of a packed buffer starts at a multiple of this many bytes (master pads each float array to it)
PACK_ALIGN = 128
_ITEMSIZE = {"uint8": 1, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class IO:
  name: str
  role: str = HOST                          # inputs: FRAME / HOST; outputs: "output"
  shape: tuple[int, ...] | None = None      # None: a frame, flat, as many bytes as the camera's NV12 layout
  dtype: str = "float32"
  slices: str | None = None                 # outputs: which model's output_slices cut it (metadata "models")
  members: tuple[IO, ...] = ()              # a PACKED input: what its one buffer holds, in order (frames as camera-sized members)

  def as_meta(self, camera: tuple[int, int] | None = None) -> dict:
    """camera: the artifact's (width, height), which sizes a packed input (its frames) and places its members."""
    if self.role == PACKED:
      if camera is None:
        raise ValueError(f"the packed input '{self.name}' is laid out for a camera size; pass one")
      size, members = packed_layout(self.members, camera)
      return {"name": self.name, "role": self.role, "shape": [size], "dtype": self.dtype, "members": members}
    return {"name": self.name, "role": self.role, "shape": list(self.shape) if self.shape is not None else None, "dtype": self.dtype,
            **({"slices": self.slices} if self.slices is not None else {})}


def frame_bytes(camera: tuple[int, int]) -> int:
  """The bytes of one camera frame as a packed buffer holds it: the NV12 planes (stride x (Y rows + UV rows)), not the
  VisionIPC buffer's padded tail, which no warp reads."""
  nv = nv12_info(*camera)
  return nv.stride * (nv.y_height + nv.uv_height)


def packed_layout(members: tuple[IO, ...], camera: tuple[int, int]) -> tuple[int, list[dict]]:
  """-> (the buffer's bytes, each member as {"name", "role", "offset", "shape", "dtype"}): the members in order, each at the
  next multiple of PACK_ALIGN bytes; a frame member (shape None) is frame_bytes(camera) of uint8."""
  out, at = [], 0
  for m in members:
    shape = list(m.shape) if m.shape is not None else [frame_bytes(camera)]
    n = _ITEMSIZE[m.dtype]
    for d in shape:
      n *= d
    out.append({"name": m.name, "role": m.role, "offset": at, "shape": shape, "dtype": m.dtype})
    at += -(-n // PACK_ALIGN) * PACK_ALIGN
  return at, out


@dataclass(frozen=True)
class Program:
  file: str                  # the pickle in the artifact
  role: str                  # "step" (a full frame), "warp" (a dropped frame: the image queues only)
  inputs: tuple[IO, ...]
  outputs: tuple[IO, ...]

  def as_meta(self, camera: tuple[int, int] | None = None) -> dict:
    return {"role": self.role, "inputs": [i.as_meta(camera) for i in self.inputs], "outputs": [o.as_meta() for o in self.outputs]}


@dataclass(frozen=True)
class Kind:
  name: str                          # metadata "kind", bundle.json "contract", the CLI's word
  title: str                         # what a message calls it
  contract: str                      # what openpilot ships it as
  process: str                       # the openpilot process that serves it
  models: tuple[str, ...]            # the ONNX contracts it is compiled from (compile/onnx_model.py), in the order given
  model_files: tuple[str, ...]       # what openpilot's tree calls those files
  compile_flags: str                 # how `modeld-msm compile` is given its models
  programs: tuple[Program, ...]
  bundle_dir: str = ""               # where a release bundle keeps its artifacts: <bundle>/<bundle_dir>/<w>x<h>/
  openpilot: str = "0.11"            # whose QCOM build flags by default (compile/capture.py QCOM_FLAGS_OF)
  openpilot_choice: bool = False     # the user may build it with the other release's flags (it runs under both)
  aliases: tuple[str, ...] = ()      # older or other spellings users may have in scripts
  action_head: bool = False          # modeld steers by the model's own "action" output where it has one (else the plan)
  renamed_services: bool = False     # the openpilot it ships in publishes master's service names of 2026-09 (narrowRoadCameraState, ...)

  def program(self, role: str) -> Program:
    return next(p for p in self.programs if p.role == role)

  def specs(self, camera: tuple[int, int] | None = None) -> dict[str, dict]:
    """The programs as the artifact's metadata records them (camera: needed by a kind with a packed input)."""
    return {p.file: p.as_meta(camera) for p in self.programs}


POLICY_PKL, WARP_PKL, DM_PKL, STEP_PKL = "driving_policy.pkl", "driving_warp.pkl", "dmonitoring_model.pkl", "driving_step.pkl"

_FRAMES = (IO("frame", FRAME, dtype="uint8"), IO("big_frame", FRAME, dtype="uint8"))
_TFMS = (IO("tfm", HOST, (3, 3)), IO("big_tfm", HOST, (3, 3)))
_DESIRE, _TRAFFIC = IO("desire", HOST, (8,)), IO("traffic_convention", HOST, (1, 2))


def _driving_programs(inputs: tuple[IO, ...], outputs: tuple[IO, ...]) -> tuple[Program, ...]:
  return (Program(POLICY_PKL, "step", inputs, outputs), Program(WARP_PKL, "warp", inputs, ()))


KINDS: dict[str, Kind] = {k.name: k for k in (
  Kind("driving", "driving model (modeld)", "0.11's vision + policy pair", "modeld", ("vision", "policy"),
       ("driving_vision.onnx", "driving_policy.onnx"), "--vision/--policy",
       _driving_programs((*_FRAMES, _DESIRE, _TRAFFIC, *_TFMS),
                         (IO("vision", "output", slices="vision"), IO("policy", "output", slices="policy"))),
       aliases=("pair", "split")),
  Kind("supercombo", "combined driving model of openpilot master (modeld)", "master's combined model (driving_supercombo.onnx)",
       "modeld", ("supercombo",), ("driving_supercombo.onnx",), "--model",
       _driving_programs((*_FRAMES, _DESIRE, _TRAFFIC, IO("action_t", HOST, (1, 2)), *_TFMS), (IO("outputs", "output", slices="supercombo"),)),
       openpilot="master", aliases=("combined",), action_head=True),
  Kind("stateful", "stateful driving model of openpilot master since 2026-09 (modeld)",
       "master's stateful model (driving_supercombo.onnx since 2026-09)", "modeld", ("stateful",),
       ("driving_supercombo.onnx",), "--model",
       # master's one upload per frame: both transforms, the graph's host inputs in its order, both frames (one copy of the lot)
       (Program(STEP_PKL, "step", (IO("packed", PACKED, dtype="uint8", members=(IO("tfm", HOST, (2, 3, 3)), _DESIRE, _TRAFFIC,
                                                                                IO("action_t", HOST, (1, 2)), *_FRAMES)),),
                (IO("outputs", "output", slices="stateful"),)),),
       openpilot="master", aliases=("master-2026-09",), action_head=True, renamed_services=True),
  Kind("dmonitoring", "driver-monitoring model (dmonitoringmodeld)", "dmonitoring_model.onnx", "dmonitoringmodeld", ("dmonitoring",),
       ("dmonitoring_model.onnx",), "--dmonitoring",
       (Program(DM_PKL, "step", (IO("frame", FRAME, dtype="uint8"), IO("calib", HOST, (1, 3))),
                (IO("outputs", "output", slices="dmonitoring"),)),),
       bundle_dir="dmonitoring", openpilot_choice=True, aliases=("dm", "driver-monitoring")),
)}
DEFAULT = KINDS["driving"]
# artifacts written before there was more than one kind carry no "kind"
LEGACY_KIND = DEFAULT.name


def get(name: str) -> Kind:
  """A kind by its name or one of its aliases; KeyError for anything else."""
  if name in KINDS:
    return KINDS[name]
  for k in KINDS.values():
    if name in k.aliases:
      return k
  raise KeyError(name)


def choices() -> list[str]:
  """Every spelling a user may type, names first (argparse choices)."""
  return [*KINDS, *(a for k in KINDS.values() for a in k.aliases)]


def served_by(process: str) -> tuple[Kind, ...]:
  return tuple(k for k in KINDS.values() if k.process == process)


def bundle_dirs() -> tuple[str, ...]:
  """The folders of a release bundle that hold artifacts, the root ("") first."""
  return tuple(dict.fromkeys(k.bundle_dir for k in KINDS.values()))


def of_model(model: str) -> Kind | None:
  """The kind compiled from one ONNX contract alone (None for a contract that is half of a pair)."""
  return next((k for k in KINDS.values() if k.models == (model,)), None)


def _io_line(io: dict) -> str:
  shape = "camera-sized" if io.get("shape") is None else "x".join(map(str, io["shape"])) or "scalar"
  return f"{io.get('role')} {io.get('dtype')} {shape}"


def _member_line(m: dict) -> str:
  shape = m.get("shape")
  return f"{m.get('name')} {m.get('dtype')} {'x'.join(map(str, shape)) if isinstance(shape, list) else shape} at byte {m.get('offset')}"


def _packed_mismatch(file: str, name: str, got: list, want: list[dict], kind: str) -> str | None:
  """Why a packed input's recorded members are not the kind's layout: the first member that differs in name, role,
  place, shape or dtype (the runtime fills and the program reads the buffer by this layout)."""
  if not isinstance(got, list) or not all(isinstance(m, dict) for m in got):
    return f"{file}'s packed input '{name}' records no layout of its members"
  for i, w in enumerate(want):
    g = got[i] if i < len(got) else None
    if g is None or any(g.get(f) != w[f] for f in ("name", "role", "offset", "shape", "dtype")):
      have = _member_line(g) if g is not None else "nothing"
      return f"{file}'s packed input '{name}' holds {have} where the {kind} kind's layout has {_member_line(w)}"
  if len(got) > len(want):
    return f"{file}'s packed input '{name}' holds {_member_line(got[len(want)])} past the {kind} kind's layout"
  return None


def mismatch(programs: object, kind: Kind, camera: tuple[int, int] | None = None) -> str | None:
  """Why an artifact's recorded programs (metadata "programs") are not its kind's, in one line naming the first
  difference; None when each program has the kind's inputs and outputs, by name, role, dtype and shape (in any order: the
  runtime binds by name), and each packed input the kind's layout for the artifact's camera."""
  want = kind.specs(camera)
  if not isinstance(programs, dict) or not all(isinstance(p, dict) for p in programs.values()):
    return "its metadata's \"programs\" is not a table of programs"
  if set(programs) != set(want):
    return f"it holds the programs {', '.join(sorted(programs)) or 'none'}, the {kind.name} kind's are {', '.join(sorted(want))}"
  for file, w in want.items():
    got = programs[file]
    if got.get("role") != w["role"]:
      return f"{file} is its {got.get('role')!r} program, the {kind.name} kind's {file} is its {w['role']!r} one"
    for side in ("inputs", "outputs"):
      g_list = got.get(side)
      if not isinstance(g_list, list) or not all(isinstance(x, dict) and isinstance(x.get("name"), str) for x in g_list):
        return f"{file}'s {side} are not a list of named specs"
      g, ww = {x["name"]: x for x in g_list}, {x["name"]: x for x in w[side]}
      if len(g) != len(g_list):
        return f"{file} names an {side[:-1]} twice"
      if missing := [n for n in ww if n not in g]:
        if ww[missing[0]]["role"] == PACKED:
          return (f"{file} takes {', '.join(g) or 'nothing'} as separate inputs: it was compiled before the {kind.name} kind took them "
                  f"in one packed host buffer '{missing[0]}' (2026-12)")
        return f"{file} has no {side[:-1]} '{missing[0]}' ({_io_line(ww[missing[0]])}), which the {kind.name} kind has"
      if extra := [n for n in g if n not in ww]:
        return f"{file} has an {side[:-1]} '{extra[0]}' the {kind.name} kind does not have"
      for n, x in ww.items():
        if x["role"] == PACKED and (why := _packed_mismatch(file, n, g[n].get("members"), x["members"], kind.name)) is not None:
          return why
        if any(g[n].get(f) != x.get(f) for f in ("role", "dtype", "shape", "slices")):
          return f"{file}'s {side[:-1]} '{n}' is {_io_line(g[n])}, the {kind.name} kind's is {_io_line(x)}"
  return None
