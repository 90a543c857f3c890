"""The comparison's PNG plots, drawn on matplotlib's Agg canvas (headless: pyplot is never imported).

Arms are told apart as figures.Layout says (colour, line style, panels by what varies), with one
legend below the panels. Each arm's seeds are drawn as their mean with a min–max band (one seed:
a plain line). Diverged runs end at the last step before divergence, marked ×; non-finite points
are never drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator, NullFormatter

from normlab import keys
from normlab.analysis.stats.arms import ArmResult, mean_std
from normlab.analysis.stats.comparison import Comparison
from normlab.analysis.render.exports import FIGURE_FORMATS
from normlab.analysis.render.figures import FONT, FORMATS, Grid, Layout, columns, log_if_wide
from normlab.analysis.read.runs import Run
from normlab.analysis.render.scale_plot import draw_scale
from normlab.analysis.render.stability_plot import draw_stability
from normlab.config import format_lr

LOSS_CURVES = (("loss", "loss_train.png", "training loss"), ("val_loss", "loss_val.png", "validation loss"))
LOSS_VS_LR = "final_val_loss_vs_lr.png"
STABILITY = "stability.png"
SCALE = "scale.png"
# The file of each per-layer statistic that keys.LAYER_PROFILES names; one added there without a file
# here is drawn into layers_<stat with '/' as '_'>.png.
LAYER_PROFILE_FILES = {keys.GRAD_NORM: "layers_grad_norm.png", keys.RESID_RMS: "layers_resid_rms.png"}
DIVERGED_MARKER = dict(marker="x", markersize=8, markeredgewidth=2, linestyle="none")
DIVERGED = Line2D([], [], color="0.3", label="diverged (curve cut)", **DIVERGED_MARKER)
FOCUS = 0.2  # loss curves' y axis shows the training from this fraction of its steps on


@dataclass
class Plot:
    """One PNG of the report; `skipped` says why it was not drawn."""

    file: str
    title: str
    skipped: str | None = None


def write_plots(comparison: Comparison, out: Path, formats: tuple[str, ...] = ("png",)) -> list[Plot]:
    """Draw every plot of the report into `out`, once in each of `formats` (figures.FIGURE_FORMATS); a plot with
    nothing to show is skipped, with the reason. Each Plot's file is in the first format."""
    token = FORMATS.set(tuple(formats))
    try:
        plots = _draw_all(comparison, out)
    finally:
        FORMATS.reset(token)
    for plot in plots:
        stem = Path(plot.file).stem
        for fmt in FIGURE_FORMATS:
            if plot.skipped or fmt not in formats:  # a stale file from an earlier report would contradict report.md
                (out / f"{stem}.{fmt}").unlink(missing_ok=True)
        plot.file = f"{stem}.{formats[0]}"
    return plots


def _draw_all(comparison: Comparison, out: Path) -> list[Plot]:
    layout = Layout([result.arm for result in comparison.arms], comparison.dims)
    plots = []
    for key, file, label in LOSS_CURVES:
        if key == "val_loss" and comparison.measure == "val_bpb":  # the runs' tokenizers differ
            key, label = "val_bpb", "validation bits per byte"
        plots.append(_loss_curves(comparison, layout, key, label, out / file))
    plots.append(_loss_vs_lr(comparison, layout, out / LOSS_VS_LR))
    plots.append(draw_stability(comparison, layout, out / STABILITY, Plot(STABILITY, "stability of each arm")))
    scale = draw_scale(comparison, out / SCALE, Plot(SCALE, "final validation loss against scale"))
    if scale.skipped:  # only a sweep over depth, width or size has a scale axis: no 'Not drawn' line for the others
        (out / SCALE).unlink(missing_ok=True)
    else:
        plots.append(scale)
    for stat, label, _ in keys.LAYER_PROFILES:
        file = LAYER_PROFILE_FILES.get(stat, f"layers_{stat.replace('/', '_')}.png")
        plots.append(_layer_profiles(comparison, layout, stat, label, out / file))
    return plots


def by_panel(comparison: Comparison, layout: Layout) -> dict[tuple, list[ArmResult]]:
    """The arms of each panel, panels in order."""
    panels: dict[tuple, list[ArmResult]] = {}
    for result in comparison.arms:
        panels.setdefault(layout.panel(result.arm), []).append(result)
    return {panel: panels[panel] for panel in sorted(panels, key=layout.panel_key)}


def lr_text(lr: float) -> str:
    return f"lr={format_lr(lr)}" if math.isfinite(lr) else "lr=?"


