"""The code and the docs cite only what is in the repository.

A reader of a comment, a docstring or a page under docs/ must be able to open what it points at:
a file of this repository, not a document, issue tracker or directory outside it. Paths named
in docs/ and README.md must exist (a renamed module leaves a dangling pointer otherwise).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Pointers outside the repository: the product brief and architecture notes kept beside the
# checkout, and issue numbers of a tracker the repository does not carry.
OUTSIDE = re.compile(r"PRODUCT\.md|(?<![\w/])ARCHITECTURE\.md|\.\./shared/|\b[Ii]ssues? #?\d+\b")

# A path in backticks: at least one "/" and a file suffix, optionally followed by ":LINE[-LINE]".
CITED_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh|toml|[15]))(?::[\d-]+)?`")


def _texts() -> list[Path]:
    return sorted([*(ROOT / "ckptctl").rglob("*.py"), *(ROOT / "docs").glob("*.md"),
                   ROOT / "README.md", *(ROOT / "man").glob("ckptctl*")])


def citations_outside(text: str) -> list[tuple[int, str]]:
    """(line, the matched text) for every pointer outside the repository in ``text``."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1)
            for m in OUTSIDE.finditer(line)]


def test_code_and_docs_cite_nothing_outside_the_repository() -> None:
    bad = [f"{path.relative_to(ROOT)}:{n}: {what!r}"
           for path in _texts() for n, what in citations_outside(path.read_text())]
    assert not bad, "pointers outside the repository (point at docs/ or man/ instead):\n" + "\n".join(bad)


def test_paths_named_in_docs_exist() -> None:
    missing = []
    for path in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for cited in CITED_PATH.findall(line):
                if not ((ROOT / cited).exists() or (ROOT / "ckptctl" / cited).exists()):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {cited}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_checks_catch_what_they_should() -> None:
    assert [w for _, w in citations_outside("see PRODUCT.md and issue 4\nfine: man/ckptctl.1")] \
        == ["PRODUCT.md", "issue 4"]
    assert citations_outside("`docs/protocol.md`, `docs/architecture.md`, step 4, page 2") == []
    assert [w for _, w in citations_outside("../shared/ARCHITECTURE.md; Issue #12")] \
        == ["../shared/", "Issue #12"]
    assert CITED_PATH.findall("`ckptctl/ops/transform/reshard.py:63-66` and `save/saver.py`, not `x`") \
        == ["ckptctl/ops/transform/reshard.py", "save/saver.py"]
