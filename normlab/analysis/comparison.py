"""The comparison: run dirs loaded and grouped into arms (build_comparison), with what the report and the
plots need from them (Comparison)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from normlab.analysis.arms import Arm, ArmResult, arm_keys, arm_of, summarize_arm
from normlab.analysis.runs import METRICS, CompareError, Run, load_run

@dataclass
class Comparison:
    """Everything the report and the plots show: runs sorted by arm, lr and seed, and one result per arm."""

    runs: list[Run]
    arms: list[ArmResult]
    arm_of: dict[Path, Arm]
    root: Path  # common ancestor of the run dirs; run dirs are shown relative to it
    notes: list[str] = field(default_factory=list)
    measure: str = "val_loss"  # what every loss of the comparison is in (see comparison_measure)

    def run_label(self, run: Run) -> str:
        rel = os.path.relpath(run.path, self.root)
        return run.path.name if rel == "." else rel


def build_comparison(run_dirs: list[Path]) -> Comparison:
    """Load the run dirs and group them into arms. Unreadable runs are skipped with a note."""
    runs, notes = [], []
    for path in run_dirs:
        try:
            runs.append(load_run(path))
        except CompareError as err:
            notes.append(f"skipped {err}")
    if not runs:
        raise CompareError(f"no readable runs: {notes[0].removeprefix('skipped ')}" if notes else "no runs")
    measure = comparison_measure(runs)
    for run in runs:
        run.measure = measure
    keys = arm_keys(runs)
    arm_by_path = {run.path: arm_of(run, keys) for run in runs}
    grouped: dict[Arm, list[Run]] = {}
    for run in runs:
        grouped.setdefault(arm_by_path[run.path], []).append(run)
    grouped = {arm: _once_each(members, keys, notes) for arm, members in grouped.items()}
    arms = [summarize_arm(arm, grouped[arm]) for arm in sorted(grouped, key=Arm.sort_key)]
    ordered = [run for result in arms for run in result.runs]
    root = Path(os.path.commonpath([run.path for run in ordered]))
    for run in ordered:
        if run.outcome_loss is None:
            notes.append(f"{run.path.name} has status {run.status!r} (killed or still running): left out of the LR sensitivity")
        if run.bad_lines:
            notes.append(f"{run.path.name}: {run.bad_lines} line(s) of {METRICS} were not readable rows (torn, not UTF-8 JSON, or of the wrong types) and were ignored")
    return Comparison(runs=ordered, arms=arms, arm_of=arm_by_path, root=root, notes=notes, measure=measure)


def _once_each(members: list[Run], keys: list[str], notes: list[str]) -> list[Run]:
    """An arm's runs with each training counted once: of runs at the same lr and seed that differ only in
    norm knobs the arm's norm does not read (arm_of leaves those out), the first is kept and the others
    noted. Runs of one config at one lr and seed (a sweep run twice) are kept, as before."""
    first: dict[tuple, Run] = {}
    kept = []
    for run in members:
        twin = first.setdefault((run.lr, run.seed), run)
        unread = [k for k in keys if twin.settings.get(k) != run.settings.get(k)]
        if twin is not run and unread:
            notes.append(f"{run.path.name}: the same training as {twin.path.name} ({run.norm} does not read "
                         f"{', '.join(unread)}): counted once")
            continue
        kept.append(run)
    return kept


def comparison_measure(runs: list[Run]) -> str:
    """val_bpb when the runs' tokenizers differ (their losses per token are not comparable), else val_loss."""
    return "val_bpb" if len({run.tokenizer for run in runs}) > 1 else "val_loss"
