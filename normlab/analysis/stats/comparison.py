"""The comparison: run dirs loaded and grouped into arms (build_comparison), with what the report and the
plots need from them (Comparison): the arms ranked, their labels and common settings, the runs that
never trained, and the arms whose runs ran in different environments."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.analysis.stats.arms import Arm, ArmResult, arm_keys, arm_of, common_settings, labelled, summarize_arm, varying_dims
from normlab.analysis.stats.bracketing import bracket_notes
from normlab.analysis.stats.factors import FactorEffect, factor_effects
from normlab.analysis.stats.gaps import gaps_to_best, seed_count_note
from normlab.analysis.stats.intervals import Interval
from normlab.analysis.stats.presets import named_presets
from normlab.analysis.read.records import METRICS
from normlab.analysis.stats.repeats import drop_repeats
from normlab.analysis.read.runs import CompareError, Run, load_run

EPS_RATIO_PREFIX = "norm/eps_ratio/"  # telemetry's input RMS / Norm.eps_rms per norm slot (normlab.telemetry.norms)


@dataclass
class Comparison:
    """Everything the report and the plots show: runs sorted by arm, lr and seed, and one result per arm."""

    runs: list[Run]
    arms: list[ArmResult]
    arm_of: dict[Path, Arm]
    root: Path  # common ancestor of the run dirs; run dirs are shown relative to it
    notes: list[str] = field(default_factory=list)
    measure: str = "val_loss"  # what every loss of the comparison is in (see comparison_measure)
    dims: list[str] = field(default_factory=list)  # what varies between the arms (arms.varying_dims)
    common: list[tuple[str, Any]] = field(default_factory=list)  # the settings every run shares
    not_started: list[Run] = field(default_factory=list)  # failed before their first step: in no arm
    environment_warnings: list[str] = field(default_factory=list)  # one line per arm whose runs' environments differ
    eps_warnings: list[str] = field(default_factory=list)  # one line per arm with an eps-dominated norm (eps_warning)
    gaps: dict[Arm, Interval] = field(default_factory=dict)  # each ranked arm's loss minus the best arm's (gaps.py)
    effects: list[FactorEffect] = field(default_factory=list)  # each varying key's effect (factors.py)
    caveats: list[str] = field(default_factory=list)  # what limits the verdict: repeats, seed counts, unbracketed lrs
    skipped: list[str] = field(default_factory=list)  # a line per run dir that could not be read (in notes too)

    def run_label(self, run: Run) -> str:
        return _relative(run, self.root)

    @property
    def ranked(self) -> list[ArmResult]:
        return sorted(self.arms, key=ArmResult.rank_key)

    @property
    def warnings(self) -> list[str]:
        """Every warning line: the arms whose runs' environments differ, then those with eps-dominated norms."""
        return [*self.environment_warnings, *self.eps_warnings]


def build_comparison(run_dirs: list[Path]) -> Comparison:
    """Load the run dirs and group them into arms. Unreadable runs are skipped with a note; runs that failed
    before their first step are set apart (Comparison.not_started)."""
    loaded, notes = [], []
    for path in run_dirs:
        try:
            loaded.append(load_run(path))
        except CompareError as err:
            notes.append(f"skipped {err}")
    if not loaded:
        raise CompareError(f"no readable runs: {notes[0].removeprefix('skipped ')}" if notes else "no runs")
    skipped = list(notes)
    root = Path(os.path.commonpath([run.path for run in loaded]))
    runs, repeats = drop_repeats([run for run in loaded if not run.did_not_start], lambda run: _relative(run, root))
    measure = comparison_measure(runs)
    for run in runs:
        run.measure = measure
    keys = arm_keys(runs)
    grouped: dict[Arm, list[Run]] = {}
    for run in runs:
        grouped.setdefault(arm_of(run, keys), []).append(run)
    dims = varying_dims(list(grouped))
    covered, presets = named_presets({arm: members[0].settings for arm, members in grouped.items()}, dims)
    label_dims = [d for d in dims if d not in covered]  # a preset's name says them
    grouped = {labelled(arm, label_dims, presets[arm]): _once_each(members, keys, notes) for arm, members in grouped.items()}
    arms = [summarize_arm(arm, grouped[arm]) for arm in sorted(grouped, key=Arm.sort_key)]
    ordered = [run for result in arms for run in result.runs]
    notes += _run_notes(ordered)
    ranked = sorted(arms, key=ArmResult.rank_key)
    caveats = [c for c in (repeats, seed_count_note(ranked), *bracket_notes(ranked)) if c]
    return Comparison(
        runs=ordered, arms=arms, arm_of={run.path: result.arm for result in arms for run in result.runs},
        root=root, notes=notes, measure=measure, dims=dims,
        common=common_settings(runs), not_started=[run for run in loaded if run.did_not_start],
        environment_warnings=[w for result in arms if (w := environment_warning(result))], skipped=skipped,
        eps_warnings=[w for result in arms if (w := eps_warning(result))],
        gaps=gaps_to_best(ranked), effects=factor_effects(arms, dims), caveats=caveats,
    )  # fmt: skip


