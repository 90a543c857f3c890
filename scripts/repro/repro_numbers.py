"""The numbers of a CPU-size reproduction, read from its run dirs (normlab.analysis, as `normlab compare`).

lr      per arm (norm × placement × QK-norm ...), the final validation loss at each peak lr, ℓ₀, ℓ*, the best lr
        and Wortsman et al. 2023's LR sensitivity (and, where the arms ran different lrs, the sensitivity over
        the lrs every arm ran, so that the arms can be compared); then the largest attention logit (max over layers of
        attn/logit_max at the last telemetry step) at each lr, and DyT's final α per slot kind where there is one;
        with --figure, a PNG of the final validation loss against lr, one line per arm.
curves  per run, the validation loss at each evaluation, and the gradient norm of the first block's MLP over
        the last block's (grad/norm/LXX/mlp) at each telemetry step; with --figure, a PNG of the training
        loss (and the validation loss) against step, one line per run.

Arms are labelled as `normlab compare` labels them, less the norm knobs a norm does not read (compare
splits LayerNorm from DyT by DyT's α too, and shows LayerNorm's unread α).

usage: python scripts/repro/repro_numbers.py {lr,curves} SWEEP_DIR... [--figure PNG] [--title TEXT]
"""

from __future__ import annotations

import argparse
import math
import re
import textwrap
from pathlib import Path

from normlab.analysis import Arm, ArmResult, Comparison, Run, build_comparison, find_run_dirs, lr_sensitivity
from normlab.config import NORM_TRAITS, format_lr

LOGIT_MAX = re.compile(r"^attn/logit_max/L\d+$")
MLP_GRAD = re.compile(r"^grad/norm/L(\d+)/mlp$")
# DyT's α per slot: norm1 is the attention's input norm, norm2 the MLP's, norm_f the final one.
ALPHA_SLOTS = {"attention": re.compile(r"^norm/alpha/L\d+/norm1$"), "MLP": re.compile(r"^norm/alpha/L\d+/norm2$"),
               "final": re.compile(r"^norm/alpha/norm_f$")}  # fmt: skip


def arm_label(arm: Arm) -> str:
    """compare's label without the `norm.KNOB=...` of knobs the arm's norm does not read."""
    knobs = NORM_TRAITS[arm.norm].knobs if arm.norm in NORM_TRAITS else ()
    extras = [(k, v) for k, v in arm.extras if not k.startswith("norm.") or k.removeprefix("norm.") in knobs]
    return " ".join([f"{arm.norm}-{arm.placement}", *(f"{k}={v}" for k, v in extras)])


def cell(value: float) -> str:
    if value is None or math.isnan(value):
        return "—"
    return "diverged" if math.isinf(value) else f"{value:.3f}"


def last_row_with(run: Run, pattern: re.Pattern) -> dict:
    """The last metrics row holding a key that matches `pattern` (empty if none)."""
    return next((row for row in reversed(run.rows) if any(pattern.match(k) for k in row)), {})


def logit_max(run: Run) -> float:
    """The largest attention logit over the layers at the run's last telemetry step; NaN without telemetry."""
    row = last_row_with(run, LOGIT_MAX)
    values = [float(v) for k, v in row.items() if LOGIT_MAX.match(k)]
    return max(values) if values else math.nan


def mean_alpha(run: Run, slot: re.Pattern) -> float:
    row = last_row_with(run, slot)
    values = [float(v) for k, v in row.items() if slot.match(k)]
    return sum(values) / len(values) if values else math.nan


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def lr_report(comparison: Comparison) -> None:
    """Print the loss-by-lr table with the LR sensitivity, the logit table, and DyT's α if any arm has one."""
    lrs = sorted({p.lr for arm in comparison.arms for p in arm.points})
    common = sorted(set.intersection(*({p.lr for p in arm.points if p.counted} for arm in comparison.arms)))
    header = ["arm", *(format_lr(lr) for lr in lrs), "ℓ₀", "ℓ*", "best lr", "LR sensitivity"]
    if common != lrs:
        header.append(f"LR sensitivity over {', '.join(map(format_lr, common))}")
    rows = []
    for arm in comparison.arms:
        loss = {p.lr: p.loss for p in arm.points if p.counted}
        rows.append([arm_label(arm.arm), *(cell(loss.get(lr, math.nan)) for lr in lrs), cell(arm.init_loss),
                     cell(arm.best_loss), format_lr(arm.best_lr) if math.isfinite(arm.best_lr) else "—",
                     cell(arm.sensitivity)])  # fmt: skip
        if common != lrs:
            rows[-1].append(cell(lr_sensitivity({lr: loss[lr] for lr in common}, arm.init_loss)))
    print_table("final validation loss (nats per byte; mean over seeds) by peak lr", header, rows)
    logits = [[arm_label(arm.arm), *(f"{point_mean(arm, lr, logit_max):.3g}" for lr in lrs)] for arm in comparison.arms]
    print_table("largest attention logit at the last telemetry step (max over layers)", ["arm", *header[1:len(lrs) + 1]], logits)
    alpha_arms = [arm for arm in comparison.arms if any(ALPHA_SLOTS["attention"].match(k) for r in arm.runs for row in r.rows[:1] for k in row)]
    for arm in alpha_arms:
        rows = [[slot, *(f"{point_mean(arm, lr, lambda r, p=pattern: mean_alpha(r, p)):.3f}" for lr in lrs)]
                for slot, pattern in ALPHA_SLOTS.items()]  # fmt: skip
        print_table(f"{arm_label(arm.arm)}: α at the end (mean over the slots of a kind)", ["slot", *header[1:len(lrs) + 1]], rows)


