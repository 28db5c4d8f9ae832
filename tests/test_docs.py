"""The repository documents itself: nothing points outside it, and design references resolve.

Rules (docs/design.md):
- No tracked text file mentions a document that a clone does not contain: the design and
  research notes the project started from lived beside the repository, not in it. Cite
  docs/design.md (by section) or the public source instead.
- Every ``docs/design.md §N`` (or ``§N.M``) reference anywhere in the repository names a
  section that docs/design.md has (``## N. Title`` / ``### N.M Title``).
- Every repository path that docs/design.md names in backticks exists, so the map of the
  code cannot drift from the code silently.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"

FORBIDDEN = {
    "../shared": re.compile(r"\.\./shared"),
    "shared/DESIGN": re.compile(r"shared/DESIGN"),
    # case-sensitive: docs/design.md itself is fine
    "DESIGN.md": re.compile(r"DESIGN\.md"),
    "shared/research": re.compile(r"shared/research"),
    "research notes": re.compile(r"research notes", re.IGNORECASE),
    "a research file": re.compile(r"protocol-anchors|torch-elastic\.md", re.IGNORECASE),
    "the research doc": re.compile(r"research (?:doc\b|§|\"Pitfalls)", re.IGNORECASE),
}
"""Pointers to the design and research notes the project started from, which lived beside
the repository and are not in a clone of it."""
SELF = "tests/test_docs.py"

SECTION_REF = re.compile(r"design\.md(?:\]\([^)]*\)|\))?\s*§\s*(\d+(?:\.\d+)?)")
HEADING = re.compile(r"^(#{2,3})\s+(\d+(?:\.\d+)?)\.?\s", re.MULTILINE)
# `swim/probe.py`, `agent/serf/`, `tests/test_layering.py`, `swim/node.py` ``Node.join``...
PATH_IN_TICKS = re.compile(
    r"`((?:swim|phi|agent|torchhook|simulations|tests|bench|docs|examples|packaging|scripts)"
    r"/[A-Za-z0-9_./-]*)`"
)


def _tracked_text_files() -> list[tuple[str, str]]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    files: list[tuple[str, str]] = []
    for raw in listed:
        rel = raw.decode("utf-8", "surrogateescape")
        if not raw or rel == SELF:
            continue
        path = ROOT / rel
        if not path.is_file():
            continue  # deleted in the working tree, not yet committed
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        try:
            files.append((rel, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return files


def _sections() -> set[str]:
    return {m.group(2) for m in HEADING.finditer(DESIGN.read_text())}


def test_design_doc_has_its_sections() -> None:
    """Other modules cite these numbers; renumbering them breaks every citation."""
    assert {str(n) for n in range(1, 9)} <= _sections()


def test_nothing_points_outside_the_repository() -> None:
    offenders: list[str] = []
    for rel, text in _tracked_text_files():
        for lineno, line in enumerate(text.splitlines(), 1):
            offenders.extend(
                f"{rel}:{lineno}: {what}" for what, rx in FORBIDDEN.items() if rx.search(line)
            )
    assert offenders == [], "cite docs/design.md §N or the public source:\n" + "\n".join(offenders)


def test_design_references_name_existing_sections() -> None:
    sections = _sections()
    broken = []
    for rel, text in _tracked_text_files():
        for lineno, line in enumerate(text.splitlines(), 1):
            for match in SECTION_REF.finditer(line):
                if match.group(1) not in sections:
                    broken.append(f"{rel}:{lineno}: §{match.group(1)}")
    assert broken == [], f"docs/design.md has sections {sorted(sections)}:\n" + "\n".join(broken)


def test_paths_named_by_the_design_doc_exist() -> None:
    missing = sorted(
        {
            m.group(1)
            for m in PATH_IN_TICKS.finditer(DESIGN.read_text())
            if "*" not in m.group(1) and not (ROOT / m.group(1)).exists()
        }
    )
    assert missing == []


def test_the_checks_can_fail() -> None:
    """The patterns must catch what they are for, and only that."""
    line = 'see ../shared/DESIGN.md, the Research notes and research doc "Pitfalls" 7'

    def found(text: str) -> list[str]:
        return [what for what, rx in FORBIDDEN.items() if rx.search(text)]

    assert found(line) == [
        "../shared",
        "shared/DESIGN",
        "DESIGN.md",
        "research notes",
        "the research doc",
    ]
    assert found("research/protocol-anchors.md §4.2") == ["a research file"]
    assert found("docs/design.md §3; research on torch 2.13's c10d") == []
    refs = [m.group(1) for m in SECTION_REF.finditer("docs/design.md §3, [x](docs/design.md) §5.2")]
    assert refs == ["3", "5.2"]
    assert HEADING.findall("## 4. The path\n### 4.1 Socket\n#### 9 no\n") == [
        ("##", "4"),
        ("###", "4.1"),
    ]
