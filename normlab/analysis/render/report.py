"""report.md: the answer first (the ranked arms, ranking.py), then the details as Markdown tables (runs,
LR sensitivity, seeds), the plots and the notes.

Numbers are printed from the same values the run dirs hold: losses to 4 decimals,
throughput to whole tokens/s. A value that does not exist (no final loss for a
diverged run, no divergence step for a completed one) is an em dash, never NaN.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from normlab.analysis.stats.arms import mean_std
from normlab.analysis.stats.comparison import Comparison
from normlab.analysis.render.effects_section import effects_section
from normlab.analysis.render.figures import Layout
from normlab.analysis.render.plots import FOCUS, Plot
from normlab.analysis.render.ranking import answer, common_line, definitions, markdown_table, ranking
from normlab.analysis.render.ranking import header as ranking_header
from normlab.analysis.read.runs import MEASURES
from normlab.config import NORM_TRAITS, format_lr

MISSING = "—"
RUN_COLUMNS = (
    "run", "norm", "placement", "depth", "lr", "seed",
    "final val loss", "best val loss", "status", "diverged at step", "tokens/s",
)  # fmt: skip


def loss_cell(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else MISSING


def mean_std_cell(values: list[float]) -> str:
    mean, std = mean_std(values)
    if not math.isfinite(mean):
        return MISSING
    return f"{mean:.4f} ± {std:.4f}" if math.isfinite(std) else f"{mean:.4f}"


def _cell(value: Any) -> str:
    return MISSING if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def code(text: Any, in_table: bool = False) -> str:
    """`text` as a Markdown code span, whatever backticks it holds (CommonMark: a fence of one backtick more than
    its longest run of them, and a space inside where the text starts or ends with one); a newline as a space,
    and in a table cell `|` escaped."""
    text = str(text).replace("\n", " ")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    span = f"{fence}{pad}{text}{pad}{fence}"
    return span.replace("|", "\\|") if in_table else span


def runs_section(comparison: Comparison) -> list[str]:
    rows = []
    for run in comparison.runs:
        tokens_per_s = run.tokens_per_s
        rows.append([
            code(comparison.run_label(run), in_table=True),
            _cell(run.norm),
            _cell(run.placement),
            _cell(run.depth),
            format_lr(run.lr) if math.isfinite(run.lr) else MISSING,
            _cell(run.seed),
            loss_cell(run.final_val_loss),
            loss_cell(run.best_val_loss),
            run.status,
            _cell(run.diverged_step),
            f"{tokens_per_s:.0f}" if math.isfinite(tokens_per_s) else MISSING,
        ])  # fmt: skip
    lines = ["## Runs", "", *markdown_table(_in_measure(RUN_COLUMNS, comparison), rows)]
    incomplete = [run for run in comparison.runs if run.status == "incomplete"]
    if incomplete:
        lines += ["", "Incomplete runs (no summary.json: killed, or still running):", ""]
        lines += [f"- {code(comparison.run_label(r))}: last step {_cell(r.last_step)}" for r in incomplete]
    failed = [run for run in comparison.runs if run.status == "failed"]
    if failed:
        lines += ["", "Failed runs:", ""]
        lines += [f"- {code(comparison.run_label(r))}: {_cell(r.summary.get('error', 'no error recorded'))}" for r in failed]
    return lines


def sensitivity_section(comparison: Comparison) -> list[str]:
    rows = []
    for result in comparison.arms:
        lrs = [p.lr for p in result.points if p.counted]
        lost = sum(p.n_lost for p in result.points)
        spread = f"{result.sensitivity_std:.4f} ({result.n_seeds_for_std} seeds)" if result.n_seeds_for_std else MISSING
        rows.append([
            result.arm.label,
            ", ".join(format_lr(lr) for lr in lrs) or MISSING,
            loss_cell(result.init_loss),
            loss_cell(result.best_loss),
            format_lr(result.best_lr) if math.isfinite(result.best_lr) else MISSING,
            loss_cell(result.sensitivity),
            spread,
            f"{lost} of {sum(len(p.counted) for p in result.points)}",
        ])  # fmt: skip
    header = ("arm", "learning rates", "ℓ₀ (init)", "ℓ* (best)", "best lr", "LR sensitivity", "std over seeds", "diverged/failed")
    lines = [
        "## LR sensitivity",
        "",
        "Wortsman et al. 2023: LR sensitivity = mean over the arm's learning rates η of "
        "[min(ℓ(η), ℓ₀) − ℓ*]. ℓ(η) is the final validation loss at peak lr η, averaged over seeds; "
        "a diverged or failed run counts as +∞, so it contributes ℓ₀ − ℓ*. ℓ₀ is the validation loss "
        "at initialization (step 0), averaged over the arm's runs; ℓ* is the arm's best ℓ(η). Lower "
        "means less sensitive to the learning rate. The std column is the spread of the sensitivity "
        "computed per seed, over the seeds that ran every learning rate.",
        "",
        *markdown_table(header, rows),
    ]
    lr_sets = {tuple(p.lr for p in r.points if p.counted) for r in comparison.arms}
    if len(lr_sets) > 1:
        lines += ["", "The arms were not swept over the same learning rates: their sensitivities are not directly comparable."]
    return lines


def seeds_section(comparison: Comparison) -> list[str]:
    """Mean ± std over seeds at each (arm, lr) that ran more than one seed; empty if none did."""
    rows = []
    for result in comparison.arms:
        for point in result.points:
            if len(point.runs) < 2:
                continue
            finished = [r for r in point.counted if math.isfinite(r.outcome_loss)]
            rows.append([
                result.arm.label,
                format_lr(point.lr),
                ", ".join(_cell(r.seed) for r in point.runs),
                mean_std_cell(point.finished_losses),
                mean_std_cell([r.best_val_loss for r in finished]),
                str(point.n_lost),
            ])  # fmt: skip
    if not rows:
        return []
    header = _in_measure(("arm", "lr", "seeds", "final val loss", "best val loss", "diverged/failed seeds"), comparison)
    return [
        "## Seeds",
        "",
        "Mean ± sample standard deviation over the seeds that completed; seeds that diverged or failed "
        "are counted in the last column and left out of the mean (the LR sensitivity counts them as +∞).",
        "",
        *markdown_table(header, rows),
    ]


def plots_section(comparison: Comparison, plots: list[Plot]) -> list[str]:
    lines = ["## Plots", "", plots_legend(comparison)]
    for name, traits in NORM_TRAITS.items():
        if traits.batch_statistics and any(run.norm == name for run in comparison.runs):
            lines += [""]
            lines.append(
                f"{traits.title}'s training loss is not causal (batch statistics include later tokens): compare "
                f"{traits.title} arms by validation loss."
            )
    for plot in plots:
        lines += ["", f"### {plot.title[0].upper()}{plot.title[1:]}", ""]
        lines.append(f"Not drawn: {plot.skipped}." if plot.skipped else f"![{plot.title}]({plot.file})")
    if any(p.file.startswith("layers_") and not p.skipped for p in plots):
        lines += ["", "Per-layer plots: the first telemetry row (initialization) and the last one (before divergence, if any)."]
    return lines


def plots_legend(comparison: Comparison) -> str:
    """How the plots tell arms and seeds apart, in one paragraph."""
    layout = Layout([result.arm for result in comparison.arms], comparison.dims)
    ways = [f"colour: {layout.colour_dim}" if layout.colour_dim else "", f"line style: {layout.style_dim}" if layout.style_dim else ""]
    panels = [*layout.panel_dims, "lr (loss curves, per-layer plots)"]
    return (
        f"Arms: {'; '.join(w for w in ways if w) or 'one arm'}; a panel per {', '.join(panels)}. Several seeds are "
        "drawn as their mean with a band from the lowest to the highest seed (one seed: a plain line). Loss curves "
        f"show the training from {FOCUS:.0%} of its steps on (the first steps' fall would flatten the rest). Diverged "
        "runs end at the last step before divergence (×)."
    )


def _in_measure(header: tuple[str, ...], comparison: Comparison) -> tuple[str, ...]:
    return tuple(column.replace("val loss", MEASURES[comparison.measure]) for column in header)


def measure_note(comparison: Comparison) -> list[str]:
    """When the runs' tokenizers differ: a paragraph saying the losses are in bits per byte, and why."""
    if comparison.measure != "val_bpb":
        return []
    tokenizers = sorted({run.tokenizer for run in comparison.runs})
    return [
        "",
        f"The runs use different tokenizers ({', '.join(code(t) for t in tokenizers)}), so their losses per "
        "token are not comparable: every validation loss below (ℓ, ℓ₀, ℓ*, and the LR sensitivity) is in bits "
        "per byte of the validation text (`val_bpb`), not nats per token. The training-loss plot stays per token.",
    ]


