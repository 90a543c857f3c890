"""Re-run what the docs quote and compare: `python scripts/check_docs.py [--only ID,...] [--images]`.

The guides (README.md, docs/*.md) mark each output and figure they quote with what makes it:
- `<!-- check: output -->` on the line before a fenced block of `$ normlab ...` lines, each followed by
  the lines it prints: each command runs again in a scratch dir and its output is compared line for line
  (tests/test_docs.py does the same in-process: these are the cheap ones, bad-input lines);
- `FIGURE <!-- check: ID -->` right after a figure quoted in prose: FIGURES[ID] holds the command that
  prints it (under each environment listed) and the pattern that finds it in the output; the script runs
  it and compares (tests/test_docs.py only checks that the marker names a known ID and its figure has
  the pattern's shape: these take minutes);
- `<!-- made by: SCRIPT -->` on the line before an image: the script that draws it, which names the
  image's file (tests/test_docs.py checks both). The reproductions behind the images take hours, so
  only `--images` runs them, and reports whether each rewrote its image;
- a link into docs/benchmarks/: a figure that depends on the machine (a time, a speed) cites the dated
  record it comes from. Each record opens with its machine, date, commit and command (RECORD_FIELDS),
  which this script and tests/test_docs.py check, as they check that a guide's citations are records;
- `<!-- figure pending: ID -->` where a figure is still to be measured: PENDING[ID] is the command that
  measures it. The script lists each as pending (it does not fail on them).
A paragraph of a guide that says it measured something carries one of these (or names the scripts/repro/
script that re-makes its figures): `unsourced_claims` finds those that do not.

It prints one line per check (ok, or what differs) and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OUTPUT_MARK = "<!-- check: output -->"
FIGURE_MARK = re.compile(r"(\S+)\s*<!-- check: ([\w-]+) -->")
IMAGE_MARK = re.compile(r"<!-- made by: (\S+) -->")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")
RECORDS = ROOT / "docs" / "benchmarks"
RECORD_FIELDS = {"Machine": r".+", "Date": r"\d{4}-\d{2}-\d{2}", "Commit": r"[0-9a-f]{7,40}\b.*", "Command": r".*`.+"}
RECORD_FIELD = re.compile(r"- \*\*(\w+):\*\* (.*)")
PENDING_MARK = re.compile(r"<!-- figure pending: ([\w-]+) -->")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CLAIM = re.compile(r"\b[Mm]easured(?: (?:on|with|by|here)\b|:)")
NEGATED = re.compile(r"\bnot (?:been |yet |be )?measured\b")
LOSS = r"final val loss (\d+\.\d{4})"


@dataclass
class Figure:
    """A figure quoted in prose: `command` (a `normlab` argv), run once per environment in `envs` (each
    must print the same figure), and the `pattern` whose group 1 is the figure in its output."""

    command: list[str]
    pattern: str
    envs: list[dict[str, str | None]] = field(default_factory=lambda: [{}])


FIGURES = {
    # README and docs/getting-started.md: the main job's final validation loss (about 2 minutes on a 2-core CPU).
    "main_job": Figure(["train", "norm=rms", "placement=pre", "wandb.mode=disabled"], LOSS),
    # docs/getting-started.md: the thread count and a CPU result; None: the variable unset (torch's default, one per core).
    "tiny_batch_threads": Figure(["train", "norm=batch", "model=tiny", "max_steps=50", "wandb.mode=disabled"], LOSS,
                                 [{"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": None}]),
}


# The figures still to be measured, each where a guide marks it, with the command that measures it (on a quiet
# machine: the 2-core CPU's figures in docs/benchmarks/ were taken with one torch thread, interleaved against a base).
PENDING = {
}


def output_blocks(path: Path) -> list[tuple[int, list[tuple[str, list[str]]]]]:
    """Each `<!-- check: output -->` block of `path`: (its line number, [(command, the lines it prints)])."""
    lines, blocks = path.read_text().splitlines(), []
    for number, line in enumerate(lines):
        if line.strip() != OUTPUT_MARK:
            continue
        assert lines[number + 1].startswith("```"), f"{path.name}:{number + 1}: {OUTPUT_MARK} is not before a block"
        end = next(i for i in range(number + 2, len(lines)) if lines[i].startswith("```"))
        commands: list[tuple[str, list[str]]] = []
        for text in lines[number + 2 : end]:
            if text.startswith("$ "):
                commands.append((text[2:].split("  #")[0].strip(), []))
            else:
                assert commands, f"{path.name}:{number + 3}: a checked block starts with `$ COMMAND`"
                commands[-1][1].append(text)
        blocks.append((number + 1, commands))
    return blocks


def figure_marks(path: Path) -> list[tuple[int, str, str]]:
    """Each `FIGURE <!-- check: ID -->` of `path`: (line number, ID, the figure as quoted)."""
    return [(n, m.group(2), m.group(1).strip("`*,.;:()"))
            for n, line in enumerate(path.read_text().splitlines(), 1) for m in FIGURE_MARK.finditer(line)
            if m.group(2) != "output"]


def image_marks(path: Path) -> list[tuple[int, str, str | None]]:
    """Each image of `path`: (line number, its file, the script its `<!-- made by: -->` line names, or None)."""
    lines, found = path.read_text().splitlines(), []
    for number, line in enumerate(lines):
        for image in IMAGE.findall(line):
            mark = IMAGE_MARK.search(lines[number - 1]) if number else None
            found.append((number + 1, image, mark.group(1) if mark else None))
    return found


def records() -> list[Path]:
    """The dated records under docs/benchmarks/ (its README is their index, not a record)."""
    return sorted(path for path in RECORDS.glob("*.md") if path.name != "README.md")


def record_header(path: Path) -> dict[str, str]:
    """The `- **Field:** value` lines that open a record under its title (a value may go on over indented lines)."""
    fields: dict[str, str] = {}
    lines = path.read_text().splitlines()[1:]
    for line in lines[next((i for i, text in enumerate(lines) if text.strip()), 0):]:
        match = RECORD_FIELD.match(line)
        if match:
            fields[match.group(1)] = match.group(2)
        elif line.startswith("  ") and fields:
            fields[list(fields)[-1]] += " " + line.strip()
        else:
            break
    return fields


def record_problems(path: Path) -> list[str]:
    """What a record's header lacks: each of RECORD_FIELDS, in that shape (a date, a commit's hash, a `command`)."""
    header = record_header(path)
    return [f"{field}: {header[field]!r} is not {shape!r}" if field in header else f"no {field} line"
            for field, shape in RECORD_FIELDS.items()
            if field not in header or not re.fullmatch(shape, header[field])]


def is_record_link(path: Path, file: str) -> bool:
    """Whether `file`, linked from `path`, lies in docs/benchmarks/ and is not its index (which names the machines)."""
    target = (path.parent / file).resolve() if file else path
    return target.parent == RECORDS and target.name != "README.md"


def citations(path: Path) -> list[tuple[int, str]]:
    """Each link of `path` into docs/benchmarks/: (line number, the linked file, resolved, without its anchor)."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            file = target.partition("#")[0]
            if file and not re.match(r"[a-z]+:", file) and is_record_link(path, file):
                found.append((number, str((path.parent / file).resolve())))
    return found