def _relative(run: Run, root: Path) -> str:
    rel = os.path.relpath(run.path, root)
    return run.path.name if rel == "." else rel


def _run_notes(runs: list[Run]) -> list[str]:
    notes = []
    for run in runs:
        if run.outcome_loss is None:
            notes.append(f"{run.path.name} has status {run.status!r} (killed or still running): left out of the LR sensitivity")
        if run.bad_lines:
            kind = "JSON" if run.metrics_file == METRICS else "CSV"
            notes.append(f"{run.path.name}: {run.bad_lines} line(s) of {run.metrics_file} were not readable rows "
                         f"(torn, not UTF-8 {kind}, or of the wrong types) and were ignored")
    return notes


def environment_warning(result: ArmResult) -> str | None:
    """One line naming what differs between the environment blocks of the arm's runs (runs without one are
    not compared); None when nothing does."""
    blocks = [run.environment for run in result.runs if run.environment is not None]
    names = list(dict.fromkeys(key for block in blocks for key in block))
    differ = []
    for name in names:
        values = list(dict.fromkeys(repr(block.get(name)) for block in blocks))
        if len(values) > 1:
            differ.append(f"{name} " + " vs ".join(v.strip("'") for v in values))
    if not differ:
        return None
    return f"{result.arm.label}: its runs ran in different environments ({'; '.join(differ)}): their numbers may differ for that alone"


def eps_warning(result: ArmResult) -> str | None:
    """One line naming the norm slots of the arm that were eps-dominated at some telemetry step (norm/eps_ratio
    below 1: the norm's ε exceeds its input's mean square), with their steps; None when there are none."""
    steps: dict[str, list[int]] = {}
    for run in result.runs:
        for row in run.rows:
            for key, value in row.items():
                if key.startswith(EPS_RATIO_PREFIX) and isinstance(value, (int, float)) and value < 1:
                    steps.setdefault(key[len(EPS_RATIO_PREFIX):], []).append(row.get("step"))
    if not steps:
        return None
    slots = ", ".join(f"{loc} (step {min(s)}{'' if min(s) == max(s) else f'–{max(s)}'})" for loc, s in steps.items())
    return (f"{result.arm.label}: eps-dominated norms, input RMS below where eps takes over ({EPS_RATIO_PREFIX}* < 1): "
            f"{slots}; they scale by a gain eps sets instead of normalizing, so the arm is not the norm it names there")


def _once_each(members: list[Run], keys: list[str], notes: list[str]) -> list[Run]:
    """An arm's runs with each training counted once: of runs at the same lr and seed that differ only in
    keys their choices make them not read (config.reads_key: a norm knob of another norm, mix_p without
    placement=mix; arm_of leaves those out), the first is kept and the others noted. Runs of one config at
    one lr and seed (a sweep run twice) are one already (repeats.py)."""
    first: dict[tuple, Run] = {}
    kept = []
    for run in members:
        twin = first.setdefault((run.lr, run.seed), run)
        unread = [k for k in keys if twin.settings.get(k) != run.settings.get(k)]
        if twin is not run and unread:
            notes.append(f"{run.path.name}: the same training as {twin.path.name} (it does not read "
                         f"{', '.join(unread)}): counted once")
            continue
        kept.append(run)
    return kept


def comparison_measure(runs: list[Run]) -> str:
    """val_bpb when the runs' tokenizers differ (their losses per token are not comparable), else val_loss."""
    return "val_bpb" if len({run.tokenizer for run in runs}) > 1 else "val_loss"
