"""README.md and every page under docs/ render as written: every code block closes, and every relative
link resolves. The README is a user's page: short, and it links every guide (docs/*.md) and the index of
the dated benchmark records (docs/benchmarks/README.md), which links every record. What the docs quote is
tied to what makes it (scripts/check_docs.py): quoted outputs are re-run here, figures and images name
the check or script that re-makes them."""

import importlib
import os
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
DOCS = [README, *PAGES]
GUIDES = sorted((ROOT / "docs").glob("*.md"))
RECORDS_INDEX = ROOT / "docs" / "benchmarks" / "README.md"
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


def linked_from(path: Path) -> set[Path]:
    """The files `path` links to (outside its code blocks), resolved."""
    targets = LINK.findall("\n".join(outside_code(path)))
    return {(path.parent / t.partition("#")[0]).resolve() for t in targets if not re.match(r"[a-z]+:", t)}


@pytest.mark.parametrize("page", [*GUIDES, RECORDS_INDEX], ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_links_every_guide_and_the_records_index(page):
    assert page.resolve() in linked_from(README), f"README.md does not link {page.relative_to(ROOT)}"


def test_the_records_index_links_every_record_and_each_raw_file_has_its_record():
    records = [page for page in PAGES if page.parent == RECORDS_INDEX.parent and page != RECORDS_INDEX]
    assert records, "no dated records under docs/benchmarks/"
    missing = [r.name for r in records if r.resolve() not in linked_from(RECORDS_INDEX)]
    assert not missing, f"docs/benchmarks/README.md does not list {missing}"
    raw = [f for f in RECORDS_INDEX.parent.iterdir() if f.suffix != ".md"]
    linked = set().union(*(linked_from(record) for record in records))
    orphans = [f.name for f in raw if f.resolve() not in linked]
    assert not orphans, f"files under docs/benchmarks/ that no record links: {orphans}"


# ---------------------------------------------------------------- what the docs quote is re-run (scripts/check_docs.py)


def _check_docs():
    spec = importlib.util.spec_from_file_location("check_docs", ROOT / "scripts" / "check_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


CHECK_DOCS = _check_docs()
QUOTED = [(path, number, command, expected) for path in DOCS
          for number, commands in CHECK_DOCS.output_blocks(path) for command, expected in commands]


@pytest.mark.parametrize("path, number, command, expected", QUOTED,
                         ids=[f"{p.name}:{n}" for p, n, _, _ in QUOTED])
def test_a_quoted_output_is_what_its_command_prints_now(path, number, command, expected, tmp_path, monkeypatch, capsys):
    # In this process: the quoted outputs are bad-input lines, printed before anything heavy starts.
    from normlab.cli import main

    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command)
    assert argv[0] == "normlab", f"{path.name}:{number}: a checked block runs normlab"
    main(argv[1:])
    out = capsys.readouterr()
    assert (out.out + out.err).rstrip("\n").splitlines() == expected, f"{path.name}:{number}: `{command}`"


def test_the_docs_quote_outputs_that_are_checked():
    assert {p.name for p, *_ in QUOTED} >= {"README.md", "configuration.md", "sweeps.md", "compare.md"}


def test_a_figure_in_prose_names_the_check_that_reruns_it():
    marks = [(path, *mark) for path in DOCS for mark in CHECK_DOCS.figure_marks(path)]
    assert marks, "no figure is marked"
    for path, number, fid, quoted in marks:
        assert fid in CHECK_DOCS.FIGURES, f"{path.name}:{number}: no check {fid!r} in scripts/check_docs.py"
        shape = re.search(r"\((.*?)\)", CHECK_DOCS.FIGURES[fid].pattern).group(1)
        assert re.fullmatch(shape, quoted), f"{path.name}:{number}: {quoted!r} is not what check {fid} finds"
    assert set(CHECK_DOCS.FIGURES) == {fid for _, _, fid, _ in marks}, "a check that no doc quotes"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_an_image_names_the_script_that_draws_it(path):
    for number, image, script in CHECK_DOCS.image_marks(path):
        assert script, f"{path.name}:{number}: {image} has no <!-- made by: SCRIPT --> line before it"
        source = ROOT / script
        assert source.is_file(), f"{path.name}:{number}: {script} does not exist"
        called = re.findall(r"\$\{here\}/([\w.]+)", source.read_text())  # the scripts a shell script runs
        texts = [source.read_text(), *((source.parent / name).read_text() for name in called)]
        assert any(Path(image).name in text for text in texts), f"{path.name}:{number}: {script} never names {image}"


def test_python_snippets_read_the_dirs_normlab_writes():
    # normlab train writes outputs/runs/ and outputs/sweeps/; a snippet reads those, or a dir it trained itself
    snippets = [block for path in DOCS for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S)]
    snippets.append(importlib.import_module("normlab").__doc__)
    for snippet in snippets:
        trained = set(re.findall(r"train_run\([^\n]*?\"([^\"]+)\"\)", snippet))
        for read in re.findall(r"(?:load_runs\(|compare\(\[)\"([^\"]+)\"", snippet):
            assert read.startswith("outputs/") or read in trained, f"a snippet reads {read!r}, where normlab writes nothing"


