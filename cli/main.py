"""`modeld-msm` entry point: one subcommand per module in cli/commands/.

Each command module exposes add_arguments(parser) and run(args) -> int; its one-line help is HELP below.
Imports are lazy so `modeld-msm verify` on the car never imports onnx or matplotlib.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from selfdrive_glue.errors import UserError, describe_os_error
from selfdrive_glue.files import Terminated, stop_on_sigterm

COMMANDS = ["models", "compile", "verify", "keygen", "sign", "release", "install", "uninstall", "smoke", "serve", "serve-dm", "demo", "synth",
            "replay", "regress", "train", "train-dm", "doctor", "calibrate-a630"]

HELP = {
  "models": "write reference models: driving_vision.onnx + driving_policy.onnx, or dmonitoring_model.onnx (tiny or full)",
  "compile": "compile vision+policy ONNX (or the driver-monitoring ONNX) into a verified artifact for one camera size and device",
  "verify": "check an artifact (manifest, versions, device) without running it",
  "keygen": "make an ed25519 key pair for signing release bundles",
  "sign": "sign an artifact or a release bundle (ed25519) so a configured public key accepts it",
  "release": "release build: compile + verify + bundle one artifact per camera size, with a recorded smoke test",
  "install": "install a release bundle into an openpilot checkout: openpilot's manager then runs this modeld",
  "uninstall": "undo `install`: the process table byte for byte as before, the bundle removed",
  "smoke": "replay the bundle's recorded input on this device's GPU and compare with the outputs expected at build time",
  "serve": "run as openpilot's modeld process",
  "serve-dm": "run as openpilot's dmonitoringmodeld process (driver camera in, driverStateV2 out)",
  "demo": "end-to-end demo on the embedded default: camera server, modeld, listener",
  "synth": "write a synthetic drive segment (rlog + HEVC) from procedurally rendered roads",
  "replay": "run logged segments through the model pipeline into an output log",
  "regress": "compare two replay output logs field by field",
  "train": "train the tiny stand-in vision + policy on rendered drives (the recipe behind the demo's default models)",
  "train-dm": "train the tiny driver-monitoring stand-in on rendered cabins (the recipe behind the demo's DM model)",
  "doctor": "report tinygrad/tinymesa versions, kernel interfaces and render node facts",
  "calibrate-a630": "time every kernel of a QCOM artifact by the GPU's clock and fit the a630 cost model's constants to it",
}


# the modules each optional part of the install brings (pyproject.toml's extras); the base install is the car's
EXTRA_OF = {"onnx": "build", "onnxruntime": "build", "tinymesa": "build", "av": "replay", "matplotlib": "replay", "ray": "replay"}


def _missing_extra(e: ModuleNotFoundError) -> str | None:
  """One line for a tool whose optional dependency this install lacks (the car's base install), else None."""
  top = (e.name or "").split(".")[0]
  if (extra := EXTRA_OF.get(top)) is None:
    return None
  return f"this needs {top}, which comes with the [{extra}] extra: pip install 'modeld-msm[{extra}]' (the car's base install leaves it out)"


def _no_device(e: RuntimeError) -> str | None:
  """tinygrad's word when every backend failed to open: on a full disk or under a file-size limit its caches cannot be written."""
  if str(e) != "no usable devices":
    return None
  return ("tinygrad could open no device (each backend failed to start; a full disk or a file-size limit stops its caches too); "
          "free space, or check the device with `modeld-msm doctor`")


def _load(name: str):
  return importlib.import_module(f"cli.commands.{name.replace('-', '_')}")


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  stop_on_sigterm()   # a command stopped by SIGTERM cleans up as on Ctrl-C (serve's loop takes both signals over)
  parser = argparse.ArgumentParser(prog="modeld-msm", description="openpilot modeld on vamOS (MSM DRM) and off the car (CPU)")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")
  # only the chosen command's module is imported; others are listed from HELP
  chosen = next((a for a in argv if not a.startswith("-")), None)
  for name in COMMANDS:
    p = sub.add_parser(name, help=HELP[name], description=HELP[name])
    if name == chosen:
      try:
        mod = _load(name)
      except KeyboardInterrupt:
        # SIGINT while the command's modules load: for serve, openpilot's manager stopping it during start-up, a clean stop
        return 0 if name in ("serve", "serve-dm") else 130
      except ModuleNotFoundError as e:
        if e.name and e.name.startswith("cli.commands"):
          print(f"modeld-msm: error: command '{name}' is not available in this build", file=sys.stderr)
          return 2
        if (line := _missing_extra(e)) is not None:
          print(f"modeld-msm {name}: error: {line}", file=sys.stderr)
          return 2
        raise
      except RuntimeError as e:   # tinygrad picks its default device at import (tinygrad.nn.onnx builds tensors then)
        if (line := _no_device(e)) is None:
          raise
        print(f"modeld-msm {name}: error: {line}", file=sys.stderr)
        return 2
      mod.add_arguments(p)
      p.set_defaults(_run=mod.run)
  args = parser.parse_args(argv)
  if not getattr(args, "_run", None):
    parser.print_help()
    return 2
  try:
    return int(args._run(args) or 0)
  except UserError as e:
    print(f"modeld-msm {args.command}: error: {e}", file=sys.stderr)
    return e.exit_code
  except ModuleNotFoundError as e:
    if (line := _missing_extra(e)) is None:
      raise
    print(f"modeld-msm {args.command}: error: {line}", file=sys.stderr)
    return 2
  except BrokenPipeError:
    # the reader went away (`modeld-msm verify X | head`): stop quietly, as other command-line tools do, and keep Python's
    # flush at exit from raising the same error again
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141
  except OSError as e:
    # the one place a read-only or full output, or a file where a folder should be, becomes a line instead of a traceback
    if (line := describe_os_error(e)) is None:
      raise
    print(f"modeld-msm {args.command}: error: {line}", file=sys.stderr)
    return 2
  except RuntimeError as e:
    if (line := _no_device(e)) is None:
      raise
    print(f"modeld-msm {args.command}: error: {line}", file=sys.stderr)
    return 2
  except Terminated:
    return 143   # 128 + SIGTERM, as a shell reports it
  except KeyboardInterrupt:
    return 130


if __name__ == "__main__":
  sys.exit(main())
