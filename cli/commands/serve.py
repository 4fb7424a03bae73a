"""`modeld-msm serve`: run as openpilot's modeld process.

The one set of options and the one code path of the modeld process: `python -m modeld_msm.modeld` (what the launcher
`modeld-msm install` writes execs, with no arguments) takes the same options and runs the same run, so an option tried
with `serve` on a desk means the same on the car.
"""
from modeld_msm.modeld import add_arguments, run

__all__ = ["add_arguments", "run"]