def pending_marks(path: Path) -> list[tuple[int, str]]:
    """Each `<!-- figure pending: ID -->` of `path`: (line number, ID)."""
    return [(n, m.group(1))
            for n, line in enumerate(path.read_text().splitlines(), 1) for m in PENDING_MARK.finditer(line)]


def unsourced_claims(path: Path) -> list[int]:
    """The first line of each paragraph of `path` that says it measured something and carries no check mark,
    record link, pending mark or scripts/repro/ script. A paragraph: lines between blank lines, code blocks out."""
    found, block, start, fenced = [], [], 0, False
    for number, line in enumerate([*path.read_text().splitlines(), ""], 1):
        fenced = fenced != line.lstrip().startswith("```")
        if line.strip() and not fenced and not line.lstrip().startswith("```"):
            start = start or number
            block.append(line)
            continue
        text = NEGATED.sub("", "\n".join(block))
        tied = ("<!-- check:" in text or "<!-- figure pending:" in text or "scripts/repro/" in text
                or any(is_record_link(path, t.partition("#")[0]) for t in LINK.findall(text)))
        if CLAIM.search(text) and not tied:
            found.append(start)
        block, start = [], 0
    return found


def check_sources(path: Path) -> list[str]:
    """One line per citation, pending figure and unsourced claim of a guide: ok, PENDING or DIFF."""
    where, results = path.relative_to(ROOT), []
    for number, target in citations(path):
        problems = record_problems(Path(target)) if Path(target).suffix == ".md" and Path(target).exists() else [
            "not a record (cite the record's .md, which links its raw files)"]
        results.append(f"ok    {where}:{number} cites {Path(target).name}" if not problems
                       else f"DIFF  {where}:{number} cites {Path(target).name}: {'; '.join(problems)}")
    for number, fid in pending_marks(path):
        results.append(f"PENDING {where}:{number} {fid}: measure with `{PENDING.get(fid, 'no command in PENDING')}`")
    results += [f"DIFF  {where}:{number}: a measured figure without a check mark, record link or pending mark"
                for number in unsourced_claims(path)]
    return results


