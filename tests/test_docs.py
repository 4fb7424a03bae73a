"""The documents hold together: every document the code, the tests or the README cite is in this repository, nothing
points outside it at notes a user does not have, and the README stays the user's short document."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 25_000
# a markdown file named in prose: `docs/gpu.md`, `backend/README.md`, or a bare `msm-kernel-rules.md` (a docs/ file)
CITED = re.compile(r"(?<![\w/.-])((?:\.\./)*(?:[\w.-]+/)*[\w.-]+\.md)\b")
# documents of other projects that our facts name as sources, not as files to open here
UPSTREAM = {"RELEASES.md", "models/README.md"}


def cited_in(path: Path) -> list[tuple[int, str]]:
  return [(n, m) for n, line in enumerate(path.read_text().splitlines(), 1) for m in CITED.findall(line)]


def citing_files() -> list[Path]:
  code = [p for pkg in ("artifact", "backend", "bench", "testing", "cli", "compile", "modeld_msm", "offcar", "release",
                        "selfdrive_glue", "tests") for p in sorted((ROOT / pkg).rglob("*.py"))]
  # this file is left out: its own docstrings and the pattern's self-test name documents on purpose
  return [ROOT / "README.md", ROOT / "backend" / "README.md", ROOT / "dev", ROOT / "pyproject.toml",
          *(p for p in code if p != Path(__file__).resolve())]


def resolves(name: str) -> bool:
  return any((ROOT / d / name).is_file() for d in ("", "docs"))


def test_every_cited_document_exists():
  missing = [f"{p.relative_to(ROOT)}:{n}: {name}" for p in citing_files() for n, name in cited_in(p)
             if not name.startswith("../") and name not in UPSTREAM and not resolves(name)]
  assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_nothing_cites_documents_outside_the_repository():
  outside = [f"{p.relative_to(ROOT)}:{n}: {name}" for p in citing_files() for n, name in cited_in(p) if name.startswith("../")]
  assert not outside, "cites a document outside the repository (write it in docs/ in our words):\n" + "\n".join(outside)


def test_docs_cite_docs_that_exist():
  """Between our documents, a `docs/x.md` reference must resolve (a document may still name the shared notes it restates)."""
  missing = [f"{p.relative_to(ROOT)}:{n}: {name}" for p in sorted((ROOT / "docs").glob("*.md")) for n, name in cited_in(p)
             if name.startswith("docs/") and not (ROOT / name).is_file()]
  assert not missing, "\n".join(missing)


def test_readme_is_the_users_document():
  text = (ROOT / "README.md").read_text()
  size = len(text.encode())
  assert size <= README_MAX_BYTES, f"README.md is {size} B; move detail to docs/ (limit {README_MAX_BYTES} B)"
  assert "./dev test" in text, "CI runs the suite through `./dev test`: the README must keep that exact command"
  worklog = [w for w in ("this session", "the session after", "last session", "issue ") if w in text.lower()]
  assert not worklog, f"the README speaks of the software, not of how it was worked on: {worklog}"


def test_the_citation_pattern_sees_what_it_must():
  """The checks above are only as good as the pattern: prove it finds each form of citation a file uses."""
  line = "see docs/gpu.md, `backend/README.md`, msm-kernel-rules.md §2 and ../shared/docs/anchors.md; not foo.mdx"
  assert CITED.findall(line) == ["docs/gpu.md", "backend/README.md", "msm-kernel-rules.md", "../shared/docs/anchors.md"]
