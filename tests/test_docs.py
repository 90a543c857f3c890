"""README.md and every page under docs/ render as written: every code block closes, and every relative
link resolves. The README is a user's page: short, and it links every docs page."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
DOCS = [README, *PAGES]
README_MAX_LINES = 250
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


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_close_and_relative_links_resolve(path):
    for target in LINK.findall("\n".join(outside_code(path))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: link to a missing file {target}"
        if fragment and dest.suffix == ".md":
            assert fragment in anchors(dest), f"{path.name}: link to a missing heading {target}"


def test_the_docs_have_pages():
    assert README.exists() and len(PAGES) >= 2, "README.md and the pages under docs/ are missing"


def test_readme_is_a_short_page():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}: move the details to a page under docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_links_every_docs_page(page):
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall("\n".join(outside_code(README)))}
    assert page.resolve() in linked, f"README.md does not link {page.relative_to(ROOT)}"
