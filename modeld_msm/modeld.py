"""The modeld process: VisionIPC frames + cereal messages in, modelV2 / drivingModelData / cameraOdometry out.

Reads like openpilot's selfdrive/modeld/modeld.py, split where a second model process shares the work: this file says
what the driving model is (its services, its realtime slot, which cameras it reads, its car parameters);
modeld_msm/runner.py is the process loop (streams, pairing, SubMaster/PubMaster, realtime, clean exit); the step
itself is modeld_msm/core.py. Run by openpilot's manager as `python -m modeld_msm.modeld`, through the launcher
`modeld-msm install` writes (release/install.py), or as `modeld-msm serve`.
"""
from __future__ import annotations

import signal
import sys

if __name__ == "__main__":
  # openpilot's manager stops modeld with SIGINT, also while it starts: during the imports below that is a clean stop
  # (runner.serve takes SIGINT over once it runs)
  signal.signal(signal.SIGINT, lambda *_: sys.exit(0))

import argparse  # noqa: E402
import logging  # noqa: E402

from artifact.format import VerifiedArtifact  # noqa: E402
from modeld_msm import runner  # noqa: E402
from modeld_msm.core import PUBLISHED, SUBSCRIBED, ModeldCore  # noqa: E402
from selfdrive_glue import messaging  # noqa: E402
from selfdrive_glue.capnp_check import check_pointers  # noqa: E402
from selfdrive_glue.errors import UserError  # noqa: E402
from selfdrive_glue.params import Params  # noqa: E402
from selfdrive_glue.visionipc import VisionStreamType  # noqa: E402

log = logging.getLogger("modeld")
RT_CORE, RT_PRIORITY = 7, 54   # openpilot's process_config for modeld


def choose_streams(available: set[int]) -> runner.StreamChoice | None:
  """main = road (or wide when road is absent), extra = wide when both exist; as openpilot's modeld."""
  if not available:
    return None
  road, wide = VisionStreamType.ROAD in available, VisionStreamType.WIDE_ROAD in available
  if not road and not wide:
    return None
  return runner.StreamChoice(VisionStreamType.ROAD if road else VisionStreamType.WIDE_ROAD,
                             VisionStreamType.WIDE_ROAD if road and wide else None, main_wide=not road)


def _car_params_from(data: bytes):
  check_pointers(data)   # as_builder() on an out-of-bounds pointer aborts the process instead of raising
  with messaging.car.CarParams.from_bytes(data) as cp:
    return cp.as_builder().as_reader()


def load_car_params(path: str | None, use_params: bool = True):
  """CarParams from --car-params FILE, else openpilot's Params, else None (demo defaults)."""
  if path:
    try:
      with open(path, "rb") as f:
        return _car_params_from(f.read())
    except FileNotFoundError:
      raise UserError(f"car params file not found: {path}") from None
    except Exception as e:
      raise UserError(f"{path} is not serialized car.CarParams bytes ({type(e).__name__}); pass the Params file CarParams") from None
  if not use_params:
    return None
  stored = Params().get("CarParams")
  if stored:
    try:
      return _car_params_from(stored)
    except Exception as e:
      log.error("Params CarParams unreadable (%s); using demo defaults", e)
  return None


def process(car_params=None) -> runner.ModelProcess:
  def make_core(art: VerifiedArtifact) -> ModeldCore:
    return ModeldCore(art, car_params=car_params)
  return runner.ModelProcess("modeld", SUBSCRIBED, PUBLISHED, RT_CORE, RT_PRIORITY, choose_streams, make_core, gpu_turn="lead")


def add_arguments(p: argparse.ArgumentParser) -> None:
  runner.add_arguments(p)
  add_driving_arguments(p)


def add_driving_arguments(p: argparse.ArgumentParser) -> None:
  params = p.add_mutually_exclusive_group()
  params.add_argument("--car-params", help="serialized car.CarParams file (default: openpilot's Params, else demo defaults)")
  params.add_argument("--demo", action="store_true", help="ignore openpilot's Params and use demo car params")


def run(args: argparse.Namespace) -> int:
  try:
    opts = runner.options(args)
    return runner.serve(process(load_car_params(None if args.demo else args.car_params, use_params=not args.demo)), opts)
  except KeyboardInterrupt:
    # SIGINT before serve() took it over, or while waiting for camerad: openpilot's manager stopping us, a clean stop
    return 0


def main(argv: list[str] | None = None) -> int:
  return runner.main(process(), argv, add_driving_arguments, run, "run as openpilot's modeld process")


if __name__ == "__main__":
  raise SystemExit(main())
