"""The depth reproduction's numbers and figure (conf/experiment/depth_cpu.yaml, depth_gpu.yaml), read from its
run dirs with normlab.analysis.load_runs.

Per placement (at its best lr, the lowest mean final validation loss, where a sweep ran several): the final
validation loss, mean ± sample std over seeds; the block angle (act/block_angle: degrees between a block's input
and output residual stream, averaged over tokens) of the first and the last block at the end; the largest
max/median ratio of the residual stream over the blocks (act/max_median: a token's largest |activation| over its
median one, the token centred over its features first), at initialization and at the end; the stream's RMS after the last block at the end. Then the block
angle of every block at the first and the last telemetry step, and at the end, where the runs logged them, the
last token's block angle (act/block_angle_last) and Sun et al.'s top/median ratio (act/top_median) per block, and
the norm slots that were eps-dominated (norm/eps_ratio below 1) at each telemetry step. Every per-block figure is
the mean over seeds.

With --figure, a PNG of the block angle against the block index, one line per placement (mean over seeds, band
min to max), at initialization and at the end.

usage: python scripts/repro/depth_block_angle.py SWEEP_DIR... [--figure PNG] [--title TEXT]
"""

from __future__ import annotations

import argparse
import math
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path

from normlab.analysis import CompareError, Run, load_runs, mean_std, order_key
from normlab.config import PLACEMENTS, format_lr

BLOCK_ANGLE = "act/block_angle"
MAX_MEDIAN = "act/max_median"
RESID_RMS = "act/resid_rms"
EPS_RATIO = "norm/eps_ratio/"  # a norm slot's input RMS / sqrt(eps): below 1, eps-dominated
# The papers' own quantities, tabled per block when the runs logged them.
PAPER_VARIANTS = (("act/block_angle_last", "last token's block angle (°), the Curse of Depth's angular distance × 180"),
                  ("act/top_median", "top |activation| / median of each sequence (Sun et al.'s massive-activation ratio)"))
# The order of the table's rows and the figure's lines: Pre-LN first, then the arms that change it, Post-LN last.
ORDER = ("pre", "lns", "sandwich", "reordered", "post")
# What each placement is called in the papers the reproduction is about.
PAPER_NAMES = {"pre": "Pre-LN", "post": "Post-LN", "sandwich": "Peri-LN", "reordered": "OLMo 2",
               "lns": "LayerNorm Scaling"}  # fmt: skip


@dataclass
class Arm:
    """The runs of one placement at one lr: one per seed."""

    placement: str
    lr: float
    runs: list[Run]

    @property
    def label(self) -> str:
        name = PAPER_NAMES.get(self.placement)
        return f"{self.placement} ({name})" if name else self.placement

    @property
    def losses(self) -> list[float]:
        losses = [run.final_val_loss for run in self.runs if run.status == "completed"]
        return [loss for loss in losses if math.isfinite(loss)]

    @property
    def mean_loss(self) -> float:
        return mean_std(self.losses)[0]

    def profile(self, stat: str, which: str) -> dict[int, list[float]]:
        """{block index: [each run's value]} of per-layer statistic `stat` at the 'first' or 'last' telemetry step."""
        values: dict[int, list[float]] = {}
        for run in self.runs:
            for layer, value in run.layer_profile(stat, which).items():
                values.setdefault(layer, []).append(value)
        return dict(sorted(values.items()))

    def mean_profile(self, stat: str, which: str) -> dict[int, float]:
        return {layer: statistics.fmean(v) for layer, v in self.profile(stat, which).items()}


def arms_at_best_lr(runs: list[Run]) -> list[Arm]:
    """One arm per placement, in normlab's order of placements: its runs at the lr of lowest mean final val loss
    (the lowest lr where no lr has a finite one)."""
    by_key: dict[tuple[str, float], list[Run]] = {}
    for run in runs:
        by_key.setdefault((run.placement, run.lr), []).append(run)
    arms = [Arm(placement, lr, sorted(group, key=lambda r: r.seed or 0)) for (placement, lr), group in by_key.items()]
    best: dict[str, Arm] = {}
    for arm in sorted(arms, key=lambda a: a.lr):
        held = best.get(arm.placement)
        if held is None or (math.isfinite(arm.mean_loss) and not arm.mean_loss >= held.mean_loss):
            best[arm.placement] = arm
    known = (*ORDER, *(p for p in PLACEMENTS if p not in ORDER))
    return sorted(best.values(), key=lambda a: order_key(a.placement, known))


