"""report.md's Factor effects: each varying key's levels against its best level, and the norm × placement
pivots of final loss (factors.py computes them)."""

from __future__ import annotations

from normlab.analysis.stats.comparison import Comparison
from normlab.analysis.stats.factors import pivots
from normlab.analysis.stats.gaps import interval_text, signed
from normlab.analysis.render.ranking import markdown_table
from normlab.analysis.read.runs import MEASURES

HEADER = ("factor", "level", "minus the best level", "95% interval", "matched settings", "vs best level")


def effects_section(comparison: Comparison) -> list[str]:
    """The section's lines; empty when fewer than two keys vary between the arms."""
    if not comparison.effects:
        return []
    measure = MEASURES[comparison.measure]
    rows = []
    for effect in comparison.effects:
        rows.append([effect.factor, f"{effect.best} (best)", "—", "—", "—", "—"])
        for level in effect.levels:
            gap = level.effect
            interval = interval_text(gap) if gap.has_interval else "none: 1 pair" if gap.n == 1 else "—"
            side = "within noise" if gap.covers_zero else "worse" if gap.has_interval else "—"
            rows.append([effect.factor, str(level.level), signed(gap.diff), interval, str(gap.n), side])
    lines = [
        "## Factor effects",
        "",
        f"What each varying key does to the final {measure}: for each level, the mean over matched settings of "
        "its loss minus the factor's best level's. A setting is a value of every other varying key, and a "
        "matched setting one run at both levels; each arm counts at its best lr (its seeds' mean there). The "
        "best level has the lowest mean over the settings that ran every level. The 95% t interval is over the "
        "matched settings (none with one), per comparison and unadjusted; within noise where it covers 0. A norm knob such as `norm.alpha` is "
        "no setting of the norm factor (each norm at its best knob).",
        "",
        *markdown_table(HEADER, rows),
    ]
    for title, head, table in pivots(comparison.arms, comparison.dims):
        lines += ["", f"Final {measure} by norm × placement{' at ' + title if title else ''} (best lr, seed mean):", ""]
        lines += markdown_table(head, table)
    return lines
