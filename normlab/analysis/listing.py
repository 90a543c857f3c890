"""`normlab ls [DIR ...]`: the runs under the dirs, one line each, and each sweep summed up by status.

A line says the run's status (`running` while a process holds the run dir's lock), its last step of
max_steps, its final validation loss, its wall time, its age (the time since it last wrote a file) and
its dir. It reads little: summary.json, config.json and the end of the metrics file, never all of it.
Whether a run dir's lock is held is read from /proc/locks, which takes no lock; where that file does not
exist, by trying the lock without waiting and letting it go at once.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from normlab import keys
from normlab.analysis.read.records import METRICS, METRICS_CSV
from normlab.analysis.read.runs import CONFIG, SUMMARY, CompareError, find_run_dirs
from normlab.util.files import exclusive, flock_holders

SWEEP_MARKS = ("multirun.yaml", "sweep.log")  # a dir holding one of these is a sweep dir (Hydra's, normlab's)
TAIL_BYTES = 64 * 1024  # of the metrics file: enough for its last rows


@dataclass
class Listed:
    """One run dir as `normlab ls` shows it."""

    path: str
    status: str  # running | completed | diverged | failed | preempted | ... | incomplete (no summary, no lock) | damaged
    step: int | None
    max_steps: int | None
    final_val_loss: float | None
    wall_s: float | None  # summary.json's wall_time_s; for a running run, the time since it wrote config.json
    age_s: float  # since its last write
    sweep: str | None  # the sweep dir it belongs to
    phases: dict[str, float] | None = None  # summary.json's seconds by phase (normlab.train.phases), when recorded


def held_locks() -> set[tuple[int, int, int]] | None:
    """(major, minor, inode) of every file or dir an flock is held on, from /proc/locks; None without it."""
    holders = flock_holders()
    return None if holders is None else set(holders)


def is_locked(run_dir: Path, held: set[tuple[int, int, int]] | None) -> bool:
    """Whether a process holds the run dir's lock (an flock on the dir itself, as a run takes it)."""
    if held is not None:
        st = os.stat(run_dir)
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held
    try:
        with exclusive(run_dir, wait=False):
            return False
    except BlockingIOError:
        return True


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def last_step(run_dir: Path) -> int | None:
    """The step of the metrics file's last readable row, read from its end."""
    for name in (METRICS, METRICS_CSV):
        path = run_dir / name
        if not path.is_file():
            continue
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - TAIL_BYTES))
            lines = fh.read().decode("utf-8", "replace").splitlines()
        for line in reversed(lines):
            step = _json_step(line) if name == METRICS else line.split(",", 1)[0]
            if isinstance(step, str) and step.isdigit():
                return int(step)
            if isinstance(step, int) and not isinstance(step, bool):
                return step
        return None
    return None


def _json_step(line: str) -> Any:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row.get("step") if isinstance(row, dict) else None


def _without_status(run_dir: Path) -> str:
    """The status of a run dir whose summary.json says none: `damaged` if it has one that is not a JSON object
    (cut short, not UTF-8), else `incomplete` (killed before it wrote one)."""
    return "damaged" if (run_dir / SUMMARY).exists() and not _json(run_dir / SUMMARY) else "incomplete"


def listed(run_dir: Path, held: set[tuple[int, int, int]] | None, now: float) -> Listed:
    summary, config = _json(run_dir / SUMMARY), _json(run_dir / CONFIG)
    written = [p.stat().st_mtime for p in (run_dir / n for n in (SUMMARY, CONFIG, METRICS, METRICS_CSV)) if p.exists()]
    running = is_locked(run_dir, held)
    status = "running" if running else str(summary.get("status") or _without_status(run_dir))
    steps = summary.get("steps") if not running else None
    step = steps if isinstance(steps, int) and not isinstance(steps, bool) else last_step(run_dir)
    loss = keys.to_float(summary.get("final_val_loss")) if not running else math.nan
    wall = summary.get("wall_time_s") if not running else None
    if running and (run_dir / CONFIG).exists():
        wall = now - (run_dir / CONFIG).stat().st_mtime
    max_steps = config.get("max_steps")
    return Listed(
        path=str(run_dir), status=status, step=step,
        max_steps=max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) else None,
        final_val_loss=loss if math.isfinite(loss) else None,
        wall_s=float(wall) if isinstance(wall, (int, float)) and not isinstance(wall, bool) else None,
        age_s=max(0.0, now - max(written, default=now)),
        sweep=str(run_dir.parent) if any((run_dir.parent / m).exists() for m in SWEEP_MARKS) else None,
        phases=_phases(summary.get("phases")) if not running else None,
    )  # fmt: skip