def point_mean(arm: ArmResult, lr: float, value) -> float:
    """The mean of `value(run)` over the arm's runs at `lr` (NaN where there is none)."""
    values = [value(run) for point in arm.points if point.lr == lr for run in point.runs]
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def run_label(comparison: Comparison, run: Run) -> str:
    """The arm's label with the lr: what a curve is called."""
    return f"{arm_label(comparison.arm_of[run.path])} lr={format_lr(run.lr)}"


def curves_report(comparison: Comparison, figure: Path | None, title: str) -> None:
    """Print each run's validation losses by step, and draw the loss curves into `figure`."""
    steps = sorted({s for run in comparison.runs for s in run.curve(run.measure)[0]})
    rows = []
    for run in comparison.runs:
        by_step = dict(zip(*run.curve(run.measure)))
        rows.append([run_label(comparison, run), *(cell(by_step.get(s, math.nan)) for s in steps), run.status])
    print_table("validation loss (nats per byte) by step", ["run", *map(str, steps), "status"], rows)
    ratios = {run_label(comparison, run): first_over_last_mlp_grad(run) for run in comparison.runs}
    steps = sorted({s for by_step in ratios.values() for s in by_step})
    rows = [[label, *(f"{by_step[s]:.2g}" if s in by_step else "—" for s in steps)] for label, by_step in ratios.items()]
    print_table("first block's MLP gradient norm / last block's, by telemetry step", ["run", *map(str, steps)], rows)
    if figure is not None:
        draw_curves(comparison, figure, title)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, figure: Path, title: str) -> None:
    fig.suptitle(textwrap.fill(title, 90), fontsize=10)
    fig.set_layout_engine("constrained")
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)
    pyplot().close(fig)
    print(f"\nfigure: {figure}")


def draw_loss_vs_lr(comparison: Comparison, figure: Path, title: str) -> None:
    """Final validation loss against peak lr, a line per arm; a diverged or failed lr is an x at the arm's ℓ₀."""
    from matplotlib.ticker import NullFormatter

    fig, ax = pyplot().subplots(figsize=(8, 5))
    for arm in comparison.arms:
        points = [(p.lr, p.loss) for p in arm.points if p.counted]
        shown = [(lr, loss if math.isfinite(loss) else arm.init_loss) for lr, loss in points]
        (line,) = ax.plot(*zip(*shown), "o-", linewidth=1.4, markersize=4, label=arm_label(arm.arm))
        lost = [(lr, arm.init_loss) for lr, loss in points if math.isinf(loss)]
        if lost:
            ax.plot(*zip(*lost), "x", color=line.get_color(), markersize=9, markeredgewidth=2, label="diverged (at ℓ₀)")
    lrs = sorted({p.lr for arm in comparison.arms for p in arm.points})
    ax.set_xscale("log")
    ax.set_xticks(lrs, [format_lr(lr) for lr in lrs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss (nats per byte)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="best")
    save(fig, figure, title)


def first_over_last_mlp_grad(run: Run) -> dict[int, float]:
    """{step: grad/norm/L00/mlp / grad/norm/L<last>/mlp} at every telemetry step of the run."""
    ratios = {}
    for row in run.rows:
        by_layer = {int(m.group(1)): float(v) for k, v in row.items() if (m := MLP_GRAD.match(k))}
        if by_layer and by_layer[max(by_layer)] > 0:
            ratios[row["step"]] = by_layer[min(by_layer)] / by_layer[max(by_layer)]
    return ratios


def draw_curves(comparison: Comparison, figure: Path, title: str) -> None:
    fig, (train_ax, val_ax) = pyplot().subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for run in comparison.runs:
        label = run_label(comparison, run)
        steps, losses = run.curve("loss")
        (line,) = train_ax.plot(steps, losses, linewidth=1.2, label=label)
        val_ax.plot(*run.curve(run.measure), "o-", color=line.get_color(), linewidth=1.2, markersize=3)
    train_ax.set_title("training loss", fontsize=10)
    val_ax.set_title("validation loss", fontsize=10)
    for ax in (train_ax, val_ax):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    train_ax.set_ylabel("loss (nats per byte)")
    train_ax.set_ylim(top=min(4.0, train_ax.get_ylim()[1]))
    val_ax.legend(*train_ax.get_legend_handles_labels(), fontsize=8, loc="upper right")
    save(fig, figure, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("lr", "curves"))
    parser.add_argument("sweeps", nargs="+", help="sweep dirs (or run dirs) of the reproduction")
    parser.add_argument("--figure", type=Path, help="the PNG to draw (loss against lr, or loss curves)")
    parser.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args()
    comparison = build_comparison(find_run_dirs(args.sweeps))
    for note in comparison.notes:
        print(f"note: {note}")
    if args.kind == "lr":
        lr_report(comparison)
        if args.figure is not None:
            draw_loss_vs_lr(comparison, args.figure, args.title)
    else:
        curves_report(comparison, args.figure, args.title)


if __name__ == "__main__":
    main()
