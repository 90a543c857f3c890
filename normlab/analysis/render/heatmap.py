"""A run's layer × step heatmap of a per-layer statistic, drawn at the end of a run (the telemetry's
end-of-run images) on matplotlib's Agg canvas.

Each thread draws on one figure per size, cleared for each heatmap (_figure): its Agg canvas keeps its renderer,
and with it matplotlib's caches of text metrics and of parsed mathtext (the log colour bar's labels), which a new
figure starts empty. The PNG is byte for byte a fresh figure's (tests/test_heatmap.py); a sweep's job draws two
heatmaps in 0.129 s of CPU instead of 0.160 s (`python scripts/bench/heatmap.py`, the 2-core CPU at load 2.4)."""

from __future__ import annotations

import io
import math
import threading

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from normlab import keys


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
    fig = _figure(width, height)
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


# This thread's figures (the module's docstring), by size.
_figures = threading.local()


def _figure(width: float, height: float) -> Figure:
    """A blank figure of `width` x `height` inches at 100 dpi on its own Agg canvas: this thread's figure of that
    size, cleared (a later heatmap of a sweep's job is as large as its first)."""
    figures = _figures.__dict__.setdefault("by_size", {})
    style = dict(matplotlib.rcParams)  # a figure keeps the style it was made with: a changed style, a new figure
    if _figures.__dict__.get("style") != style:
        figures.clear()
        _figures.style = style
    fig = figures.get((width, height))
    if fig is None:
        if len(figures) >= 4:  # sizes come from a run's depth and steps: a handful at most, but not held for ever
            figures.clear()
        fig = figures[(width, height)] = Figure(figsize=(width, height), dpi=100)
        FigureCanvasAgg(fig)  # savefig draws on it, keeping its renderer; a bare figure draws on a new canvas each time
    else:
        fig.clear()
    return fig