def _phases(value: Any) -> dict[str, float] | None:
    """summary.json's phases when they are seconds by name, else None."""
    if not isinstance(value, dict) or not value:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
        return None
    return {str(name): float(seconds) for name, seconds in value.items()}


def list_runs(paths: list[str]) -> list[Listed]:
    """Every run dir under `paths`, by path; CompareError for a path that does not exist."""
    held, now = held_locks(), time.time()
    return [listed(run_dir, held, now) for run_dir in sorted(find_run_dirs(paths))]


def duration(seconds: float | None) -> str:
    """'41.2 s', '12 min', '3.5 h', '2 d'; '-' for None."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.{0 if unit != 'h' else 1}f} {unit}"
    return f"{seconds:.1f} s"


def shown(path: str) -> str:
    """`path` relative to the working dir when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def lines(runs: list[Listed]) -> list[str]:
    """The table of runs, then a line per sweep summing its runs up by status."""
    from normlab.analysis.render.terminal import aligned

    rows = [[r.status, f"{'-' if r.step is None else r.step}/{'-' if r.max_steps is None else r.max_steps}",
             "-" if r.final_val_loss is None else f"{r.final_val_loss:.4f}", duration(r.wall_s), duration(r.age_s),
             shown(r.path)] for r in runs]  # fmt: skip
    table = aligned(("status", "step", "val loss", "wall", "age", "path"), rows) if rows else ["no runs"]
    return table + [f"sweep {shown(sweep)}: {tally(counts)}" for sweep, counts in sweeps(runs).items()]


def sweeps(runs: list[Listed]) -> dict[str, dict[str, int]]:
    """{sweep dir: {status: runs}}, sweeps in order of their first run, each's statuses by count (most first)."""
    counts: dict[str, dict[str, int]] = {}
    for run in runs:
        if run.sweep is not None:
            by_status = counts.setdefault(run.sweep, {})
            by_status[run.status] = by_status.get(run.status, 0) + 1
    return {sweep: dict(sorted(c.items(), key=lambda item: (-item[1], item[0]))) for sweep, c in counts.items()}


def tally(counts: dict[str, int]) -> str:
    """'24 runs: 20 completed, 3 diverged, 1 running' of {status: runs}."""
    total = sum(counts.values())
    return f"{total} run{'s' if total != 1 else ''}: " + ", ".join(f"{n} {status}" for status, n in counts.items())


def main(argv: list[str]) -> int:
    """`normlab ls [DIR ...] [--json]`; returns the exit code."""
    import argparse
    import sys

    from normlab.util.errors import fail

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, as every normlab error
            sys.exit(fail(f"ls: {message}"))

    parser = Parser(prog="normlab ls", description="List the runs under DIRs (default: outputs): status (running "
                    "while its lock is held), step of max_steps, final val loss, wall time, age, path; and each sweep by status.")
    parser.add_argument("dirs", nargs="*", metavar="DIR", help="a run dir, a sweep dir or outputs/ (default: outputs)")
    parser.add_argument("--json", action="store_true", help="print {runs: [...], sweeps: {DIR: {STATUS: RUNS}}} as JSON")
    args = parser.parse_args(argv)
    try:
        runs = list_runs(args.dirs or ["outputs"])
    except CompareError as err:
        return fail(err)
    if args.json:
        print(json.dumps({"runs": [asdict(r) for r in runs], "sweeps": sweeps(runs)}, indent=1))
    else:
        print("\n".join(lines(runs)))
    return 0
