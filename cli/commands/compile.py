"""`modeld-msm compile`: build one verified artifact for a camera size and device: the driving model (--vision + --policy,
openpilot 0.11; or --model driving_supercombo.onnx, master's combined model) or the driver-monitoring model (--dmonitoring)."""
from __future__ import annotations

from artifact.format import disk_full_error
from compile.build import compile_artifact
from compile.dm_build import compile_dm_artifact
from compile.supercombo_build import compile_supercombo_artifact
from selfdrive_glue.errors import UserError
from selfdrive_glue.nv12 import parse_camera


def add_arguments(p) -> None:
  p.add_argument("--vision", help="driving_vision.onnx (with --policy: the driving model, for modeld)")
  p.add_argument("--policy", help="driving_policy.onnx")
  p.add_argument("--model", metavar="ONNX", help="driving_supercombo.onnx: openpilot master's combined driving model, in place of "
                                                 "--vision/--policy (modeld serves either)")
  p.add_argument("--dmonitoring", metavar="ONNX", help="dmonitoring_model.onnx: the driver-monitoring model, for dmonitoringmodeld (its own "
                                                       "artifact: pass it without --vision/--policy)")
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
                 help="the shipped kernel search (compile/cpu_search_table.json), used only where it was recorded for these models; "
                      "default auto, or $MODELD_CPU_SEARCH")


def _compile(args):
  camera = parse_camera(args.camera)
  if args.dmonitoring:
    if args.vision or args.policy or args.model:
      raise UserError("--dmonitoring builds an artifact of its own; compile the driving model (--vision/--policy or --model) into "
                      "another -o")
    if args.search:
      raise UserError("--search is the driving model's kernel search; the driver-monitoring compile has none")
    return compile_dm_artifact(args.dmonitoring, camera, args.device, args.out, precision=args.precision, layout=args.layout,
                               openpilot=args.openpilot or "0.11")
  if args.openpilot == ("0.11" if args.model else "master"):
    whose = "--model driving_supercombo.onnx is master" if args.model else "the --vision/--policy pair is 0.11"
    raise UserError(f"--openpilot {args.openpilot}: {whose}'s driving model and builds with its flags; --openpilot chooses only "
                    "for --dmonitoring")
  if args.model:
    if args.vision or args.policy:
      raise UserError("--model is master's combined driving model, in place of 0.11's --vision/--policy pair; pass one or the other")
    if args.search:
      raise UserError("--search is the 0.11 driving model's kernel search; the combined model's compile has none")
    return compile_supercombo_artifact(args.model, camera, args.device, args.out, precision=args.precision, layout=args.layout)
  if not (args.vision and args.policy):
    raise UserError("pass the driving model as --vision driving_vision.onnx --policy driving_policy.onnx (openpilot 0.11) or "
                    "--model driving_supercombo.onnx (master), or the driver-monitoring model as --dmonitoring dmonitoring_model.onnx")
  return compile_artifact(args.vision, args.policy, camera, args.device, args.out, precision=args.precision, layout=args.layout,
                          search=args.search)


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
