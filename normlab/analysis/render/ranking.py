"""The answer at a glance: the arms ranked by their best final validation loss, with their LR sensitivity,
losses and stability, as the table report.md opens with and `normlab compare` prints.

A value that does not exist is an em dash; where the reason is not obvious (an LR sensitivity with
one learning rate), the dash carries a footnote mark and the footnote says why.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

from normlab.analysis.stats.arms import ArmResult, mean_std, sensitivity_reason, setting_text
from normlab.analysis.stats.bracketing import edge
from normlab.analysis.stats.comparison import Comparison
from normlab.analysis.stats.factors import factor_line
from normlab.analysis.stats.gaps import interval_text, over, signed, verdict
from normlab.analysis.read.runs import MEASURES
from normlab.analysis.stats.stability import SPIKE_K, SPIKE_WINDOW
from normlab.analysis.render.terminal import WIDTH, fitted
from normlab.config import format_lr

MISSING = "—"
MARKS = "¹²³⁴⁵⁶⁷⁸⁹"
HEADER = ("rank", "arm", "final val loss", "seeds", "best lr", "gap to best", "95% interval", "vs best",
          "LR sensitivity", "diverged/failed", "max grad norm", "max attn logit", "loss spikes")  # fmt: skip


def number(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else MISSING


def figure(value: float) -> str:
    """A stability figure: three significant digits, whole numbers without a decimal point."""
    if not math.isfinite(value):
        return MISSING
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def header(comparison: Comparison) -> tuple[str, ...]:
    return tuple(c.replace("val loss", MEASURES[comparison.measure]) for c in HEADER)


def ranking(comparison: Comparison) -> tuple[list[list[str]], list[str]]:
    """The ranked table's rows (cells as text) and its footnotes, each footnote once, marked ¹, ², ..."""
    footnotes: list[str] = []

    def dash(note: str) -> str:
        """An em dash with the mark of `note`, which says why the value does not exist."""
        if note not in footnotes:
            footnotes.append(note)
        return MISSING + MARKS[min(footnotes.index(note), len(MARKS) - 1)]

    rows = []
    for rank, result in enumerate(comparison.ranked, start=1):
        reason = sensitivity_reason(result)
        rows.append([
            str(rank) if math.isfinite(result.best_loss) else MISSING,
            result.arm.label,
            *_best_cells(result),
            *_gap_cells(comparison, result),
            number(result.sensitivity) if reason is None else dash(f"LR sensitivity: {reason}."),
            f"{result.n_lost} of {result.n_counted}",
            *_stability_cells(result, dash),
        ])  # fmt: skip
    return rows, [f"{MARKS[min(i, len(MARKS) - 1)]} {note}" for i, note in enumerate(footnotes)]


def _best_cells(result: ArmResult) -> list[str]:
    """final val loss (mean ± std over the seeds at the best lr), seeds, best lr."""
    point = result.best_point
    if point is None:
        return [MISSING, MISSING, MISSING]
    mean, std = mean_std(point.finished_losses)
    loss = f"{mean:.4f} ± {std:.4f}" if math.isfinite(std) else number(mean)
    at = edge(result)
    return [loss, str(len(point.finished_losses)), format_lr(point.lr) + (f" ({at})" if at else "")]


def _gap_cells(comparison: Comparison, result: ArmResult) -> list[str]:
    """gap to best, its 95% interval and what it is over, and whether it is within noise of the best."""
    if result is comparison.ranked[0] and result.best_point is not None:
        return ["best", MISSING, MISSING]
    gap = comparison.gaps.get(result.arm)
    if gap is None:
        return [MISSING, MISSING, MISSING]
    if not gap.has_interval:
        return [signed(gap.diff), over(gap), MISSING]
    side = "within noise" if gap.covers_zero else "worse" if gap.low > 0 else "better"
    return [signed(gap.diff), f"{interval_text(gap)} {over(gap)}", side]


def _stability_cells(result: ArmResult, dash) -> list[str]:
    """max grad norm, max attn logit, loss spikes; `dash(note)` gives the em dash of a figure no run measured."""
    stability = result.stability
    if stability is None:
        return [MISSING] * 3
    logit = figure(stability.max_attn_logit)
    if logit == MISSING:
        logit = dash("max attn logit: no run of the arm logged per-layer `attn/logit_max` telemetry (telemetry.every=0, or metrics.csv).")
    if stability.spikes is None:
        spikes = dash(f"loss spikes: no run of the arm logged more than {SPIKE_WINDOW} training losses, too few to tell a spike.")
    else:
        spikes = str(stability.spikes)
        if stability.spikes:
            spikes += f" ({stability.runs_with_spikes} of {stability.runs_checked} runs)"
    return [figure(stability.max_grad_norm), logit, spikes]


