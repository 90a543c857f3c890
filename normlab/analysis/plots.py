"""The comparison's PNG plots, drawn on matplotlib's Agg canvas (headless: pyplot is never imported).

Colour says the norm, line style the placement. Loss curves and per-layer profiles get
one panel per condition (learning rate, plus any config key that splits arms, such as
depth), so every panel compares arms under the same settings. Diverged runs end at the
last step before divergence, marked ×; non-finite points are never drawn.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from normlab import keys
from normlab.analysis.arms import Arm, condition_label, mean_std, order_key
from normlab.analysis.comparison import Comparison
from normlab.analysis.runs import Run
from normlab.config import NORMS, PLACEMENTS

LOSS_CURVES = (("loss", "loss_train.png", "training loss"), ("val_loss", "loss_val.png", "validation loss"))
LOSS_VS_LR = "final_val_loss_vs_lr.png"
# The file of each per-layer statistic that keys.LAYER_PROFILES names; one added there without a file
# here is drawn into layers_<stat with '/' as '_'>.png.
LAYER_PROFILE_FILES = {keys.GRAD_NORM: "layers_grad_norm.png", keys.RESID_RMS: "layers_resid_rms.png"}
PLACEMENT_STYLES = ("-", "--", ":", "-.")
EXTRAS_MARKERS = ("o", "s", "^", "D", "v", "P", "*", "h")
DIVERGED_MARKER = dict(marker="x", markersize=9, markeredgewidth=2, linestyle="none")


@dataclass
class Plot:
    """One PNG of the report; `skipped` says why it was not drawn."""

    file: str
    title: str
    skipped: str | None = None


class Style:
    """Colour per norm, line style per placement, marker per extra config (e.g. depth)."""

    def __init__(self, arms: list[Arm]):
        norms = sorted({a.norm for a in arms}, key=lambda n: order_key(n, NORMS))
        placements = sorted({a.placement for a in arms}, key=lambda p: order_key(p, PLACEMENTS))
        extras = list(dict.fromkeys(a.extras for a in sorted(arms, key=Arm.extras_key)))
        palette = colormaps["tab10"].colors
        self.colors = {n: palette[i % len(palette)] for i, n in enumerate(norms)}
        self.styles = {p: PLACEMENT_STYLES[i % len(PLACEMENT_STYLES)] for i, p in enumerate(placements)}
        self.markers = {e: EXTRAS_MARKERS[i % len(EXTRAS_MARKERS)] for i, e in enumerate(extras)}

    def line(self, arm: Arm) -> dict:
        return dict(color=self.colors[arm.norm], linestyle=self.styles[arm.placement])

    def legend(self) -> list[Line2D]:
        """Proxy handles: one per norm (colour), one per placement (style)."""
        handles = [Line2D([], [], color=c, label=f"norm={n}") for n, c in self.colors.items()]
        handles += [Line2D([], [], color="0.3", linestyle=s, label=f"placement={p}") for p, s in self.styles.items()]
        return handles


def write_plots(comparison: Comparison, out: Path) -> list[Plot]:
    """Draw every plot of the report into `out`; a plot with nothing to show is skipped, with the reason."""
    style = Style([result.arm for result in comparison.arms])
    plots = []
    for key, file, label in LOSS_CURVES:
        if key == "val_loss" and comparison.measure == "val_bpb":  # the runs' tokenizers differ
            key, label = "val_bpb", "validation bits per byte"
        plots.append(_loss_curves(comparison, style, key, label, out / file))
    plots.append(_loss_vs_lr(comparison, style, out / LOSS_VS_LR))
    for stat, label, _ in keys.LAYER_PROFILES:
        file = LAYER_PROFILE_FILES.get(stat, f"layers_{stat.replace('/', '_')}.png")
        plots.append(_layer_profiles(comparison, style, stat, label, out / file))
    for plot in plots:
        if plot.skipped:  # a stale file from an earlier report would contradict report.md
            (out / plot.file).unlink(missing_ok=True)
    return plots


def _new_figure(n_panels: int, ncols: int, panel_size=(5.0, 3.6)):
    nrows = math.ceil(n_panels / ncols)
    fig = Figure(figsize=(panel_size[0] * ncols + 1.8, panel_size[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes


def _panels(comparison: Comparison) -> dict[str, list[Run]]:
    """Runs grouped by condition label, in the comparison's order (arm, lr, seed)."""
    panels: dict[tuple, list[Run]] = {}
    for run in comparison.runs:
        arm = comparison.arm_of[run.path]
        panels.setdefault((arm.extras_key(), run.lr), []).append(run)
    return {condition_label(comparison.arm_of[rs[0].path], rs[0].lr): rs for _, rs in sorted(panels.items())}


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=110)


