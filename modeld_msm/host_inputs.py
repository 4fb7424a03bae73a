"""0.11's driving program's host inputs as attributes, for tools and tests that call its JITs directly (the processes take them
from the artifact's recorded specs: modeld_msm/named_program.py)."""
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

