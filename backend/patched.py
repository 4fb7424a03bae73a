"""tinygrad with the upstream/ series applied: its own QCOM driver speaks KGSL and msm, so only the emulated node is ours.

`backend.install()` comes here instead of replacing `ops_qcom.QCOMDevice` when the installed driver already has an
`MSMIface` (upstream/patches/ applied). The emulated render node is put behind tinygrad's own MSMIface the same way
backend/msm.py puts it behind ours: a subclass whose node is a `backend.emu.RenderNode`, used only when asked for by name.
"""
from __future__ import annotations

import os
from types import ModuleType

from tinygrad.helpers import DEV, getenv


def is_patched(ops_qcom: ModuleType) -> bool:
  """Whether this tinygrad's QCOM driver carries the series (an msm kernel interface of its own)."""
  return hasattr(ops_qcom, "MSMIface") and hasattr(ops_qcom, "KGSLIface")


def emu_iface(ops_qcom: ModuleType) -> type:
  class EMUIface(ops_qcom.MSMIface):  # type: ignore[name-defined,misc]
    """tinygrad's MSMIface over the emulated render node. Only when asked for by name: a GPU-less box must not silently emulate."""

    def __init__(self, dev, device_id: int = 0):
      if DEV.target("QCOM").interface != "EMU":
        raise RuntimeError("the EMU interface is used only when asked for: DEV=EMU+QCOM:IR3")
      super().__init__(dev, device_id)

    def _open(self):
      from backend.emu import RenderNode
      return RenderNode(strict=bool(getenv("EMU_STRICT", 1)), execute=os.environ.get("EMU_EXEC", "0") not in ("", "0"))

    @property
    def node(self):
      return self.fd

  return EMUIface


def install(ops_qcom: ModuleType) -> None:
  """Adds the EMU interface after tinygrad's own (KGSL, then MSM); the driver itself is left as it is."""
  ifaces = [i for i in ops_qcom.QCOMDevice.ifaces if i.__name__ != "EMUIface"]
  ops_qcom.QCOMDevice.ifaces = [*ifaces, emu_iface(ops_qcom)]