def _loss_curves(comparison: Comparison, style: Style, key: str, label: str, path: Path) -> Plot:
    plot = Plot(path.name, label)
    panels = _panels(comparison)
    if not any(run.curve(key)[0] for run in comparison.runs):
        plot.skipped = f"no run logged a finite `{key}`"
        return plot
    fig, axes = _new_figure(len(panels), min(len(panels), 3))
    for ax, (condition, runs) in zip(axes, panels.items()):
        for run in runs:
            steps, values = run.curve(key)
            if not steps:
                continue
            line = style.line(comparison.arm_of[run.path])
            ax.plot(steps, values, linewidth=1.3, **line)
            if run.status == "diverged":
                ax.plot(steps[-1], values[-1], color=line["color"], **DIVERGED_MARKER)
        ax.set_title(condition, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles = style.legend() + [Line2D([], [], color="0.3", label="diverged (curve cut)", **DIVERGED_MARKER)]
    fig.legend(handles=handles, loc="outside right upper", fontsize=9)
    _save(fig, path)
    return plot


def _loss_vs_lr(comparison: Comparison, style: Style, path: Path) -> Plot:
    plot = Plot(path.name, "final validation loss against learning rate")
    fig, axes = _new_figure(1, 1, panel_size=(6.5, 4.5))
    ax = axes[0]
    handles = []
    for result in comparison.arms:
        line = style.line(result.arm)
        marker = style.markers[result.arm.extras]
        xs, ys = [], []
        for point in result.points:
            if not point.counted:
                continue
            if math.isfinite(point.loss):
                mean_, spread = mean_std(point.finished_losses)
                xs.append(point.lr)
                ys.append(mean_)
                if math.isfinite(spread):
                    ax.errorbar(point.lr, mean_, yerr=spread, color=line["color"], capsize=3, linestyle="none")
                ax.plot(point.lr, mean_, marker=marker, color=line["color"], linestyle="none")
            elif math.isfinite(result.init_loss):
                # Diverged or failed: drawn at ℓ₀, the value the LR sensitivity gives it.
                xs.append(point.lr)
                ys.append(result.init_loss)
                ax.plot(point.lr, result.init_loss, color=line["color"], **DIVERGED_MARKER)
        if xs:
            ax.plot(xs, ys, linewidth=1.5, **line)
        handles.append(Line2D([], [], marker=marker, label=result.arm.label, **line))
    if not handles or not ax.lines:
        plot.skipped = "no arm has a finished run"
        return plot
    init_losses = [r.init_loss for r in comparison.arms if math.isfinite(r.init_loss)]
    if init_losses:
        ax.axhline(sum(init_losses) / len(init_losses), color="0.5", linestyle=":", linewidth=1)
        handles.append(Line2D([], [], color="0.5", linestyle=":", label="loss at initialization ℓ₀"))
    handles.append(Line2D([], [], color="0.3", label="diverged/failed (at ℓ₀)", **DIVERGED_MARKER))
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    unit = " (bits per byte)" if comparison.measure == "val_bpb" else ""
    ax.set_ylabel(f"final validation loss{unit} (mean over seeds, ± std)")
    ax.grid(alpha=0.3, which="both")
    fig.legend(handles=handles, loc="outside right upper", fontsize=9)
    _save(fig, path)
    return plot


def _layer_profiles(comparison: Comparison, style: Style, stat: str, label: str, path: Path) -> Plot:
    plot = Plot(path.name, f"per-layer {label} at initialization and at the end")
    if not any(run.has_layer_stat(stat) for run in comparison.runs):
        plot.skipped = f"no run logged per-layer `{stat}/L..` telemetry"
        return plot
    panels = {c: [r for r in rs if r.has_layer_stat(stat)] for c, rs in _panels(comparison).items()}
    panels = {c: rs for c, rs in panels.items() if rs}
    fig, axes = _new_figure(2 * len(panels), 2, panel_size=(4.6, 3.2))
    for row, (condition, runs) in enumerate(panels.items()):
        for col, (which, when) in enumerate((("first", "at initialization"), ("last", "at the end"))):
            ax = axes[2 * row + col]
            values = []
            for run in runs:
                profile = run.layer_profile(stat, which)
                layers = sorted(profile)
                ax.plot(layers, [profile[i] for i in layers], marker="o", markersize=3, linewidth=1.3,
                        **style.line(comparison.arm_of[run.path]))
                values += profile.values()
            if values and min(values) > 0:
                ax.set_yscale("log")
            ax.set_title(f"{condition}, {when}", fontsize=10)
            ax.set_xlabel("layer")
            ax.set_ylabel(label)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3, which="both")
    fig.legend(handles=style.legend(), loc="outside right upper", fontsize=9)
    _save(fig, path)
    return plot


