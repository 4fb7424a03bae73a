"""Small signal filters used by modeld."""
from __future__ import annotations


class FirstOrderFilter:
  """Discrete RC low-pass: x += k * (u - x) with k = (dt/rc) / (1 + dt/rc).

  `initialized=False` makes the first update jump straight to its input (no slow rise from x0).
  """

  def __init__(self, x0: float, rc: float, dt: float, initialized: bool = True):
    if dt <= 0:
      raise ValueError(f"dt must be positive, got {dt}")
    self.x = x0
    self.dt = dt
    self.initialized = initialized
    self.update_alpha(rc)

  def update_alpha(self, rc: float) -> None:
    if rc < 0:
      raise ValueError(f"time constant must be >= 0, got {rc}")
    self.k = (self.dt / rc) / (1. + self.dt / rc) if rc > 0 else 1.

  def update(self, x: float) -> float:
    if self.initialized:
      self.x = (1. - self.k) * self.x + self.k * x
    else:
      self.initialized = True
      self.x = x
    return self.x


class FrameDropFilter:
  """modeld's dropped-frame ratio: RC filter (tau 10 s at 20 Hz) on min(dropped, 10), held at 0 for 10 warm-up runs.

  The warm-up hides the burst of drops every process start sees while camerad and modeld find their pace.
  """
  TAU = 10.
  DT = 1. / 20
  CLIP = 10
  WARMUP_RUNS = 10

  def __init__(self):
    self.filter = FirstOrderFilter(0., self.TAU, self.DT)
    self.run_count = 0

  def update(self, dropped: int) -> float:
    """Feed this frame's dropped count; returns the ratio f/(1+f) that modelV2.frameDropPerc reports (x100)."""
    frames_dropped = self.filter.update(min(dropped, self.CLIP))
    if self.run_count < self.WARMUP_RUNS:
      self.filter.x = 0.
      frames_dropped = 0.
    self.run_count += 1
    return frames_dropped / (1 + frames_dropped)
