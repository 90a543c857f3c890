"""stability.png: each arm's stability figures, one row per arm (best first), one dot per run.

Three panels side by side: the largest gradient norm, the largest attention logit and the number of
loss spikes of each run (stability.py defines them). Within an arm's row each learning rate has its
own colour and height, so the figures' growth with the learning rate reads off the row; a run that
diverged is an × instead of a dot.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from normlab.analysis.stats.comparison import Comparison
from normlab.analysis.render.figures import FONT, Grid, Layout, log_if_wide
from normlab.analysis.stats.stability import SPIKE_K, SPIKE_WINDOW, RunStability, run_stability
from normlab.config import format_lr

PANELS = (
    ("max_grad_norm", "largest gradient norm", "no run logged `grad_norm`"),
    ("max_attn_logit", "largest attention logit", "no run logged `attn/logit_max/L..` telemetry"),
    ("spikes", f"loss spikes (> {SPIKE_K:g} σ over {SPIKE_WINDOW} logged)", f"no run logged more than {SPIKE_WINDOW} losses"),
)  # fmt: skip
ROW = 0.3  # inches per arm


def draw_stability(comparison: Comparison, layout: Layout, path: Path, plot):
    """Draw stability.png into `path`; `plot` (a plots.Plot) gets `skipped` set when there is nothing to draw."""
    ranked = comparison.ranked
    figures = {run.path: run_stability(run) for run in comparison.runs}
    if not any(_value(f, name) is not None for f in figures.values() for name, _, _ in PANELS):
        plot.skipped = "no run logged a gradient norm, attention logits or enough losses"
        return plot
    lrs = sorted({run.lr for run in comparison.runs if math.isfinite(run.lr)})
    palette = colormaps["viridis"]
    colours = {lr: palette(0.85 * i / max(1, len(lrs) - 1)) for i, lr in enumerate(lrs)}
    legend = [Line2D([], [], color=c, marker="o", linestyle="none", label=f"lr={format_lr(lr)}") for lr, c in colours.items()]
    if any(run.status == "diverged" for run in comparison.runs):
        legend.append(Line2D([], [], color="0.3", marker="x", linestyle="none", label="diverged"))
    longest = max(len(result.arm.label) for result in ranked)
    grid = Grid(3, 3, legend, panel=(3.3, ROW * len(ranked) + 0.3), left=0.3 + 0.07 * longest)
    for ax, (name, title, missing) in zip(grid.axes, PANELS):
        dots: dict[tuple[float, str], tuple[list[float], list[float]]] = {}  # one artist per lr and marker: fast
        for row, result in enumerate(ranked):
            for run in result.runs:
                value = _value(figures[run.path], name)
                if value is not None and math.isfinite(run.lr):
                    xs, ys = dots.setdefault((run.lr, "x" if run.status == "diverged" else "o"), ([], []))
                    xs.append(value)
                    ys.append(row + (0.5 * (lrs.index(run.lr) / (len(lrs) - 1) - 0.5) if len(lrs) > 1 else 0.0))
        for (lr, marker), (xs, ys) in dots.items():
            ax.plot(xs, ys, marker=marker, markersize=4.5, linestyle="none", color=colours[lr])
        values = [x for xs, _ in dots.values() for x in xs]
        labels = [r.arm.label for r in ranked]
        _axes(ax, title, values, missing, labels if name == PANELS[0][0] else [""] * len(labels))
        if name == "spikes" and values:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    grid.save(path)
    return plot


def _value(figure: RunStability, name: str) -> float | None:
    value = getattr(figure, name)
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else float(value)


def _axes(ax, title: str, values: list[float], missing: str, labels: list[str]) -> None:
    ax.set_title(title, fontsize=FONT + 1)
    ax.tick_params(which="both", labelsize=FONT - 1)
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.set_yticks(range(len(labels)), labels, fontsize=FONT)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # the best arm on top
    ax.set_yticks([i + 0.5 for i in range(len(labels) - 1)], minor=True)
    ax.tick_params(axis="y", which="minor", length=0)
    ax.grid(alpha=0.4, axis="y", which="minor")  # a line between arms
    if not values:
        ax.text(0.5, 0.5, missing, transform=ax.transAxes, ha="center", va="center", fontsize=FONT, color="0.4", wrap=True)
        ax.set_xticks([])
    else:
        log_if_wide(ax, values, "x")
