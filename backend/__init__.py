"""tinygrad QCOM kernel interfaces: KGSL (upstream), MSM (mainline drm/msm) and EMU (emulated render node).

Call `install()` before the first `Device["QCOM"]` and before any `pickle.load` of a QCOM TinyJit.
"""
from __future__ import annotations

import importlib.metadata

TINYGRAD_VERSION = "0.14.0"
_installed = False


def check_tinygrad() -> str:
  """The installed tinygrad version; a clear error unless it is the one whose QCOM internals this package extends."""
  try:
    v = importlib.metadata.version("tinygrad")
  except importlib.metadata.PackageNotFoundError as e:
    raise RuntimeError(f"tinygrad is not installed; install tinygrad=={TINYGRAD_VERSION}") from e
  if v != TINYGRAD_VERSION:
    raise RuntimeError(f"backend needs tinygrad=={TINYGRAD_VERSION} (it subclasses its QCOM runtime), found {v}; "
                       f"pip install tinygrad=={TINYGRAD_VERSION}")
  return v


def install() -> None:
  """Registers the KGSL/MSM/EMU interfaces under tinygrad's QCOM device. Idempotent."""
  global _installed
  if _installed:
    return
  check_tinygrad()
  from tinygrad.device import Device
  from tinygrad.runtime import ops_qcom

  if any(d.split(":")[0] == "QCOM" for d in Device._opened_devices):
    raise RuntimeError("backend.install() ran after Device['QCOM'] was opened; call it first (before any QCOM tensor or pickle.load)")
  from backend import patched
  if patched.is_patched(ops_qcom):   # the upstream/ series is applied: tinygrad's own driver runs msm, we add only the emulated node
    patched.install(ops_qcom)
  else:
    from backend.qcom import QCOMDevice
    ops_qcom.QCOMDevice = QCOMDevice  # type: ignore[misc]
  Device.get_class.cache_clear()   # a lookup made before install() (nothing opened) must not keep upstream's class
  from backend import local_size
  local_size.install()   # acts only on the emulated node's kernels: wave-filling local sizes for QCOM captures
  _installed = True


def set_kernel_costs(costs: dict[str, float]) -> None:
  """Estimated a630 microseconds per kernel name, so bound graphs are cut into submits by time (backend/chunking.py)."""
  from backend import chunking
  chunking.set_kernel_costs(costs)


__all__ = ["TINYGRAD_VERSION", "check_tinygrad", "install", "set_kernel_costs"]