def seed_band(curves: list[tuple[list[int], list[float]]]) -> tuple[np.ndarray, ...]:
    """steps, and the mean, min and max over the curves that reach each step."""
    by_step: dict[int, list[float]] = {}
    for steps, values in curves:
        for step, value in zip(steps, values):
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    stacked = [by_step[s] for s in steps]
    return (np.array(steps), np.array([sum(v) / len(v) for v in stacked]), np.array([min(v) for v in stacked]),
            np.array([max(v) for v in stacked]))  # fmt: skip


def draw_seeds(ax, runs: list[Run], key: str, line: dict) -> tuple[list[float], list[float]]:
    """The runs' mean curve of `key` with a min–max band (a plain line for one run), × where a run diverged;
    returns the values drawn from the FOCUS mark on (all of them when fewer than two steps lie past it), and all
    of them."""
    curves = [run.curve(key) for run in runs]
    drawn = [(run, curve) for run, curve in zip(runs, curves) if curve[0]]
    if not drawn:
        return [], []
    steps, mean, low, high = seed_band([curve for _, curve in drawn])
    ax.plot(steps, mean, linewidth=1.3, **line)
    if len(drawn) > 1:
        ax.fill_between(steps, low, high, color=line["color"], alpha=0.18, linewidth=0)
    for run, (run_steps, values) in drawn:
        if run.status == "diverged":
            ax.plot(run_steps[-1], values[-1], color=line["color"], **DIVERGED_MARKER)
    late = steps >= FOCUS * max(run.settings.get("max_steps") or steps[-1] for run, _ in drawn)
    if late.sum() < 2:  # a curve of few points (two evaluations): cut to one, its line would be a sliver at the edge
        late[:] = True
    return [*high[late], *low[late]], [*high, *low]


def _focus(ax, values: list[float], everything: list[float]) -> None:
    """Show the values from the FOCUS mark on: the first steps' fall from the initial loss would flatten the rest."""
    if not values:
        return
    low, high = min(everything), max(values)
    pad = 0.06 * (high - low) or 0.01
    ax.set_ylim(low - pad, high + pad)


def _loss_curves(comparison: Comparison, layout: Layout, key: str, label: str, path: Path) -> Plot:
    plot = Plot(path.name, label)
    if not any(run.curve(key)[0] for run in comparison.runs):
        plot.skipped = f"no run logged a finite `{key}`"
        return plot
    panels = [(panel, point.lr, results) for panel, results in by_panel(comparison, layout).items()
              for point in _points_with(results, key)]
    diverged = [DIVERGED] if any(run.status == "diverged" for run in comparison.runs) else []
    per_group = max(sum(1 for p in panels if p[0] == panel) for panel, _, _ in panels)
    grid = Grid(len(panels), columns(per_group, 5), layout.handles() + diverged)
    for ax, (panel, lr, results) in zip(grid.axes, panels):
        late, everything = [], []
        for result in results:
            point = next((p for p in result.points if p.lr == lr), None)
            if point is not None:
                drawn_late, drawn = draw_seeds(ax, point.runs, key, layout.line(result.arm))
                late += drawn_late
                everything += drawn
        _focus(ax, late, everything)
        _decorate(ax, layout.panel_title(panel, lr_text(lr)), "step", label)
    grid.save(path)
    return plot


def _points_with(results: list[ArmResult], key: str) -> list:
    """One point per lr at which some arm of `results` has a run that logged `key`, lrs ascending."""
    points = {p.lr: p for r in results for p in r.points if any(run.curve(key)[0] for run in p.runs)}
    return [points[lr] for lr in sorted(points, key=lambda lr: (not math.isfinite(lr), lr))]


def _decorate(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=FONT + 1)
    ax.set_xlabel(xlabel, fontsize=FONT)
    ax.set_ylabel(ylabel, fontsize=FONT)
    ax.tick_params(which="both", labelsize=FONT - 1)
    ax.grid(alpha=0.3, which="both")