def definitions(comparison: Comparison) -> str:
    """What each column of the ranked table means, as one paragraph."""
    measure = MEASURES[comparison.measure]
    return (
        f"Arms ranked by their final {measure} at their best learning rate: the mean ± sample std over its "
        f"seeds at the lr whose seed mean is lowest among the lrs where no seed diverged or failed; (largest), "
        "(smallest) or (only) when that lr is at the edge of the lrs the arm ran, so its optimum may lie beyond "
        "them. Gap to best: the arm's loss minus the best arm's, each at its own best lr, with a 95% t interval, "
        "paired over the seeds both ran when they share two or more, else Welch's; none when either ran one "
        "seed. Within noise: the interval covers 0. The intervals are per comparison, not adjusted for the "
        "number of arms. LR "
        "sensitivity (Wortsman et al. 2023) is over all the arm's lrs (see below); diverged/failed counts "
        "its runs that ended. Stability is over every run of the arm (all lrs and seeds), up to any "
        "divergence: max grad norm is the largest logged global gradient norm (`grad_norm`, before "
        "clipping); max attn logit the largest pre-softmax attention logit of any block "
        "(`attn/logit_max/L..` telemetry; — without it); loss spikes counts the logged training losses "
        f"above the mean of the {SPIKE_WINDOW} logged losses before them by more than {SPIKE_K:g} of their "
        "standard deviations (OLMo-core's StabilityMonitorCallback rule; — when no run logged more than "
        f"{SPIKE_WINDOW} losses)."
    )


def answer(comparison: Comparison) -> str:
    """The one-line answer: the best arm, its lr and loss; or why there is none."""
    if not comparison.arms:
        return "No run trained: every run failed before its first step (see Did not start)."
    best = comparison.ranked[0]
    if not math.isfinite(best.best_loss) or best.best_point is None:
        return "No arm has a learning rate at which every seed finished: no arm can be ranked."
    mean, _ = mean_std(best.best_point.finished_losses)
    seeds = len(best.best_point.finished_losses)
    sure = verdict(comparison.ranked, comparison.gaps)
    return (f"Best: {best.arm.label} at lr={format_lr(best.best_lr)}, final {MEASURES[comparison.measure]} "
            f"{mean:.4f} ({seeds} seed{'s' if seeds != 1 else ''}).{' ' + sure if sure else ''}")


def common_line(comparison: Comparison, code: bool = False) -> str:
    """The settings every run shares, `key=value` each (as Markdown code spans with `code`)."""
    items = [f"`{setting_text(k, v)}`" if code else setting_text(k, v) for k, v in comparison.common]
    return "Common settings (every run): " + (" ".join(items) or MISSING)


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def terminal_summary(comparison: Comparison, shown_not_started: int = 5) -> list[str]:
    """What `normlab compare` prints before the report's path: the answer, the ranked table, its footnotes,
    the common settings, the warnings (environments, eps-dominated norms), the run dirs skipped as unreadable
    and the runs that did not start."""
    rows, footnotes = ranking(comparison)
    lines = [f"{count(len(comparison.runs), 'run')} in {count(len(comparison.arms), 'arm')}. {answer(comparison)}"]
    if rows:
        gap_columns = tuple(HEADER.index(c) for c in ("gap to best", "95% interval", "vs best"))
        lines += ["", *fitted(header(comparison), rows, together=(gap_columns,)), *footnotes]
    lines += [f"note: {caveat}" for caveat in comparison.caveats]
    if comparison.effects:
        lines += ["", "Factor effects (each level minus the best level, matched settings, 95% interval):"]
        lines += [f"  {factor_line(effect)}" for effect in comparison.effects]
    lines += ["", *textwrap.wrap(common_line(comparison), WIDTH, subsequent_indent="  ", break_long_words=False,
                                 break_on_hyphens=False)]  # fmt: skip
    lines += [f"warning: {w}" for w in comparison.warnings]
    lines += comparison.skipped
    for run in comparison.not_started[:shown_not_started]:
        lines.append(f"did not start: {comparison.run_label(run)}: {run.error}")
    if len(comparison.not_started) > shown_not_started:
        lines.append(f"did not start: {len(comparison.not_started) - shown_not_started} more (see report.md)")
    return lines


def markdown_table(head: tuple[str, ...] | list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table; a `|` inside a cell is escaped."""
    cells = [[str(c).replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in cells]
