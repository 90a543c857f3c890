"""scale.png: final validation loss against model scale, drawn only when depth, width or parameter count varies.

One panel per scale axis that varies (depth, width `model.d_model`, and the parameter count that
summary.json records as `n_params`), log x. In a panel, one line per arm of the other keys (colour and
line style as figures.Layout gives them over the keys that are not scale); each point is the arm at
its best lr, the mean over its seeds there, with a band from the lowest to the highest seed. A panel
per value of any other varying scale key (depth's lines at each width), so that no line mixes scales.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from matplotlib.ticker import FuncFormatter, NullFormatter

from normlab.analysis.stats.arms import ArmResult, dim_order
from normlab.analysis.stats.comparison import Comparison
from normlab.analysis.render.figures import FONT, Grid, Layout
from normlab.analysis.stats.gaps import seed_losses

SCALE_KEYS = {"depth": "depth (blocks)", "model.d_model": "width (model.d_model)"}
PARAMS = "n_params"  # summary.json's parameter count


def scale_dims(comparison: Comparison) -> list[str]:
    """The scale axes that vary: SCALE_KEYS among the varying dims, then the parameter count with any of them."""
    dims = [d for d in SCALE_KEYS if d in comparison.dims]
    counts = {_params(r) for r in comparison.arms} - {None}
    return dims + [PARAMS] if dims and len(counts) > 1 else dims


def _params(result: ArmResult) -> float | None:
    counts = [run.summary.get(PARAMS) for run in result.runs if isinstance(run.summary.get(PARAMS), (int, float))]
    return statistics.median(counts) if counts else None


def _x(result: ArmResult, axis: str) -> float | None:
    value = _params(result) if axis == PARAMS else result.arm.value(axis)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def draw_scale(comparison: Comparison, path: Path, plot):
    """Draw scale.png into `path`; `plot` (a plots.Plot) gets `skipped` set when no scale key varies."""
    axes = scale_dims(comparison)
    if not axes:
        plot.skipped = "neither depth, width nor the parameter count varies between the arms"
        return plot
    rest = [d for d in comparison.dims if d not in SCALE_KEYS]
    layout = Layout([r.arm for r in comparison.arms], rest)
    panels = []
    for axis in axes:
        fixed = _fixed(axis, layout, comparison.dims)
        groups: dict[tuple, list[ArmResult]] = {}
        for result in comparison.arms:
            groups.setdefault(tuple(result.arm.value(d) for d in fixed), []).append(result)
        for key in sorted(groups, key=lambda k: tuple(dim_order(d, v) for d, v in zip(fixed, k))):
            title = ", ".join(f"{d}={v}" for d, v in zip(fixed, key))
            panels.append((axis, title, groups[key]))
    grid = Grid(len(panels), min(len(panels), 3), layout.handles())
    for ax, (axis, title, results) in zip(grid.axes, panels):
        _draw_panel(ax, axis, results, layout, rest)
        ax.set_title(title or f"final loss against {SCALE_KEYS.get(axis, 'parameters')}", fontsize=FONT + 1)
        ax.set_xlabel(SCALE_KEYS.get(axis, "parameters"), fontsize=FONT)
        ax.set_ylabel(f"final {'val bits/byte' if comparison.measure == 'val_bpb' else 'val loss'} at best lr", fontsize=FONT)
        ax.tick_params(which="both", labelsize=FONT - 1)
        ax.grid(alpha=0.3, which="both")
    grid.save(path)
    return plot


def _fixed(axis: str, layout: Layout, dims: list[str]) -> list[str]:
    """What a panel holds fixed: the layout's panel keys and, on a depth or width axis, the other scale keys."""
    return [*layout.panel_dims, *(d for d in SCALE_KEYS if d in dims and d != axis and axis != PARAMS)]


def _draw_panel(ax, axis: str, results: list[ArmResult], layout: Layout, rest: list[str]) -> None:
    lines: dict[tuple, list[tuple[float, list[float]]]] = {}
    arms = {}
    for result in results:
        x, losses = _x(result, axis), list(seed_losses(result).values())
        if x is None or not losses:
            continue
        key = tuple(repr(result.arm.value(d)) for d in rest)
        lines.setdefault(key, []).append((x, losses))
        arms[key] = result.arm
    xs_all = []
    for key, points in lines.items():
        points.sort()
        xs = [x for x, _ in points]
        xs_all += xs
        style = layout.line(arms[key])
        ax.plot(xs, [statistics.fmean(v) for _, v in points], marker="o", markersize=4, linewidth=1.5, **style)
        if any(len(v) > 1 for _, v in points):
            ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points], color=style["color"],
                            alpha=0.18, linewidth=0)
    ax.set_xscale("log")
    ticks = sorted(set(xs_all))
    if ticks and len(ticks) <= 8:
        ax.set_xticks(ticks, [f"{t:,.0f}" if axis != PARAMS else _short(t) for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))


def _short(count: float) -> str:
    """1.2M, 350k, 64."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return f"{count:g}"
