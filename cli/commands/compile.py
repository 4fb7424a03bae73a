"""`modeld-msm compile`: build one verified artifact for a camera size and device: the driving model (--vision + --policy,
openpilot 0.11; or --model driving_supercombo.onnx, master's combined model) or the driver-monitoring model (--dmonitoring)."""
from __future__ import annotations

from pathlib import Path

from artifact import kinds
from artifact.format import disk_full_error
from compile.build import compile_artifact
from compile.onnx_model import detect_contract
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import parse_camera


def add_arguments(p) -> None:
  p.add_argument("--vision", help="driving_vision.onnx (with --policy: the driving model, for modeld)")
  p.add_argument("--policy", help="driving_policy.onnx")
  p.add_argument("--model", metavar="ONNX", help="a one-file model, its contract read from its inputs: driving_supercombo.onnx "
                                                 "(openpilot master's driving model; modeld serves it like the pair) or dmonitoring_model.onnx "
                                                 "(the driver-monitoring model, for dmonitoringmodeld)")
  p.add_argument("--dmonitoring", metavar="ONNX", help="dmonitoring_model.onnx, the same as --model with the driver-monitoring model")
  p.add_argument("--camera", default="1928x1208", help="camera size: 1928x1208 (ar0231/ox03c10) or 1344x760 (os04c10)")
  p.add_argument("--device", default="CPU", help="CPU (off the car), CPU:LLVM (needs libLLVM >= 16), QCOM (Adreno 630, captured on the "
                                                 "emulated render node), or a workstation GPU for replay: CUDA, NV, AMD")
  p.add_argument("-o", "--out", required=True, help="artifact directory to write (replaced atomically)")
  p.add_argument("--precision", choices=("auto", "fp16", "fp32"), default="auto",
                 help="compute precision (default auto: fp32 on a CPU, native fp16 or not; fp16 on QCOM, always, and on GPUs)")
  p.add_argument("--layout", choices=("auto", "on", "off"), default=None,
                 help="CPU layout (transposed constant weights, dense convolutions materialised, pointwise convolutions on our "
                      "kernel); default auto = on for CPU targets, "
                      "or $MODELD_CPU_LAYOUT")
  p.add_argument("--openpilot", choices=("0.11", "master"), default=None,
                 help="whose QCOM build flags (0.11: IMAGE=2, master: IMAGE=1; both FLOAT16 NOLOCALS JIT_BATCH_SIZE=0 OPENPILOT_HACKS): "
                      "the driving pair is 0.11's and --model master's; --dmonitoring runs in both (default 0.11)")
  p.add_argument("--search", choices=("auto", "off"), default=None,
                 help="the shipped kernel search (compile/cpu/search_table.json), used only where it was recorded for these models; "
                      "default auto, or $MODELD_CPU_SEARCH")


def _kind_and_models(args) -> tuple[kinds.Kind, dict[str, str]]:
  """The kind the given files are (the pair: 0.11's driving model; --model: whatever contract its inputs say) and its models."""
  single = [(flag, path) for flag, path in (("--model", args.model), ("--dmonitoring", args.dmonitoring)) if path]
  if args.dmonitoring and (args.vision or args.policy or args.model):
    raise UserError("--dmonitoring builds an artifact of its own; compile the driving model (--vision/--policy or --model) into another -o")
  if args.model and (args.vision or args.policy):
    raise UserError("--model is a one-file model, in place of 0.11's --vision/--policy pair; pass one or the other")
  if not single:
    if not (args.vision and args.policy):
      raise UserError("pass the driving model as --vision driving_vision.onnx --policy driving_policy.onnx (openpilot 0.11) or "
                      "--model driving_supercombo.onnx (master), or the driver-monitoring model as --model dmonitoring_model.onnx")
    return kinds.KINDS["driving"], {"vision": args.vision, "policy": args.policy}
  flag, path = single[0]
  contract = detect_contract(path) if Path(path).is_file() else None
  if flag == "--dmonitoring":   # the older spelling: the file must be the DM model, which load_model_info checks
    contract = "dmonitoring"
  kind = kinds.of_model(contract) if contract is not None else kinds.of_model("supercombo")
  if kind is None:
    raise UserError(f"{path} is the {contract} half of 0.11's driving model: pass it as --{contract} with its "
                    f"--{'policy' if contract == 'vision' else 'vision'}")
  return kind, {kind.models[0]: path}


def _compile(args):
  camera = parse_camera(args.camera)
  kind, models = _kind_and_models(args)
  return compile_artifact(kind, models, camera, args.device, args.out, precision=args.precision, layout=args.layout, search=args.search,
                          openpilot=args.openpilot)


def run(args) -> int:
  try:
    report = _compile(args)
  except Exception as e:
    # a full disk can hit any write of the compile (tinygrad's kernel cache, temp model copies, the artifact): one clear line,
    # exit 2, instead of a traceback from wherever it struck; the artifact itself is written atomically (artifact/format.py)
    full = None
    x: BaseException | None = e
    for _ in range(8):   # down the chain: tinygrad re-raises a compile worker's error with the original as its cause
      if x is None or (full := disk_full_error(x, "while compiling", args.out)) is not None:
        break
      x = x.__cause__ or x.__context__
    if full is None:
      raise
    raise full from None
  print(report.table())
  return 0
