"""Re-run what the docs quote and compare: `python scripts/check_docs.py [--only ID,...] [--images]`.

The docs (README.md, docs/*.md) mark each output and figure they quote with the command that makes it:
- `<!-- check: output -->` on the line before a fenced block of `$ normlab ...` lines, each followed by
  the lines it prints: each command runs again in a scratch dir and its output is compared line for line
  (tests/test_docs.py does the same in-process: these are the cheap ones, bad-input lines);
- `FIGURE <!-- check: ID -->` right after a figure quoted in prose: FIGURES[ID] holds the command that
  prints it (under each environment listed) and the pattern that finds it in the output; the script runs
  it and compares (tests/test_docs.py only checks that the marker names a known ID and its figure has
  the pattern's shape: these take minutes);
- `<!-- made by: SCRIPT -->` on the line before an image: the script that draws it, which names the
  image's file (tests/test_docs.py checks both). The reproductions behind the images take hours, so
  only `--images` runs them, and reports whether each rewrote its image.

It prints one line per check (ok, or what differs) and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
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
LOSS = r"final val loss (\d+\.\d{4})"


@dataclass
class Figure:
    """A figure quoted in prose: `command` (a `normlab` argv), run once per environment in `envs` (each
    must print the same figure), and the `pattern` whose group 1 is the figure in its output."""

    command: list[str]
    pattern: str
    envs: list[dict[str, str | None]] = field(default_factory=lambda: [{}])


FIGURES = {
    # README: the main job's final validation loss (about 2 minutes on a 2-core CPU).
    "main_job": Figure(["train", "norm=rms", "placement=pre", "wandb.mode=disabled"], LOSS),
    # README: the thread count and a CPU result; None: the variable unset (torch's default, one per core).
    "tiny_batch_threads": Figure(["train", "norm=batch", "model=tiny", "max_steps=50", "wandb.mode=disabled"], LOSS,
                                 [{"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": None}]),
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


def check_figure(fid: str, quoted: str, where: str) -> str:
    """Run FIGURES[fid] under each of its environments; ok if each prints `quoted`."""
    figure, got = FIGURES[fid], []
    for env in figure.envs:
        with tempfile.TemporaryDirectory() as scratch:
            found = re.findall(figure.pattern, normlab(figure.command, Path(scratch), env))
        got.append(found[-1] if found else "nothing")
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
    parser.add_argument("--only", help="comma-separated figure IDs (and `output` for the output blocks)")
    parser.add_argument("--images", action="store_true", help="also run the scripts that draw the docs' images (hours)")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    started, results = time.monotonic(), []
    for path in DOCS:
        if only is None or "output" in only:
            results += check_outputs(path)
        for number, fid, quoted in figure_marks(path):
            if only is None or fid in only:
                results.append(check_figure(fid, quoted, f"{path.relative_to(ROOT)}:{number}"))
        for number, image, script in image_marks(path) if args.images else []:
            results.append(check_image(image, script, f"{path.relative_to(ROOT)}:{number}"))
    for line in results:
        print(line)
    print(f"{len(results)} checks, {sum(not r.startswith('ok') for r in results)} differ, "
          f"{time.monotonic() - started:.0f} s")
    return 1 if any(not r.startswith("ok") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
