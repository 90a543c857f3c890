"""The runs a sweep dir holds, known by their config and seed, and where each job of a command run again in it lands.

A sweep dir is one experiment: a run in it is known by what it trains (normlab.config.run_identity: its config but
the bookkeeping keys, lr and seed included), not by the place of its values in today's command line. `place_jobs`
gives each job of a grid sweep run again in its sweep dir the dir of the run it asks for, wherever that dir is (a
run that ended is then not trained again, a stopped one continues), and each job the sweep has no run of a dir of
its own, numbered after the sweep's jobs. A dir whose job stopped before it wrote config.json (killed at once, or
refused for its data) is known by the overrides it was launched with (.hydra/overrides.yaml).

Imports stay light (no torch): `normlab train` checks a sweep's dirs before Hydra starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from normlab.config import flatten_config, is_bookkeeping, run_identity

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"  # a grid sweep's: its jobs are known up front
ENDED = ("completed", "diverged")  # a run with nothing left to train (normlab.train.checkpoint.ENDED)


@dataclass(frozen=True)
class RecordedRun:
    """A job dir of a sweep: `num`, the number its name starts with (None: none); `flat`, its config.json flattened
    (None where it wrote none); `given`, for a dir without config.json, what its saved overrides set (override_identity);
    `ended`, whether its summary.json says it completed or diverged."""

    path: Path
    num: int | None
    flat: dict[str, Any] | None
    given: tuple | None
    ended: bool
    identity: tuple | None = None  # run_identity(flat)

    @property
    def run_name(self) -> str:
        """The run name in its dir's name `<num>_<run name>`, else the dir's name."""
        head, _, rest = self.path.name.partition("_")
        return rest if head.isdigit() and rest else self.path.name


def recorded_runs(sweep_dir: str | Path) -> list[RecordedRun]:
    """The job dirs of `sweep_dir` (its subdirs holding a config.json, a summary.json or Hydra's .hydra/), by
    number; [] where it does not exist."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    runs = []
    for path in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        if not any((path / name).exists() for name in ("config.json", "summary.json", ".hydra")):
            continue
        head = path.name.split("_", 1)[0]
        flat = _json(path / "config.json")
        summary = _json(path / "summary.json") or {}
        given = None if flat is not None else override_identity(_saved_overrides(path))
        flat = flatten_config(flat) if flat is not None else None
        runs.append(RecordedRun(path, int(head) if head.isdigit() else None, flat, given, summary.get("status") in ENDED,
                                run_identity(flat) if flat is not None else None))
    return sorted(runs, key=lambda r: (r.num is None, r.num or 0, r.path.name))


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _saved_overrides(run_dir: Path) -> list[str] | None:
    try:
        saved = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml"))
    except Exception:  # none, or damaged: the dir is known by nothing
        return None
    return [str(o) for o in saved] if isinstance(saved, list) else None


def override_identity(overrides: Sequence[str] | None) -> tuple | None:
    """What a job's `overrides` set, bookkeeping keys and Hydra's own aside, as a comparable whole (values as Hydra
    reads them: lr=1e-3 and lr=0.001 alike); None where they cannot be read."""
    if overrides is None:
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:
        return None
    given = {}
    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or override.is_sweep_override() or key.startswith("hydra") or is_bookkeeping(key):
            continue
        given[key] = run_identity({"value": override.value()})
    return tuple(sorted(given.items()))


@dataclass(frozen=True)
class Place:
    """Where a job of a sweep lands: its number (hydra.job.num) and its dir, relative to the sweep dir."""

    num: int
    subdir: str


@dataclass(frozen=True)
class AskedJob:
    """A job of the command: what it trains (run_identity), its overrides, its place in the command line (its
    hydra.job.num), the dir that place gives it (the sweep's subdir with hydra.job.num set to it), and that dir for
    any other number."""

    identity: tuple
    overrides: Sequence[str]
    num: int
    positional: Path
    dir_for: Callable[[int], Path]


def place_jobs(sweep_dir: str | Path, jobs: Sequence[AskedJob], runs: Sequence[RecordedRun]) -> list[Place]:
    """Where each of `jobs` lands in `sweep_dir`, whose job dirs are `runs` (recorded_runs): the dir of a run it asks
    for (its config.json's identity, else the overrides of a dir without one), each such dir taken by one job at
    most (its place's dir first, then an ended run, then the lowest number); else a dir of its own: a number free
    below the sweep's highest keeps its place's number (a job that never started), the others are numbered after
    the highest, in the command's order."""
    sweep_dir = Path(sweep_dir).absolute()
    places: list[Place | None] = [None] * len(jobs)
    by_identity: dict[tuple, list[RecordedRun]] = {}
    for run in runs:
        by_identity.setdefault(run.identity, []).append(run)  # None: the dirs without config.json
    taken: set[Path] = set()
    for i, job in enumerate(jobs):
        found = _found(job, by_identity, taken)
        if found is not None:
            taken.add(found.path)
            places[i] = Place(found.num if found.num is not None else job.num, found.path.name)
    numbers = {r.num for r in runs if r.num is not None}
    highest = max(numbers, default=-1)
    for i, job in enumerate(jobs):
        if places[i] is None and job.num < highest and job.num not in numbers:
            numbers.add(job.num)
            places[i] = Place(job.num, _relative(job.dir_for(job.num), sweep_dir))
    following = highest + 1
    for i, job in enumerate(jobs):
        if places[i] is None:
            while following in numbers:
                following += 1
            numbers.add(following)
            places[i] = Place(following, _relative(job.dir_for(following), sweep_dir))
    return places


def _found(job: AskedJob, by_identity: dict[tuple | None, list[RecordedRun]], taken: set[Path]) -> RecordedRun | None:
    """The run that `job` asks for, not `taken` by an earlier job: by config.json (`by_identity`), else by the saved
    overrides of a dir without one (by_identity[None]); None if none."""
    same = [r for r in by_identity.get(job.identity, []) if r.path not in taken]
    if not same and by_identity.get(None):
        given = override_identity(job.overrides)
        same = [r for r in by_identity[None] if r.path not in taken and given is not None and r.given == given]
    if not same:
        return None
    return min(same, key=lambda r: (r.path != job.positional.absolute(), not r.ended, r.num is None, r.num or 0))


def _relative(path: Path, sweep_dir: Path) -> str:
    """`path` relative to `sweep_dir` where it lies below it; else as it is (the sweep's checks refuse it)."""
    try:
        return str(path.absolute().relative_to(sweep_dir))
    except ValueError:
        return str(path)
