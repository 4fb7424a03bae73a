"""`modeld-msm release`: the release build's own options and run (release/build.py, also `python -m release.build`)."""
from release.build import add_arguments, run  # noqa: F401 (the command's interface)
