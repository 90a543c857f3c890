"""Repeated runs: runs of the same resolved config and seed (bookkeeping keys aside) are one training, run
again. Compare counts each once, the newest completed one (else the newest), and notes the others: a
repeat counted as a second seed would show a spread of 0 and an interval it has no right to.
"""

from __future__ import annotations

from typing import Callable

from normlab.analysis.read.runs import SUMMARY, Run
from normlab.config import run_identity


def identity(run: Run) -> tuple:
    """What makes a training: every config value (lr and seed included) but the bookkeeping keys' (run_identity)."""
    return run_identity(run.settings)


def _newest_completed(run: Run) -> tuple:
    path = run.path / SUMMARY if (run.path / SUMMARY).exists() else run.path
    return (run.status == "completed", path.stat().st_mtime, str(run.path))


def drop_repeats(runs: list[Run], label: Callable[[Run], str]) -> tuple[list[Run], str | None]:
    """`runs` with each repeated training once (the newest completed), in their order, and one note naming
    the repeats (None when there are none). `label` names a run in the note."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:  # a run that records no seed (no config, no summary) cannot be known to repeat another
        groups.setdefault(identity(run) if run.seed is not None else (str(run.path),), []).append(run)
    kept, repeats = set(), []
    for members in groups.values():
        keep = max(members, key=_newest_completed)
        kept.add(keep.path)
        if len(members) > 1:
            others = ", ".join(label(r) for r in members if r is not keep)
            repeats.append(f"{label(keep)} (kept; also {others})")
    if not repeats:
        return runs, None
    note = ("Repeated runs (the same config and seed, run again) count once, the newest completed one: "
            + "; ".join(repeats) + ".")
    return [run for run in runs if run.path in kept], note
