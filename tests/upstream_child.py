"""Child program of tests/test_upstream_patch.py: one run on the emulated a630 (DEV=EMU+QCOM:IR3, EMU_EXEC=1) through whichever
QCOM driver `backend.install()` finds, writing every result to an .npz so two runs can be compared bit for bit.

  python tests/upstream_child.py ops OUT.npz         tinygrad-style ops and the backend tests' core cases
  python tests/upstream_child.py artifact DIR OUT.npz  a QCOM artifact's steps through ModelState

The first line printed names the driver: `driver <QCOMDevice's module> <interface class> <its bases' modules>`.
"""
from __future__ import annotations

import gc
import pickle
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import backend  # noqa: E402

backend.install()
from tinygrad import Device, Tensor, TinyJit, dtypes  # noqa: E402


def driver_line(dev) -> str:
  it = type(dev.iface)
  return f"driver {type(dev).__module__} {it.__name__} {','.join(b.__module__ for b in it.__mro__[1:-1])}"


def _rng(i: int, *shape: int) -> np.ndarray:
  return np.random.default_rng(i).standard_normal(shape).astype(np.float32)


def ops() -> dict[str, np.ndarray]:
  """A sample of test_ops' cases, small shapes, fixed inputs."""
  x, y, m = _rng(1, 4, 33), _rng(2, 4, 33), _rng(3, 33, 9)
  img, w, w2 = _rng(4, 1, 4, 9, 9), _rng(5, 8, 4, 3, 3), _rng(6, 6, 8, 1, 1)
  ints = np.random.default_rng(7).integers(-1000, 1000, (5, 16), dtype=np.int32)
  t = lambda a: Tensor(a, device="QCOM")  # noqa: E731
  cases = {
    "add": lambda: t(x) + t(y), "mul_bcast": lambda: t(x) * t(y[:1]), "sub_div": lambda: (t(x) - t(y)) / (t(y).abs() + 1),
    "exp": lambda: t(x).exp(), "log": lambda: (t(x).abs() + 0.1).log(), "sqrt": lambda: t(x).abs().sqrt(), "sigmoid": lambda: t(x).sigmoid(),
    "tanh": lambda: t(x).tanh(), "relu_max": lambda: t(x).relu().maximum(t(y)), "where": lambda: (t(x) < t(y)).where(t(x), t(y) * 2),
    "sum_axis": lambda: t(x).sum(axis=1), "max_axis": lambda: t(x).max(axis=0), "mean": lambda: t(x).mean(), "softmax": lambda: t(x).softmax(),
    "argmax": lambda: t(x).argmax(axis=1), "cumsum": lambda: t(x[:, :16]).cumsum(axis=1), "matmul": lambda: t(x) @ t(m),
    "conv2d": lambda: t(img).conv2d(t(w), padding=1), "conv2d_s2": lambda: t(img).conv2d(t(w), stride=2).relu().conv2d(t(w2)),
    "avg_pool": lambda: t(img).avg_pool2d(), "max_pool": lambda: t(img).max_pool2d(), "half": lambda: (t(x).cast(dtypes.half) * 3).cast(dtypes.float),
    "int_ops": lambda: (t(ints) * 7 + 3) // 5 - t(ints) % 13, "gather": lambda: t(x)[:, t(np.array([3, 1, 30, 0], np.int32))],
    "pad_permute_flip": lambda: t(img).pad((1, 2, 0, 1)).permute(0, 2, 3, 1).flip(1).contiguous(),
  }
  return {k: f().numpy() for k, f in cases.items()}


def core_cases(out: dict[str, np.ndarray]) -> None:
  """The backend tests' core cases, by what they compute: elementwise, a JIT graph replayed with new inputs (bound queues
  patched in place), a pickled JIT replayed, a buffer freed while its job is in flight."""
  dev = Device["QCOM"]
  ws = [Tensor(_rng(10 + i, 4, 4, 3, 3), device="QCOM").realize() for i in range(3)]

  @TinyJit
  def f(a):
    for w in ws:
      a = a.conv2d(w, padding=1).relu()
    return a * 2
  for i in range(4):
    out[f"jit_{i}"] = f(Tensor(_rng(20 + i, 1, 4, 8, 8), device="QCOM").realize()).numpy()
  g = pickle.loads(pickle.dumps(f))
  out["jit_pickled"] = g(Tensor(_rng(30, 1, 4, 8, 8), device="QCOM").realize()).numpy()
  a = Tensor(_rng(40, 256), device="QCOM").realize()
  b = (a * 3 + 1).realize()
  del a
  gc.collect()
  out["after_free"] = (b + 1).numpy()
  dev.synchronize()
  node = dev.iface.node
  # every buffer the GPU was given is written through its CPU mapping: no IOVA is a CPU address here (the node keeps
  # the IOVA window PROT_NONE, so a write through one would have crashed the run)
  out["stats"] = np.array([len(node.stats.faults), node.stats.submits > 0, node.stats.dispatches > 0])


def artifact(path: Path) -> dict[str, np.ndarray]:
  import os

  from modeld_msm.model_state import ModelState
  from selfdrive_glue.nv12 import nv12_info
  os.environ.setdefault("MODELD_DEV", "EMU+QCOM:IR3")
  info = nv12_info(1928, 1208)
  rng = np.random.default_rng(3)
  frames = [rng.integers(0, 256, info.size, dtype=np.uint8) for _ in range(3)]
  tfm = np.array([[2.9, 0.0, 219.0], [0.0, 2.9, 465.0], [0.0, 0.0, 1.0]], np.float32)
  big = np.array([[1.25, 0.0, 645.0], [0.0, 1.25, 415.0], [0.0, 0.0, 1.0]], np.float32)
  ms = ModelState(path)
  out = {}
  for i, kind in enumerate("PWP"):
    _, raw = ms.run(frames[i % 3], frames[(i + 1) % 3], tfm, big, np.eye(8, dtype=np.float32)[i], np.array([[1, 0]], np.float32), kind == "W")
    if kind == "P":
      out[f"step_{i}"] = raw.copy()
  dev = Device["QCOM"]
  print(driver_line(dev), flush=True)
  node = dev.iface.node
  out["faults"] = np.array([len(node.stats.faults), node.execute and node.stats.dispatches > 0])
  return out


def main(argv: list[str]) -> int:
  if argv[0] == "ops":
    dev = Device["QCOM"]
    print(driver_line(dev), flush=True)
    res = ops()
    core_cases(res)
    np.savez(argv[1], **res)
  else:
    np.savez(argv[2], **artifact(Path(argv[1])))
  print("DONE", "backend.qcom" in sys.modules, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
