"""The car's model processes (modeld, dmonitoringmodeld) and their per-frame steps."""
import signal
import sys

if sys.argv[:1] == ["-m"]:
  # `python -m modeld_msm.<process>` (how the manager's launcher starts both processes): while Python still looks for the
  # module, sys.argv[0] is "-m", and this package is imported first. openpilot's manager may stop the process with SIGINT
  # at any time, also now: from here on that is a clean stop (exit 0), not a KeyboardInterrupt out of runpy (exit 1).
  # The process module installs the same handler again, and runner.serve takes SIGINT over once it runs.
  signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
