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

# input roles: a camera frame (flat uint8 NV12, its size the artifact's camera) or an array the host writes in place every
# frame; state the programs keep on the device between frames is no argument: the artifact records it apart ("states")
FRAME, HOST = "frame", "host"


@dataclass(frozen=True)
class IO:
  name: str
  role: str = HOST                          # inputs: FRAME / HOST; outputs: "output"
  shape: tuple[int, ...] | None = None      # None: a frame, flat, as many bytes as the camera's NV12 layout
  dtype: str = "float32"
  slices: str | None = None                 # outputs: which model's output_slices cut it (metadata "models")

  def as_meta(self) -> dict:
    return {"name": self.name, "role": self.role, "shape": list(self.shape) if self.shape is not None else None, "dtype": self.dtype,
            **({"slices": self.slices} if self.slices is not None else {})}


@dataclass(frozen=True)
class Program:
  file: str                  # the pickle in the artifact
  role: str                  # "step" (a full frame), "warp" (a dropped frame: the image queues only)
  inputs: tuple[IO, ...]
  outputs: tuple[IO, ...]

  def as_meta(self) -> dict:
    return {"role": self.role, "inputs": [i.as_meta() for i in self.inputs], "outputs": [o.as_meta() for o in self.outputs]}


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

  def specs(self) -> dict[str, dict]:
    """The programs as the artifact's metadata records them."""
    return {p.file: p.as_meta() for p in self.programs}


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
       (Program(STEP_PKL, "step", (*_FRAMES, _DESIRE, _TRAFFIC, IO("action_t", HOST, (1, 2)), *_TFMS),
                (IO("outputs", "output", slices="stateful"),)),),
       openpilot="master", aliases=("master-2026-09",), action_head=True, renamed_services=True),
  Kind("dmonitoring", "driver-monitoring model (dmonitoringmodeld)", "dmonitoring_model.onnx", "dmonitoringmodeld", ("dmonitoring",),
       ("dmonitoring_model.onnx",), "--dmonitoring",
       (Program(DM_PKL, "step", (IO("frame", FRAME, dtype="uint8"), IO("m_inv", HOST, (3, 3)), IO("calib", HOST, (1, 3))),
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


def mismatch(programs: object, kind: Kind) -> str | None:
  """Why an artifact's recorded programs (metadata "programs") are not its kind's, in one line naming the first
  difference; None when each program has the kind's inputs and outputs, by name, role, dtype and shape (in any order: the
  runtime binds by name)."""
  want = kind.specs()
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
        return f"{file} has no {side[:-1]} '{missing[0]}' ({_io_line(ww[missing[0]])}), which the {kind.name} kind has"
      if extra := [n for n in g if n not in ww]:
        return f"{file} has an {side[:-1]} '{extra[0]}' the {kind.name} kind does not have"
      for n, x in ww.items():
        if any(g[n].get(f) != x.get(f) for f in ("role", "dtype", "shape", "slices")):
          return f"{file}'s {side[:-1]} '{n}' is {_io_line(g[n])}, the {kind.name} kind's is {_io_line(x)}"
  return None
