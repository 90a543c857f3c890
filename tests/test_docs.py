"""README.md and docs/*.md render as written: every code block closes, and every relative link resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def outside_code(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks; fails if a block opens and never closes."""
    lines, opened = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            if opened is not None:
                assert line.strip() == "```", f"{path.name}:{number}: block opened at line {opened} closes with {line!r}"
            opened = number if opened is None else None
        elif opened is None:
            lines.append(line)
        else:
            assert not line.startswith("## "), f"{path.name}:{number}: heading inside the block opened at line {opened}"
    assert opened is None, f"{path.name}: the code block opened at line {opened} never closes"
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the file's headings: lower case, punctuation dropped, spaces as dashes."""
    headings = [line.lstrip("#").strip() for line in outside_code(path) if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_code_blocks_close_and_relative_links_resolve(path):
    for target in LINK.findall("\n".join(outside_code(path))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: link to a missing file {target}"
        if fragment and dest.suffix == ".md":
            assert fragment in anchors(dest), f"{path.name}: link to a missing heading {target}"


def test_readme_links_the_benchmark_log():
    assert "docs/benchmarks.md" in LINK.findall((ROOT / "README.md").read_text())
