"""What a compile needs of each model kind beyond its data (artifact/kinds.py): how its program is built, the seeded inputs of
its step plan, its rows of the report and its part of the metadata. One module per kind, named as the kind: the compile
driver (compile/build.py) imports `compile.programs.<kind>` and runs its `Recipe`."""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from artifact.kinds import Kind
from selfdrive_glue.errors import UserError


def recipe_of(kind: Kind) -> Any:
  return importlib.import_module(f"compile.programs.{kind.name}").Recipe(kind)


def check_signature(fn: Any, names: list[str], what: str) -> None:
  """A program's method takes its inputs in the order the kind's spec lists them (that order is the artifact's record of
  the captured arguments): refuse a drift between the two before anything is captured."""
  params = [p for p in inspect.signature(fn).parameters if p != "self"]
  if params != names:
    raise UserError(f"internal error: {what} takes ({', '.join(params)}), the kind's spec lists ({', '.join(names)}); please report it")
