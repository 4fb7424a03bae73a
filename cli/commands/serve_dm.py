"""`modeld-msm serve-dm`: run as openpilot's dmonitoringmodeld process (the options and code of
`python -m modeld_msm.dmonitoringmodeld`, which the launcher `modeld-msm install` writes execs)."""
from modeld_msm.dmonitoringmodeld import add_arguments, run

__all__ = ["add_arguments", "run"]
