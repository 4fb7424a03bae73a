"""Layers point down: modeld_msm uses compile, backend and selfdrive_glue; compile uses backend and selfdrive_glue; backend
and selfdrive_glue use neither each other nor anything above. Read from the source (every import, also inside functions),
so a lazy import cannot hide an upward edge."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("backend", "selfdrive_glue", "compile", "modeld_msm", "release")
ALLOWED = {
  "backend": {"backend"},
  "selfdrive_glue": {"selfdrive_glue"},
  "compile": {"compile", "backend", "selfdrive_glue"},
}


def project_imports(path: Path) -> set[tuple[str, int]]:
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
    found |= {(n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in PACKAGES}
  return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_what_is_below_it(layer):
  upward = [f"{p.relative_to(ROOT)}:{line} imports {pkg}" for p in sorted((ROOT / layer).rglob("*.py"))
            for pkg, line in sorted(project_imports(p)) if pkg not in ALLOWED[layer]]
  assert not upward, "\n".join(upward)


def test_the_scan_sees_lazy_imports(tmp_path):
  f = tmp_path / "m.py"
  f.write_text("import os\ndef f():\n  from modeld_msm.constants import DT_MDL\n  import compile.build\n")
  assert project_imports(f) == {("modeld_msm", 3), ("compile", 4)}