def number(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}g}" if math.isfinite(value) else "—"


def loss_cell(arm: Arm) -> str:
    mean, std = mean_std(arm.losses)
    if not math.isfinite(mean):
        return "—"
    return f"{mean:.3f} ± {std:.3f}" if math.isfinite(std) else f"{mean:.3f}"


def runs_cell(arm: Arm) -> str:
    """The number of runs, and those that did not complete ('2 (1 diverged)')."""
    statuses = [run.status for run in arm.runs if run.status != "completed"]
    others = ", ".join(f"{statuses.count(s)} {s}" for s in sorted(set(statuses)))
    return f"{len(arm.runs)} ({others})" if others else str(len(arm.runs))


def largest(profile: dict[int, float]) -> str:
    """'value (block n)' of a seed-mean profile's largest value; blocks are 1-based."""
    if not profile:
        return "—"
    layer = max(profile, key=profile.get)
    return f"{number(profile[layer])} (block {layer + 1})"


def end_angles(arm: Arm) -> str:
    angles = arm.mean_profile(BLOCK_ANGLE, "last")
    return f"{angles[min(angles)]:.1f} / {angles[max(angles)]:.1f}" if angles else "—"


def summary_table(arms: list[Arm]) -> list[str]:
    """The markdown table of final losses, end-of-run block angles and max/median ratios, one row per placement."""
    columns = ["placement", "lr", "seeds", "final val loss (mean ± std over seeds)",
               "block angle at the end, first / last block (°)", "max/median at init, largest over blocks",
               "max/median at the end, largest over blocks", "stream RMS after the last block, end"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for arm in arms:
        rms = arm.mean_profile(RESID_RMS, "last")
        cells = [arm.label, format_lr(arm.lr), runs_cell(arm), loss_cell(arm), end_angles(arm),
                 largest(arm.mean_profile(MAX_MEDIAN, "first")), largest(arm.mean_profile(MAX_MEDIAN, "last")),
                 number(rms[max(rms)]) if rms else "—"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def layer_table(arms: list[Arm], stat: str, which: str) -> list[str]:
    """The markdown table of `stat` per block (1-based) at the 'first' or 'last' telemetry step, mean over seeds."""
    profiles = [(arm, arm.mean_profile(stat, which)) for arm in arms]
    layers = sorted({layer for _, profile in profiles for layer in profile})
    lines = ["| placement | " + " | ".join(str(layer + 1) for layer in layers) + " |",
             "| --- |" + " --- |" * len(layers)]  # fmt: skip
    for arm, profile in profiles:
        lines.append(f"| {arm.label} | " + " | ".join(number(profile.get(layer, math.nan)) for layer in layers) + " |")
    return lines


def telemetry_steps(arm: Arm, which: str) -> str:
    """The telemetry steps (of the arm's runs) that `which` ('first', 'last') picks."""
    series = [run.layer_series(BLOCK_ANGLE) for run in arm.runs]
    steps = sorted({rows[0 if which == "first" else -1][0] for rows in series if rows})
    return ", ".join(map(str, steps)) or "none"


def pyplot():
    # matplotlib only for --figure: the tables need none of it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


ANGLE_TICKS = (0.1, 0.3, 1, 3, 10, 30, 90)  # degrees, on the log scale of the figure


def draw(arms: list[Arm], figure: Path, title: str) -> None:
    """Block angle against block index on a log scale (a deep block near the identity sits a few degrees above 0),
    one line per placement (mean over seeds, band min to max), at init and at the end."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator  # with pyplot: only for --figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), sharey=True)
    colors = {arm.placement: f"C{i}" for i, arm in enumerate(arms)}  # one colour per placement in both panels
    for ax, which, name in zip(axes, ("first", "last"), ("at initialization (step 0)", "at the end (last step)")):
        for arm in arms:
            profile = arm.profile(BLOCK_ANGLE, which)
            blocks = [layer + 1 for layer in profile]
            ax.plot(blocks, [statistics.fmean(v) for v in profile.values()], "o-", color=colors[arm.placement],
                    linewidth=1.5, markersize=3.5, label=f"{arm.label}, lr {format_lr(arm.lr)}")  # fmt: skip
            ax.fill_between(blocks, [min(v) for v in profile.values()], [max(v) for v in profile.values()],
                            color=colors[arm.placement], alpha=0.15, linewidth=0)  # fmt: skip
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("block (1 = first)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted({layer + 1 for arm in arms for layer in arm.profile(BLOCK_ANGLE, which)}))
    axes[0].yaxis.set_major_locator(FixedLocator(ANGLE_TICKS))
    axes[0].yaxis.set_minor_locator(NullLocator())
    axes[0].yaxis.set_minor_formatter(NullFormatter())
    axes[0].set_yticklabels([f"{t:g}" for t in ANGLE_TICKS])
    axes[0].set_ylabel("angle between the block's input and output (°)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(arms), 3), fontsize=8, frameon=False)
    fig.suptitle(textwrap.fill(title, 100), fontsize=10)
    fig.set_layout_engine("constrained")
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)
    plt.close(fig)
    print(f"\nfigure: {figure}")


def report(arms: list[Arm]) -> bool:
    """Print the tables; False (and one line saying so) if no run logged the block angle."""
    print("\n".join(summary_table(arms)))
    if not any(arm.profile(BLOCK_ANGLE, "last") for arm in arms):
        print(f"\nno {BLOCK_ANGLE} in these runs (telemetry.every=0, or a normlab that does not log it): no figure")
        return False
    for which, name in (("first", "initialization"), ("last", "the end")):
        steps = "; ".join(f"{arm.placement} {telemetry_steps(arm, which)}" for arm in arms)
        print(f"\nblock angle (°) per block at {name} (telemetry step: {steps}), mean over seeds:\n")
        print("\n".join(layer_table(arms, BLOCK_ANGLE, which)))
    print("\nmax/median of the stream after each block at the end, mean over seeds:\n")
    print("\n".join(layer_table(arms, MAX_MEDIAN, "last")))
    for stat, what in PAPER_VARIANTS:
        if any(arm.profile(stat, "last") for arm in arms):
            print(f"\n{what} ({stat}) per block at the end, mean over seeds:\n")
            print("\n".join(layer_table(arms, stat, "last")))
    lines = [line for arm in arms if (line := eps_dominated(arm))]
    if lines:
        print("\neps-dominated norms (norm/eps_ratio below 1: input RMS below sqrt(eps)):\n")
        print("\n".join(lines))
    return True


def eps_dominated(arm: Arm) -> str | None:
    """One line naming, per telemetry step, the arm's norm slots whose input RMS was below sqrt(eps) in some seed,
    with the smallest ratio; None when none was (or the runs predate norm/eps_ratio)."""
    by_step: dict[int, dict[str, float]] = {}
    for run in arm.runs:
        for row in run.rows:
            for key, value in row.items():
                if key.startswith(EPS_RATIO) and isinstance(value, (int, float)) and value < 1:
                    slot = key[len(EPS_RATIO):]
                    slots = by_step.setdefault(row["step"], {})
                    slots[slot] = min(value, slots.get(slot, value))
    if not by_step:
        return None
    steps = "; ".join(f"step {step}: " + ", ".join(f"{slot} {number(v, 2)}" for slot, v in sorted(slots.items()))
                      for step, slots in sorted(by_step.items()))
    return f"- {arm.label}: {steps}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", help="the reproduction's sweep dirs (or run dirs)")
    parser.add_argument("--figure", type=Path, help="the PNG to draw: block angle per block, at init and at the end")
    parser.add_argument("--title", default="Block angle per block, one line per placement (mean over seeds)")
    args = parser.parse_args()
    try:
        arms = arms_at_best_lr(load_runs(*args.sweeps))
    except CompareError as err:
        raise SystemExit(f"depth_block_angle: {err}") from None
    if not arms:
        raise SystemExit(f"depth_block_angle: no run dirs under {' '.join(args.sweeps)}")
    if report(arms) and args.figure is not None:
        draw(arms, args.figure, args.title)


if __name__ == "__main__":
    main()