def layer_heatmap(records, stat: str, title: str) -> bytes:
    """A layer × step heatmap of the whole-block statistic `stat` (e.g. keys.RESID_RMS) over the
    `records` that hold it, as PNG bytes. Rows are blocks, bottom to top; a missing or non-finite
    value is a blank cell. The colour scale is logarithmic when the values are positive and span
    more than a factor of 10."""
    profiles = [(record.get("step"), keys.layer_values(record, stat)) for record in records]
    profiles = [(step, values) for step, values in profiles if values]
    depth = 1 + max((max(values) for _, values in profiles), default=-1)
    labels = [keys.layer_label(i, depth) for i in range(depth)]
    steps = [step for step, _ in profiles]
    grid = np.array([[values.get(i, np.nan) for _, values in profiles] for i in range(depth)], dtype=float)

    finite = grid[np.isfinite(grid)]
    log_scale = finite.size > 0 and finite.min() > 0 and finite.max() > 10 * finite.min()
    width = min(10.0, max(5.0, 0.3 * len(steps) + 2.5))  # wider grows the PNG (and its render time), not legibility
    height = max(2.5, 0.35 * len(labels) + 1.2)
    fig = Figure(figsize=(width, height), dpi=100)
    # Fixed margins in inches, not tight_layout: the labels' sizes are known, and laying out by measuring
    # them doubled the time a run spends on its heatmaps (a sweep's per-job cost).
    left, bottom, top, bar, gap, right = 0.75, 0.55, 0.35, 0.15, 0.12, 0.85
    span = (height - bottom - top) / height
    ax = fig.add_axes((left / width, bottom / height, (width - left - gap - bar - right) / width, span))
    colorbar_ax = fig.add_axes(((width - bar - right) / width, bottom / height, bar / width, span))
    image = ax.imshow(np.ma.masked_invalid(grid), origin="lower", aspect="auto", interpolation="nearest",
                      cmap="viridis", norm=LogNorm() if log_scale else None)
    fig.colorbar(image, cax=colorbar_ax)
    ax.set_yticks(range(len(labels)), labels)
    stride = max(1, math.ceil(len(steps) / 12))  # at most ~12 step labels
    ticks = list(range(0, len(steps), stride))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_xlabel("step")
    ax.set_ylabel("block")
    ax.set_title(title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
