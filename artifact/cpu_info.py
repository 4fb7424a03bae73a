"""What this CPU is: its model and the ISA extensions the CPU device's code may use. A CPU artifact is compiled for the build
machine's own CPU (tinygrad's -march=native), so its record travels in the metadata and verify compares it with the CPU
that loads it; benchmarks and the demo print it beside their numbers; kernel search sets are keyed by its ISA level.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

# /proc/cpuinfo flags that mean the CPU computes fp16 natively (x86: AVX512-FP16, which Linux spells avx512_fp16; arm64:
# FEAT_FP16 as asimdhp/fphp)
NATIVE_FP16_FLAGS = {"avx512_fp16", "asimdhp", "fphp"}
# shown beside benchmarks: what decides the speed of the CPU artifact
REPORTED_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                  "amx_fp16", "neon", "asimd", "asimdhp", "fphp")
# the vector ISA levels the CPU artifact's kernels are built for (tinygrad compiles with -march=native; our pointwise kernel picks
# its tile by the same macros): kernel search sets are recorded per level, since the best opts differ between them
ISA_LEVELS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma"}, "neon": {"asimd"}}


@dataclass(frozen=True)
class CpuInfo:
  model: str
  flags: frozenset[str]
  cores: int

  @property
  def native_fp16(self) -> bool:
    return bool(self.flags & NATIVE_FP16_FLAGS)

  @property
  def isa(self) -> str:
    """avx512, avx2, neon, or base (SSE2 and nothing wider this project's kernels use)."""
    return next((name for name, need in ISA_LEVELS.items() if need <= self.flags), "base")

  def summary(self) -> str:
    shown = [f for f in REPORTED_FLAGS if f in self.flags]
    return (f"{self.model} ({self.cores} cores; ISA level {self.isa}; {' '.join(shown) or 'no SIMD flags found'}; "
            f"native fp16: {'yes' if self.native_fp16 else 'no'})")

  def as_dict(self) -> dict:
    """What benchmarks and the demo summary record beside their numbers."""
    return {"model": self.model, "cores": self.cores, "isa": self.isa, "flags": [f for f in REPORTED_FLAGS if f in self.flags]}


def cpu_info(cpuinfo: str | None = None) -> CpuInfo:
  text = cpuinfo if cpuinfo is not None else _read_cpuinfo()
  model: str | None = None
  flags: set[str] = set()
  for line in text.splitlines():
    key, _, value = line.partition(":")
    key = key.strip().lower()
    if key in ("model name", "hardware", "cpu model") and model is None:   # the first core's name stands for all
      model = value.strip()
    elif key in ("flags", "features"):
      flags.update(value.split())
  return CpuInfo(model or platform.machine() or "unknown CPU", frozenset(flags), os.cpu_count() or 1)


def _read_cpuinfo() -> str:
  try:
    return Path("/proc/cpuinfo").read_text()
  except OSError:
    return ""