def _loss_vs_lr(comparison: Comparison, layout: Layout, path: Path) -> Plot:
    """Final validation loss against lr, one panel per panel of the layout, all on one y scale: that of the
    finished runs. A lr where a seed diverged or failed counts as ℓ₀ in the LR sensitivity: its line rises
    towards ℓ₀, off the top of the panel, and an × on the top edge marks it."""
    plot = Plot(path.name, "final validation loss against learning rate")
    if not any(p.counted for r in comparison.arms for p in r.points):
        plot.skipped = "no arm has a finished run"
        return plot
    lost = [Line2D([], [], color="0.3", label="diverged/failed (= ℓ₀, off the top)", **DIVERGED_MARKER)]
    panels = by_panel(comparison, layout)
    grid = Grid(len(panels), 4, layout.handles() + (lost if any(r.n_lost for r in comparison.arms) else []),
                panel=(4.6, 3.4))
    unit = " (bits/byte)" if comparison.measure == "val_bpb" else ""
    finished: list[float] = []
    for ax, (panel, results) in zip(grid.axes, panels.items()):
        for result in results:
            finished += _arm_vs_lr(ax, result, layout.line(result.arm))
        lrs = sorted({p.lr for r in results for p in r.points if p.counted and math.isfinite(p.lr)})
        ax.set_xscale("log")
        ax.set_xticks(lrs, [format_lr(lr) for lr in lrs])
        ax.xaxis.set_minor_formatter(NullFormatter())
        _decorate(ax, layout.panel_title(panel), "peak learning rate", f"final val loss{unit}, mean ± std")
    if finished:  # one scale: the panels (depths, widths, ...) compare with each other too
        pad = 0.08 * (max(finished) - min(finished)) or 0.01
        for ax in grid.axes:
            ax.set_ylim(min(finished) - pad, max(finished) + pad)
    grid.save(path)
    return plot


def _arm_vs_lr(ax, result: ArmResult, line: dict) -> list[float]:
    """One arm: the seeds' mean final loss at each lr, ± their std; where a seed diverged or failed the line
    goes to ℓ₀ and an × sits on the panel's top edge. Returns the finished values drawn (with their spread)."""
    xs, ys, drawn = [], [], []
    for point in result.points:
        if not point.counted or not math.isfinite(point.lr):
            continue
        if math.isfinite(point.loss):
            mean, spread = mean_std(point.finished_losses)
            xs.append(point.lr)
            ys.append(mean)
            drawn += [mean]
            if math.isfinite(spread):
                ax.errorbar(point.lr, mean, yerr=spread, color=line["color"], capsize=3, linestyle="none")
                drawn += [mean - spread, mean + spread]
        else:
            xs.append(point.lr)
            ys.append(result.init_loss if math.isfinite(result.init_loss) else math.nan)
            ax.plot(point.lr, 1.0, transform=ax.get_xaxis_transform(), clip_on=False, color=line["color"],
                    **DIVERGED_MARKER)
    if xs:
        ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.5, **line)
    return drawn


def _layer_profiles(comparison: Comparison, layout: Layout, stat: str, label: str, path: Path) -> Plot:
    plot = Plot(path.name, f"per-layer {label} at initialization and at the end")
    if not any(run.has_layer_stat(stat) for run in comparison.runs):
        plot.skipped = f"no run logged per-layer `{stat}/L..` telemetry"
        return plot
    panels = []
    for panel, results in by_panel(comparison, layout).items():
        lrs = sorted({p.lr for r in results for p in r.points if any(run.has_layer_stat(stat) for run in p.runs)})
        panels.append((panel, None, results))  # at initialization the lr has not acted yet: one panel for all
        panels += [(panel, lr, results) for lr in lrs]
    per_group = max(sum(1 for p in panels if p[0] == panel) for panel, _, _ in panels)
    grid = Grid(len(panels), columns(per_group), layout.handles(), panel=(3.6, 2.8))
    values: list[float] = []  # of every panel: one y scale for all, log or linear, so the panels compare
    for ax, (panel, lr, results) in zip(grid.axes, panels):
        for result in results:
            runs = [run for p in result.points if lr is None or p.lr == lr for run in p.runs]
            profile = mean_profile(runs, stat, "first" if lr is None else "last")
            if profile:
                layers = sorted(profile)
                ax.plot(layers, [profile[i] for i in layers], marker="o", markersize=3, linewidth=1.3,
                        **layout.line(result.arm))
                values += profile.values()
        when = "at initialization (every lr)" if lr is None else f"{lr_text(lr)}, at the end"
        _decorate(ax, layout.panel_title(panel, when), "layer", label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in grid.axes:
        log_if_wide(ax, values)
    grid.save(path)
    return plot


def mean_profile(runs: list[Run], stat: str, which: str) -> dict[int, float]:
    """{layer: mean over `runs` of its `which` ('first' or 'last') telemetry value of `stat`}."""
    by_layer: dict[int, list[float]] = {}
    for run in runs:
        for layer, value in run.layer_profile(stat, which).items():
            by_layer.setdefault(layer, []).append(value)
    return {layer: sum(v) / len(v) for layer, v in by_layer.items()}
