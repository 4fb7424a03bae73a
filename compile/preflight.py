"""Checks `compile` runs before the heavy work: can the device be opened here, and will both runtimes take the models.

Each failure is one UserError naming what is wrong, instead of a traceback from deep inside tinygrad or onnxruntime
that would come only after the models were loaded and run (tens of seconds for the full-size ones).
"""
from __future__ import annotations

import ctypes
import re
from typing import Any

from compile.onnx_model import OnnxModelInfo
from selfdrive_glue.errors import UserError

# tinygrad 0.14's LLVM renderer (renderer/llvmir.py) writes typed-pointer IR but loads and stores vectors through scalar
# pointers without a bitcast (`store <4 x float> %v, <4 x float>* %p` with %p a `float*`): only an LLVM whose pointers are
# opaque accepts that. LLVM 14 and 15 parse the IR in typed-pointer mode and reject it; 16 and 19 compile it (checked on
# Debian 12's libllvm16 and libllvm19). LLVMGetVersion, the C API's own version query, arrived in the same release.
LLVM_MIN = 16
GPU_DEVICES = {"CUDA": "an NVIDIA GPU and CUDA", "NV": "an NVIDIA GPU and its driver", "AMD": "an AMD GPU and its driver"}


def check_device(device: str) -> None:
  """Refuse a compile target this machine cannot run, before any model is read. QCOM is captured on the emulated render
  node, which needs Mesa's IR3 compiler (tinymesa, x86_64 only); the plain CPU is always there."""
  if device == "CPU:LLVM":
    check_llvm()
  elif device == "QCOM":
    # ops_qcom loads Mesa's library as it is imported
    from backend.qcom import NO_IR3_COMPILER, ir3_compiler_present
    if not ir3_compiler_present():
      raise UserError(NO_IR3_COMPILER)
  elif device in GPU_DEVICES:
    from tinygrad import Device
    try:
      Device[device]
    except Exception as e:   # tinygrad tries each interface (NV: nvidiactl, PCI, USB) and raises a group of their failures
      raise UserError(f"no {device} device here ({_why(e)}); compile for {device} on a machine with {GPU_DEVICES[device]}, "
                      "or use --device CPU") from None


def llvm_library() -> tuple[str | None, int | None]:
  """(path, major version) of the libLLVM tinygrad loads for CPU:LLVM (the newest it finds, or $LLVM_PATH); None, None
  when it finds none; version None when it cannot tell (then older than LLVM_MIN, which has LLVMGetVersion)."""
  from tinygrad.runtime.autogen import llvm
  path = llvm.dll.__dict__.get("_name")   # set by ctypes only when the library loaded
  if path is None:
    return None, None
  try:
    get_version = ctypes.CDLL.__getitem__(llvm.dll, "LLVMGetVersion")
  except AttributeError:
    m = re.search(r"LLVM-(\d+)|LLVM\.so\.(\d+)", str(path))
    return str(path), int(next(g for g in m.groups() if g)) if m else None
  major, minor, patch = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
  get_version.restype, get_version.argtypes = None, [ctypes.POINTER(ctypes.c_uint)] * 3
  get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
  return str(path), major.value


def check_llvm() -> None:
  path, major = llvm_library()
  fix = f"install libllvm{LLVM_MIN} or newer (Debian 12: apt-get install libllvm19) or point LLVM_PATH at one, or use --device CPU"
  if path is None:
    raise UserError(f"--device CPU:LLVM needs libLLVM >= {LLVM_MIN} and tinygrad finds none here; {fix}")
  if major is None or major < LLVM_MIN:
    have = f"libLLVM {major}" if major is not None else f"a libLLVM older than {LLVM_MIN}"
    raise UserError(f"tinygrad 0.14's LLVM renderer needs LLVM >= {LLVM_MIN}; this box has {have} ({path}): {fix}")


def ort_session(info: OnnxModelInfo) -> Any:
  """The onnxruntime session the compile checks tinygrad against, opened now: onnxruntime's own model checks (type
  constraints, initializer sizes) refuse some files onnx.checker lets through."""
  import numpy as np
  import onnxruntime as ort
  quiet = ort.SessionOptions()
  quiet.log_severity_level = 4   # onnxruntime logs its failures to stderr as well: the one line below says it
  run_quiet = ort.RunOptions()
  run_quiet.log_severity_level = 4
  try:
    sess = ort.InferenceSession(str(info.path), quiet, providers=["CPUExecutionProvider"])
    # and one run on zeros: a shape constant that no longer fits its tensor (a flipped bit in a Reshape's target) only shows
    # when the graph runs, which the compile would otherwise first do after tinygrad has loaded both models
    sess.run(None, {k: np.zeros(s, np.dtype(info.input_dtypes[k])) for k, s in info.input_shapes.items()}, run_quiet)
  except Exception as e:
    why = " ".join(str(e).split()).split("failed:", 1)[-1]
    # onnxruntime's messages carry its source paths and C++ signatures: what is left says which node and why
    why = re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : |/onnxruntime_src/\S+|onnxruntime::[\w:]+\([^)]*\)", "", why)
    why = " ".join(why.split())[:300] or type(e).__name__
    raise UserError(f"{info.kind} model {info.path} is refused by onnxruntime ({why}); the file is damaged or was edited: "
                    "re-download or regenerate it") from None
  return sess


def tinygrad_parse(info: OnnxModelInfo) -> None:
  """tinygrad reads the file with a protobuf parser of its own, stricter than onnx's about wire types and UTF-8: parse it
  once the same way before the program is built. Run it after the target device is chosen: the parsed tensors are moved
  to the default device."""
  from tinygrad.nn.onnx import OnnxPBParser
  try:
    OnnxPBParser(info.path, load_external_data=False).parse()
  except Exception as e:
    raise UserError(f"{info.kind} model {info.path} cannot be read by tinygrad's ONNX parser ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200] if str(e) else ''}); the file is damaged: re-download or regenerate it") from None


def _why(e: BaseException) -> str:
  if isinstance(e, BaseExceptionGroup):
    return "; ".join(dict.fromkeys(_why(x) for x in e.exceptions))
  text = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
  return text
