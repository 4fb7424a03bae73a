"""What a compile reports: each check with its result, and the time each phase took."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CompileReport:
  out_dir: Path
  timings: dict[str, float] = field(default_factory=dict)
  checks: list[tuple[str, str, str]] = field(default_factory=list)  # (check, result, detail)

  def table(self) -> str:
    w = max(len(c) for c, _, _ in self.checks)
    lines = [f"{'check':{w}s}  result  detail", "-" * (w + 40)]
    lines += [f"{c:{w}s}  {r:6s}  {d}" for c, r, d in self.checks]
    lines.append("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items()))
    return "\n".join(lines)
