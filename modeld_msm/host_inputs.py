"""The driving programs' host inputs: the arrays the captured JITs read on every call, written in place by the caller."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor

from modeld_msm.constants import DESIRE_LEN, TRAFFIC_CONVENTION_LEN


@dataclass
class HostInputs:
  """float32 numpy arrays the JIT reads live through NPY tensors (written in place by the caller every frame)."""
  desire: np.ndarray
  traffic_convention: np.ndarray
  tfm: np.ndarray
  big_tfm: np.ndarray

  @staticmethod
  def zeros() -> HostInputs:
    z = np.zeros
    return HostInputs(z(DESIRE_LEN, np.float32), z((1, TRAFFIC_CONVENTION_LEN), np.float32), z((3, 3), np.float32), z((3, 3), np.float32))

  def tensors(self) -> dict[str, Tensor]:
    # NPY tensors alias the numpy memory, so the captured JIT copies their current contents in on every call
    return {k: Tensor(getattr(self, k), device="NPY") for k in ("desire", "traffic_convention", "tfm", "big_tfm")}


def dm_host_inputs() -> tuple[dict[str, np.ndarray], dict[str, Tensor]]:
  """The driver-monitoring program's host inputs: the warp matrix (3, 3) and calib (1, 3), float32 arrays and the NPY
  tensors over them that the JIT reads on every call."""
  host = {"m_inv": np.zeros((3, 3), np.float32), "calib": np.zeros((1, 3), np.float32)}
  return host, {k: Tensor(v, device="NPY") for k, v in host.items()}
