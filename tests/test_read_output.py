"""artifact.load.read_output: a program's outputs read straight out of their device buffers (modeld's per-frame read) give
exactly what Tensor.numpy() gives, frame after frame, and any view it cannot read whole falls back to numpy()."""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes

from artifact.load import read_output


def test_jit_outputs_read_as_numpy_reads_them():
  @TinyJit
  def step(x: Tensor, k: Tensor):
    return (x * k + 1).realize(), (x - k).cast(dtypes.half).reshape(4, -1).realize()

  rng = np.random.default_rng(0)
  k = Tensor([2.0]).realize()
  for i in range(6):   # the JIT captures on the second call; later calls reuse its buffers with new values
    x = Tensor(rng.standard_normal((1, 6500)).astype(np.float32)).realize()
    a, b = step(x, k)
    ra, rb = read_output(a), read_output(b)
    assert ra.dtype == np.float32 and rb.dtype == np.float16 and ra.shape == (6500,) and rb.shape == (6500,)
    assert np.array_equal(ra, a.numpy().reshape(-1)) and np.array_equal(rb, b.numpy().reshape(-1)), i
    assert not np.shares_memory(ra, read_output(a))   # a fresh array each call: last frame's outputs stay as they were


def test_views_fall_back_to_numpy():
  y = Tensor(np.arange(32, dtype=np.float32).reshape(4, 8)).realize()
  for view in (y.T, y[1:3], y.reshape(8, 4).permute(1, 0)):
    assert np.array_equal(read_output(view), view.numpy().reshape(-1))
