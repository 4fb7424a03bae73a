"""The cereal schema modeld speaks: openpilot's own when it is importable (on a device), else the copy in ./cereal.

MODELD_CEREAL=own forces our schema, MODELD_CEREAL=openpilot insists on openpilot's (ImportError if absent).
Our schema is wire-compatible with openpilot 0.11 (see cereal/log.capnp's header), so either choice talks to openpilot;
using openpilot's own keeps fields newer than ours visible."""
from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import capnp

from selfdrive_glue.errors import UserError

SCHEMA_DIR = Path(__file__).resolve().parent / "cereal"


def _openpilot_cereal() -> tuple[ModuleType, ModuleType] | None:
  try:
    from cereal import car, log  # type: ignore[import-not-found]  # openpilot's package, present on a device
  except Exception:
    return None
  return (log, car) if hasattr(log, "Event") and hasattr(car, "CarParams") else None


def _own_cereal() -> tuple[ModuleType, ModuleType]:
  capnp.remove_import_hook()
  return capnp.load(str(SCHEMA_DIR / "log.capnp")), capnp.load(str(SCHEMA_DIR / "car.capnp"))


def load() -> tuple[ModuleType, ModuleType, str]:
  """-> (log, car, source) where source is 'openpilot' or 'modeld-msm'."""
  choice = os.environ.get("MODELD_CEREAL", "auto")
  if choice not in ("auto", "own", "openpilot"):
    raise UserError(f"MODELD_CEREAL={choice!r} is not valid; use auto, own or openpilot")
  if choice != "own":
    op = _openpilot_cereal()
    if op is not None:
      return op[0], op[1], "openpilot"
    if choice == "openpilot":
      raise ImportError("MODELD_CEREAL=openpilot but openpilot's cereal package is not importable; put openpilot on PYTHONPATH")
  log, car = _own_cereal()
  return log, car, "modeld-msm"


log, car, SOURCE = load()
