"""`normlab compare PATH...`: the ablation's answer, read from run dirs (never from wandb).

The command finds the run dirs, builds the comparison (comparison.py: runs, arms, LR sensitivity,
stability), prints the ranked arms (ranking.py) and writes report.md (report.py) and PNG plots
(plots.py) into a report dir.
"""

from __future__ import annotations

import errno
import os
import secrets
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from normlab.analysis.stats.comparison import Comparison, build_comparison
from normlab.analysis.render.exports import FIGURE_FORMATS
from normlab.analysis.render.ranking import terminal_summary
from normlab.analysis.read.runs import CONFIG, METRICS, SUMMARY, CompareError, find_run_dirs, path_list
from normlab.analysis.render.workspace import EXTRA, SPEC, check_installed, save_workspaces
from normlab.config.errors import shown
from normlab.util.errors import fail


def default_report_dir(paths: list[str], run_dirs: list[Path]) -> Path:
    """`<sweep dir>/report` when the one PATH is a sweep dir (its runs are its children), else outputs/reports/<time>."""
    if len(paths) == 1:
        given = Path(paths[0]).resolve()
        if given not in run_dirs and all(run.parent == given for run in run_dirs):
            return given / "report"
    return Path("outputs") / "reports" / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{secrets.token_hex(3)}"


def compare(paths: list[str], out: str | os.PathLike | None = None, formats: str | Iterable[str] = ("png",)) -> Path:
    """Find the runs under `paths` (a list of paths; one path alone is taken as one), write report.md, the tables
    as CSV and JSON (exports.py) and the plots (in each of `formats`: ('png', 'svg'), or 'png,svg' as --format takes
    them) into the report dir, and return its path. The formats are checked before anything is read or made."""
    if isinstance(formats, str):
        names = formats.split(",")
    else:
        names = formats if isinstance(formats, Iterable) else [formats]
    chosen = figure_formats(names, f"formats={shown(formats)}", "e.g. formats=('png', 'pdf') or 'png,pdf'")
    return write_comparison(paths, out, chosen)[1]


def parse_formats(text: str) -> tuple[str, ...]:
    """--format's 'png,svg' as ('png', 'svg'); CompareError naming the allowed formats for anything else."""
    return figure_formats(text.split(","), f"--format {text}", "comma-separated (e.g. --format png,pdf)")


def figure_formats(names: Iterable, given: str, example: str) -> tuple[str, ...]:
    """`names` as figure formats, each once, in lower case; CompareError saying which are not, as `given` was
    written, with the allowed formats and `example`."""
    formats = tuple(dict.fromkeys(n.strip().lower() if isinstance(n, str) else n for n in names))
    bad = [f for f in formats if f not in FIGURE_FORMATS]
    if bad or not formats:
        raise CompareError(f"{given}: {', '.join(map(repr, bad)) or 'no format'} is not a figure format: "
                           f"choose from {', '.join(FIGURE_FORMATS)}, {example}")
    return formats


def write_comparison(paths: list[str], out: str | os.PathLike | None = None,
                     formats: tuple[str, ...] = ("png",)) -> tuple[Comparison, Path]:  # fmt: skip
    """compare(), its `formats` checked (figure_formats), returning the comparison too."""
    paths = path_list([paths])  # compare("outputs/"): one path, not its characters
    if not paths:
        raise CompareError("no path given: give a run dir, a sweep dir or the outputs/ root")
    run_dirs = find_run_dirs(paths)
    if not run_dirs:
        raise CompareError(f"no runs under {', '.join(map(str, paths))}: a run dir holds {SUMMARY}, {METRICS} or {CONFIG}")
    # matplotlib only once there are runs to draw: `normlab compare --help` and bad input stay fast
    from normlab.analysis.render.exports import write_exports
    from normlab.analysis.render.plots import write_plots
    from normlab.analysis.render.report import write_report

    comparison = build_comparison(run_dirs)
    report_dir = Path(out) if out is not None else default_report_dir(paths, run_dirs)
    try:
        if report_dir.exists() and not report_dir.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "it is a file, not a directory")
        report_dir.mkdir(parents=True, exist_ok=True)
        plots = write_plots(comparison, report_dir, formats)
        write_exports(comparison, report_dir)
        write_report(comparison, report_dir, plots, sources=paths)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        option = "--out" if out is not None else "the report dir"
        raise CompareError(f"{option} {report_dir}: cannot write the report there: {reason}: choose another with --out DIR") from None
    return comparison, report_dir


def main(argv: list[str]) -> int:
    """`normlab compare PATH... [--out DIR]`; returns the exit code."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, as every normlab error
            sys.exit(fail(f"compare: {message}"))

    parser = Parser(
        prog="normlab compare",
        description="Compare runs: print the arms ranked by final validation loss (with their LR sensitivity, "
        "seeds and stability), and write report.md and PNG plots, from the run dirs' files (never wandb).",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="a run dir, a sweep dir, or the outputs/ root")
    parser.add_argument("--out", metavar="DIR", help="report dir (default: <sweep dir>/report, else outputs/reports/<time>)")
    parser.add_argument("--wandb", action="store_true",
                        help="also save the comparison as a wandb workspace for the runs' project and group "
                        f"(needs wandb-workspaces: {EXTRA}); offline, its spec goes to <report dir>/{SPEC}")
    parser.add_argument("--format", default="png", metavar="FMT[,FMT]",
                        help=f"figure formats, comma-separated: {', '.join(FIGURE_FORMATS)} (default: png)")
    args = parser.parse_args(argv)
    try:
        if args.wandb:
            check_installed()
        comparison, report_dir = write_comparison(args.paths, args.out, parse_formats(args.format))
    except CompareError as err:
        return fail(err)
    print("\n".join(terminal_summary(comparison)))
    print(f"\nreport: {report_dir / 'report.md'}")
    if args.wandb:
        print(save_workspaces(comparison, report_dir, f"normlab compare: {report_dir.parent.name or report_dir.name}"))
    return 0
