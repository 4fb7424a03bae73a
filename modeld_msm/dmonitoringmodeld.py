"""The dmonitoringmodeld process: the driver camera from VisionIPC + liveCalibration in, driverStateV2 out, every frame.

What the driver-monitoring model is, in the runner's terms (modeld_msm/runner.py has the loop, modeld_msm/dm_core.py the
step): its services, openpilot's realtime slot for it (core 7, SCHED_FIFO 5, below modeld's 54), the one stream it reads
(the driver camera: 0.11's VISION_STREAM_DRIVER, the id the newest master's VISION_STREAM_CABIN keeps), and its
artifact (compiled with `modeld-msm compile --dmonitoring`; in a bundle, dmonitoring/<w>x<h>/). Run by openpilot's manager
as `python -m modeld_msm.dmonitoringmodeld` (the launcher `install` writes), or as `modeld-msm serve-dm`.
"""
from __future__ import annotations

import signal
import sys

if __name__ == "__main__":
  # openpilot's manager stops it with SIGINT, also while it starts: during the imports below that is a clean stop
  signal.signal(signal.SIGINT, lambda *_: sys.exit(0))

import argparse  # noqa: E402

from artifact.format import VerifiedArtifact  # noqa: E402
from modeld_msm import runner  # noqa: E402
from modeld_msm.dm_core import PUBLISHED, SUBSCRIBED, DMonitoringCore  # noqa: E402
from selfdrive_glue.visionipc import VisionStreamType  # noqa: E402

RT_CORE, RT_PRIORITY = 7, 5   # openpilot's config_realtime_process for dmonitoringmodeld


def choose_streams(available: set[int]) -> runner.StreamChoice | None:
  if VisionStreamType.DRIVER not in available:
    return None
  return runner.StreamChoice(VisionStreamType.DRIVER, None, main_wide=False)


def process() -> runner.ModelProcess:
  def make_core(art: VerifiedArtifact) -> DMonitoringCore:
    return DMonitoringCore(art)
  return runner.ModelProcess("dmonitoringmodeld", SUBSCRIBED, PUBLISHED, RT_CORE, RT_PRIORITY, choose_streams, make_core,
                            gpu_turn="follow")


def add_arguments(p: argparse.ArgumentParser) -> None:
  runner.add_arguments(p)


def run(args: argparse.Namespace) -> int:
  try:
    return runner.serve(process(), runner.options(args))
  except KeyboardInterrupt:
    return 0   # SIGINT before serve() took it over, or while waiting for camerad: a clean stop


def main(argv: list[str] | None = None) -> int:
  return runner.main(process(), argv, lambda p: None, run, "run as openpilot's dmonitoringmodeld process")


if __name__ == "__main__":
  raise SystemExit(main())
