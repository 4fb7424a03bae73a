"""Which kernel went wrong: tinygrad's own per-kernel CPU validation (VALIDATE_WITH_CPU runs every kernel's AST on the
CPU beside the device and compares its outputs) applied to work on the executing emulator, with the emulator naming the
kernel that was running when the comparison failed."""
from __future__ import annotations

from collections.abc import Callable


def first_divergent_kernel(run: Callable[[], object], node) -> str | None:
  """Runs `run` (unjitted tinygrad work on the EMU device, level B) with per-kernel CPU validation. Returns a line naming
  the first kernel whose output differs from the same kernel on the CPU (tinygrad's bound: rtol = atol = 1e-3), or None."""
  from tinygrad.helpers import Context
  try:
    with Context(VALIDATE_WITH_CPU=1):
      run()
  except AssertionError as e:
    name = node.counts[-1][0] if node.counts else "<unknown>"
    detail = next((ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("Mismatched")), "outputs differ")
    return f"first kernel whose output diverged from the CPU: {name} ({detail})"
  return None
