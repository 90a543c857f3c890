"""How the report's plots tell arms apart, and the panel grids they are drawn on.

Layout: the first thing that varies between the arms (the norm, usually) is the line's colour,
the next with at most four values (the placement, usually) its style, and every other varying
key makes its own panels, so a legend never lists arms one by one: it lists the colours and the
styles, once, below the panels. Grids have fixed margins in inches, so no layout engine measures
(and warns about) the figure, and a plot costs the same whatever its labels.
"""

from __future__ import annotations

import itertools
import math
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from normlab.analysis.stats.arms import Arm, dim_order

FORMATS: ContextVar[tuple[str, ...]] = ContextVar("FORMATS", default=("png",))  # what Grid.save writes (plots.write_plots sets it)
STYLES = ("-", "--", ":", "-.")
DPI = 100
FONT = 9


def dim_text(dim: str, value: Any) -> str:
    """'norm=rms', 'depth=12'; a knob the arm's norm does not read is '(not read)'."""
    return f"{dim}={'(not read)' if value is None else value}"


class Layout:
    """Colour, line style and panel of each arm, from what varies between the arms (`dims`, see arms.varying_dims)."""

    def __init__(self, arms: list[Arm], dims: list[str]):
        values = {d: sorted({arm.value(d) for arm in arms}, key=lambda v, d=d: dim_order(d, v)) for d in dims}
        self.colour_dim = dims[0] if dims else None
        rest = dims[1:]
        self.style_dim = next((d for d in rest if len(values[d]) <= len(STYLES)), None)
        self.panel_dims = [d for d in rest if d != self.style_dim]
        palette = colormaps["tab10" if len(values.get(self.colour_dim, ())) <= 10 else "tab20"].colors
        self.colours = {v: palette[i % len(palette)] for i, v in enumerate(values.get(self.colour_dim, [None]))}
        self.styles = {v: STYLES[i] for i, v in enumerate(values.get(self.style_dim, [None]))}
        self.single = arms[0].label if len(arms) == 1 else None

    def line(self, arm: Arm) -> dict:
        colour = self.colours[arm.value(self.colour_dim) if self.colour_dim else None]
        return dict(color=colour, linestyle=self.styles[arm.value(self.style_dim) if self.style_dim else None])

    def panel(self, arm: Arm) -> tuple:
        return tuple(arm.value(d) for d in self.panel_dims)

    def panel_key(self, panel: tuple) -> tuple:
        return tuple(dim_order(d, v) for d, v in zip(self.panel_dims, panel))

    def panel_title(self, panel: tuple, *then: str) -> str:
        return ", ".join([*(dim_text(d, v) for d, v in zip(self.panel_dims, panel)), *then])

    def handles(self) -> list[Line2D]:
        """The legend: one entry per colour and one per line style."""
        if self.colour_dim is None:
            return [Line2D([], [], color=self.colours[None], label=self.single or "runs")]
        handles = [Line2D([], [], color=c, label=dim_text(self.colour_dim, v)) for v, c in self.colours.items()]
        if self.style_dim is not None:
            handles += [Line2D([], [], color="0.3", linestyle=s, label=dim_text(self.style_dim, v)) for v, s in self.styles.items()]
        return handles


class Grid:
    """A figure of equal panels in `ncols` columns with a shared legend below, laid out in inches."""

    LEFT, RIGHT, TOP, BOTTOM, WSPACE, HSPACE = 0.8, 0.25, 0.45, 0.55, 0.75, 0.8
    ROW = 0.24  # one line of the legend

    def __init__(self, n_panels: int, ncols: int, legend: list[Line2D], panel=(4.2, 3.0), left: float | None = None):
        self.legend = legend
        ncols = max(1, min(ncols, n_panels))
        nrows = max(1, math.ceil(n_panels / ncols))
        left = self.LEFT if left is None else left
        width = left + self.RIGHT + ncols * panel[0] + (ncols - 1) * self.WSPACE
        entry = 0.65 + 0.058 * max((len(h.get_label()) for h in legend), default=0)
        self.legend_cols = max(1, min(len(legend), int(width // entry)))
        legend_h = math.ceil(len(legend) / self.legend_cols) * self.ROW + 0.15 if legend else 0.0
        bottom = self.BOTTOM + legend_h
        height = self.TOP + bottom + nrows * panel[1] + (nrows - 1) * self.HSPACE
        self.fig = Figure(figsize=(width, height), dpi=DPI)
        FigureCanvasAgg(self.fig)
        grid = self.fig.add_gridspec(nrows, ncols, left=left / width, right=1 - self.RIGHT / width,
                                     top=1 - self.TOP / height, bottom=bottom / height,
                                     wspace=self.WSPACE / panel[0], hspace=self.HSPACE / panel[1])
        cells = list(itertools.product(range(nrows), range(ncols)))[:n_panels]
        self.axes = [self.fig.add_subplot(grid[r, c]) for r, c in cells]
        self.height = height

    def save(self, path: Path) -> None:
        if self.legend:
            self.fig.legend(handles=self.legend, loc="lower center", bbox_to_anchor=(0.5, 0.08 / self.height), ncol=self.legend_cols,
                            fontsize=FONT, frameon=False, handlelength=2.6)
        for fmt in FORMATS.get():  # the figure once in each format asked for, beside each other: loss_val.png, .svg, ...
            extra = {"pil_kwargs": {"compress_level": 1}} if fmt == "png" else {}  # PNG compression took ~20% of the drawing time
            self.fig.savefig(Path(path).with_suffix(f".{fmt}"), dpi=DPI, format=fmt, **extra)


def log_if_wide(ax, values: list[float], axis: str = "y") -> None:
    """A log scale when the values are positive and span more than a factor of 10, linear otherwise. Its
    labels are plain numbers (0.5, 2, 20, not 5 × 10⁻¹), at 1, 2 and 5 of each decade over three decades
    or fewer, so that a value can be read off; at 1 alone over more."""
    if not (values and min(values) > 0 and max(values) > 10 * min(values)):
        return
    getattr(ax, f"set_{axis}scale")("log")
    scale = getattr(ax, f"{axis}axis")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    scale.set_major_formatter(plain)
    if max(values) <= 1000 * min(values):
        scale.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        scale.set_minor_formatter(plain)
    else:
        scale.set_minor_formatter(NullFormatter())


def columns(per_group: int, most: int = 6) -> int:
    """Grid columns for panels that come in groups of `per_group` (one per lr, say): a group per row when it fits."""
    return per_group if per_group <= most else 4