def check_records() -> list[str]:
    """One line per record: ok when its header states machine, date, commit and command."""
    return [f"ok    {path.relative_to(ROOT)}: machine, date, commit, command" if not record_problems(path)
            else f"DIFF  {path.relative_to(ROOT)}: {'; '.join(record_problems(path))}" for path in records()]


def normlab(argv: list[str], cwd: Path, env: dict[str, str | None] | None = None) -> str:
    """What `normlab ARGV` prints (stdout, then stderr) when run in `cwd`."""
    full = {**os.environ, "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    for key, value in (env or {}).items():
        full.pop(key, None) if value is None else full.__setitem__(key, value)
    done = subprocess.run([sys.executable, "-m", "normlab", *argv], cwd=cwd, env=full, capture_output=True, text=True)
    return done.stdout + done.stderr


def check_outputs(path: Path) -> list[str]:
    """One line per checked block of `path`: ok, or the first line that differs."""
    results = []
    for number, commands in output_blocks(path):
        for command, expected in commands:
            with tempfile.TemporaryDirectory() as scratch:
                got = normlab(shlex.split(command)[1:], Path(scratch)).rstrip("\n").splitlines()
            where = f"{path.relative_to(ROOT)}:{number} `{command}`"
            results.append(f"ok    {where}" if got == expected else f"DIFF  {where}: quoted {expected}, now {got}")
    return results


@functools.lru_cache(maxsize=None)
def figure_values(fid: str) -> tuple[str, ...]:
    """What FIGURES[fid]'s command prints now, once per environment: run once however many guides quote it."""
    figure, got = FIGURES[fid], []
    for env in figure.envs:
        with tempfile.TemporaryDirectory() as scratch:
            found = re.findall(figure.pattern, normlab(figure.command, Path(scratch), env))
        got.append(found[-1] if found else "nothing")
    return tuple(got)


def check_figure(fid: str, quoted: str, where: str) -> str:
    """Run FIGURES[fid] under each of its environments; ok if each prints `quoted`."""
    figure, got = FIGURES[fid], list(figure_values(fid))
    line = f"{where} {fid} `normlab {' '.join(figure.command)}` under {figure.envs}: quoted {quoted}, now {got}"
    return ("ok    " if all(g == quoted for g in got) else "DIFF  ") + line


def check_image(image: str, script: str, where: str) -> str:
    """Run the script that draws `image` (hours, for a reproduction); ok if it rewrote the image."""
    target = ROOT / "docs" / image
    before = target.stat().st_mtime if target.exists() else 0.0
    subprocess.run(["bash" if script.endswith(".sh") else sys.executable, str(ROOT / script)], cwd=ROOT)
    rewritten = target.exists() and target.stat().st_mtime > before
    return f"{'ok  ' if rewritten else 'DIFF'}  {where} {image}: {script} {'rewrote' if rewritten else 'did not rewrite'} it"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated figure IDs (and `output` for the output blocks, `sources` for "
                                       "the records, citations and pending figures)")
    parser.add_argument("--images", action="store_true", help="also run the scripts that draw the docs' images (hours)")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    started, results = time.monotonic(), []
    batches = [check_records] if only is None or "sources" in only else []
    batches += [functools.partial(check_path, path, only, args.images) for path in DOCS]
    for batch in batches:  # printed as each guide is done: a full run takes minutes
        for line in batch():
            results.append(line)
            print(line, flush=True)
    differ, pending = sum(r.startswith("DIFF") for r in results), sum(r.startswith("PENDING") for r in results)
    print(f"{len(results) - pending} checks, {differ} differ, {pending} figures pending, "
          f"{time.monotonic() - started:.0f} s")
    return 1 if differ else 0


def check_path(path: Path, only: set[str] | None, images: bool) -> list[str]:
    """The checks of one guide that `--only` (None: all) and `--images` ask for."""
    results = []
    if only is None or "output" in only:
        results += check_outputs(path)
    if only is None or "sources" in only:
        results += check_sources(path)
    for number, fid, quoted in figure_marks(path):
        if only is None or fid in only:
            results.append(check_figure(fid, quoted, f"{path.relative_to(ROOT)}:{number}"))
    for number, image, script in image_marks(path) if images else []:
        results.append(check_image(image, script, f"{path.relative_to(ROOT)}:{number}"))
    return results

if __name__ == "__main__":
    sys.exit(main())