def answer_section(comparison: Comparison) -> list[str]:
    """The ranked table of arms, its footnotes and definitions, and the settings every run shares."""
    rows, footnotes = ranking(comparison)
    lines = ["## Ranking", ""]
    lines += [*markdown_table(ranking_header(comparison), rows), ""] if rows else []
    lines += [*footnotes, "" if footnotes else None]
    if comparison.caveats:
        lines += ["What limits this verdict:", "", *(f"- {_cell(caveat)}" for caveat in comparison.caveats), ""]
    lines += [definitions(comparison), "", common_line(comparison, code=True)]
    return [line for line in lines if line is not None]


def _then_blank(lines: list[str]) -> list[str]:
    return [*lines, ""] if lines else []


def warnings_section(comparison: Comparison) -> list[str]:
    """The arms whose runs ran in different environments (summary.json's environment block), and those with
    eps-dominated norms."""
    if not comparison.warnings:
        return []
    return ["## Warnings", "", *(f"- {_cell(w)}" for w in comparison.warnings), ""]


def not_started_section(comparison: Comparison) -> list[str]:
    """The runs that failed before their first step, each with its error: in no arm, no table, no plot."""
    if not comparison.not_started:
        return []
    return [
        "## Did not start",
        "",
        "These runs failed before their first step (no metric row): they are in no arm, table or plot.",
        "",
        *(f"- {code(comparison.run_label(run))}: {_cell(run.error)}" for run in comparison.not_started),
        "",
    ]


def _counted(n: int, noun: str) -> str:
    """'1 run', '2 runs'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def write_report(comparison: Comparison, out: Path, plots: list[Plot], sources: list[str]) -> Path:
    """Write `out`/report.md and return its path: the answer first (the ranked arms), then the details."""
    n_arms = len(comparison.arms)
    lines = [
        "# normlab comparison",
        "",
        f"**{answer(comparison)}**",
        "",
        f"{_counted(len(comparison.runs), 'run')} in {_counted(n_arms, 'arm')}, read from "
        + ", ".join(code(s) for s in sources)
        + f". Run dirs are shown relative to {code(comparison.root)}.",
        *measure_note(comparison),
        "",
        *answer_section(comparison),
        "",
        *_then_blank(effects_section(comparison)),
        *warnings_section(comparison),
        *not_started_section(comparison),
        *runs_section(comparison),
        "",
        *sensitivity_section(comparison),
    ]
    seeds = seeds_section(comparison)
    if seeds:
        lines += ["", *seeds]
    lines += ["", *plots_section(comparison, plots)]
    if comparison.notes:
        lines += ["", "## Notes", "", *(f"- {_cell(note)}" for note in comparison.notes)]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
