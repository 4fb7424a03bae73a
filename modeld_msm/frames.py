"""A camera frame as a step takes it, and the one rule that pairs a road frame with a wide one (serve and replay both use it).

openpilot's modeld pairs the two cameras on start-of-frame time: frames whose starts lie within 25 ms belong to the same
capture (the cameras run at 20 Hz, 50 ms apart, so a capture is never confused with the next one). Serve applies it to
VisionIPC receives (modeld_msm/runner.py), replay to logged camera states (offcar/replay.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAIR_WINDOW_NS = 25_000_000     # frames whose start-of-frame times are closer than this belong to the same capture
OUT_OF_SYNC_NS = 10_000_000     # paired, but further apart than this: openpilot logs "frames out of sync"


@dataclass
class Frame:
  buf: np.ndarray          # uint8, at least nv12_info(w, h).size bytes (VENUS layout)
  frame_id: int
  timestamp_sof: int
  timestamp_eof: int


def older_capture(a_sof: int, b_sof: int) -> bool:
  """Frame a belongs to a capture before b's: its start is more than the window before b's (a has no partner in b)."""
  return b_sof - a_sof > PAIR_WINDOW_NS


def still_paired_capture(main_sof: int, extra_sof: int) -> bool:
  """A newly received main frame still belongs to the capture of the extra frame paired last: openpilot's modeld reads
  main frames until one starts a full window after it (`sof < extra_sof + 25 ms`, strictly)."""
  return main_sof - extra_sof < PAIR_WINDOW_NS