# ---------------------------------------------------------------- a figure that depends on the machine cites its record

RECORDS = CHECK_DOCS.records()


@pytest.mark.parametrize("record", RECORDS, ids=lambda p: p.name)
def test_a_record_states_its_machine_date_commit_and_command(record):
    assert not CHECK_DOCS.record_problems(record), f"{record.name}: {CHECK_DOCS.record_problems(record)}"


def test_a_record_header_that_lacks_a_field_or_its_shape_is_found(tmp_path):
    record = tmp_path / "cpu-2026-11-26-x.md"
    record.write_text("# x\n\n- **Machine:** a CPU\n- **Date:** 26 Nov\n- **Commit:** abc1234, against\n  9999999\n\n"
                      "figures\n")
    problems = CHECK_DOCS.record_problems(record)
    assert any(p.startswith("Date:") for p in problems) and "no Command line" in problems, problems
    assert not any(p.startswith(("Commit", "Machine")) for p in problems), problems


@pytest.mark.parametrize("path", [README, *GUIDES], ids=lambda p: str(p.relative_to(ROOT)))
def test_a_guide_cites_records_and_says_where_each_measured_figure_comes_from(path):
    for number, target in CHECK_DOCS.citations(path):
        target = Path(target)
        assert target.suffix == ".md" and target.exists(), f"{path.name}:{number} cites {target.name}, not a record"
        assert not CHECK_DOCS.record_problems(target), f"{path.name}:{number}: {target.name}'s header is incomplete"
    unsourced = CHECK_DOCS.unsourced_claims(path)
    assert not unsourced, (f"{path.name}: lines {unsourced} say they measured something but carry no check mark, "
                           "record link or pending mark")


def test_a_measured_claim_without_a_source_is_found(tmp_path):
    record = os.path.relpath(RECORDS[0], tmp_path)
    guide = tmp_path / "guide.md"
    guide.write_text(f"Measured on the 2-core CPU: 3 s.\n\nThis one has not been measured yet.\n\n"
                     f"Measured with `x`: 4 s ([r]({record})).\n\nMeasured here: 5 s ([r](elsewhere.md)).\n")
    assert CHECK_DOCS.unsourced_claims(guide) == [1, 7]


def test_a_pending_figure_names_the_command_that_measures_it():
    marks = [(path, *mark) for path in [README, *GUIDES] for mark in CHECK_DOCS.pending_marks(path)]
    for path, number, fid in marks:
        assert fid in CHECK_DOCS.PENDING, f"{path.name}:{number}: no command for pending figure {fid!r} in PENDING"
    ids = [fid for *_, fid in marks]
    assert len(ids) == len(set(ids)), f"a pending figure marked twice: {ids}"
    assert set(CHECK_DOCS.PENDING) == set(ids), "a PENDING command that no guide marks"
