"""What each factor does: for every key that varies between the arms (norm, placement, depth, ...), each
level's mean difference to the factor's best level over matched settings of the other factors, and the
norm × placement pivot of final loss.

A setting is a value of every other varying key; a matched pair is a setting run at both levels. Each
arm counts at its best lr (the mean over its seeds there). The best level is the one with the lowest
mean loss over the settings that ran every level (over all its settings when none did). The interval
is the t interval of the mean over the matched pairs (none with one pair); it treats the settings as
the replicates, and is per comparison, unadjusted. A norm knob (`norm.alpha`) is read by some norms
only: it is no setting of the norm factor (each norm counts at its best knob), and the norms that do
not read it are no level of its own factor.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from normlab.analysis.stats.arms import NORM, PLACEMENT, ArmResult, dim_order
from normlab.analysis.stats.gaps import interval_text, signed
from normlab.analysis.stats.intervals import Interval, mean_interval


@dataclass(frozen=True)
class LevelEffect:
    """One level of a factor against the factor's best level: the mean difference over matched settings."""

    level: Any
    effect: Interval  # level − best, kind "mean", n = matched pairs


@dataclass(frozen=True)
class FactorEffect:
    factor: str
    best: Any
    levels: list[LevelEffect]  # the other levels, in the dimension's order


def _others(dim: str, dims: list[str]) -> list[str]:
    return [d for d in dims if d != dim and not (dim == NORM and d.startswith("norm."))]


def loss_table(arms: list[ArmResult], dim: str, dims: list[str]) -> dict[Any, dict[tuple, float]]:
    """{level: {setting of the other dims: best loss}} over the arms with a best loss (the lowest where
    several arms share a level and setting, as norms at different knobs do)."""
    others = _others(dim, dims)
    table: dict[Any, dict[tuple, float]] = {}
    for result in arms:
        level = result.arm.value(dim)
        if level is None or not math.isfinite(result.best_loss):
            continue
        setting = tuple(repr(result.arm.value(d)) for d in others)
        cell = table.setdefault(level, {})
        cell[setting] = min(cell.get(setting, math.inf), result.best_loss)
    return table


def _best_level(table: dict[Any, dict[tuple, float]]) -> Any:
    complete = set.intersection(*(set(cells) for cells in table.values()))

    def mean(level: Any) -> float:
        cells = table[level]
        return statistics.fmean(cells[s] for s in complete) if complete else statistics.fmean(cells.values())

    return min(table, key=mean)


def factor_effect(arms: list[ArmResult], dim: str, dims: list[str]) -> FactorEffect | None:
    """`dim`'s effect over `arms` (see the module's docstring); None with fewer than two levels."""
    table = loss_table(arms, dim, dims)
    if len(table) < 2:
        return None
    best = _best_level(table)
    levels = []
    for level in sorted(table, key=lambda v: dim_order(dim, v)):
        if level != best:
            pairs = [loss - table[best][s] for s, loss in table[level].items() if s in table[best]]
            levels.append(LevelEffect(level, mean_interval(pairs)))
    return FactorEffect(dim, best, levels)


def factor_effects(arms: list[ArmResult], dims: list[str]) -> list[FactorEffect]:
    """Each varying dimension's effect, when two or more vary (with one, the ranked table is its effect)."""
    if len(dims) < 2:
        return []
    return [effect for dim in dims if (effect := factor_effect(arms, dim, dims)) is not None]


def level_text(effect: LevelEffect) -> str:
    n = effect.effect.n
    if n == 0:
        return f"{effect.level} no matched setting"
    spread = f" {interval_text(effect.effect)}" if effect.effect.has_interval else ""
    noise = ", within noise" if effect.effect.covers_zero else ""
    return f"{effect.level} {signed(effect.effect.diff)}{spread} ({n} matched{noise})"


def factor_line(effect: FactorEffect) -> str:
    """'placement: pre best; post +0.0450 [+0.0300, +0.0600] (4 matched)'."""
    return f"{effect.factor}: {effect.best} best; " + "; ".join(level_text(level) for level in effect.levels)


def pivots(arms: list[ArmResult], dims: list[str]) -> list[tuple[str, list[str], list[list[str]]]]:
    """When norm and placement both vary: (title, header, rows) of a norm × placement table of best final
    loss, one per setting of the other varying keys (title '' when none vary)."""
    if NORM not in dims or PLACEMENT not in dims:
        return []
    rest = _others(NORM, [d for d in dims if d != PLACEMENT])  # each norm at its best knob, as in its factor
    norms = sorted({r.arm.norm for r in arms}, key=lambda v: dim_order(NORM, v))
    places = sorted({r.arm.placement for r in arms}, key=lambda v: dim_order(PLACEMENT, v))
    groups: dict[tuple, list[ArmResult]] = {}
    for result in arms:
        groups.setdefault(tuple(result.arm.value(d) for d in rest), []).append(result)
    tables = []
    for setting in sorted(groups, key=lambda s: tuple(dim_order(d, v) for d, v in zip(rest, s))):
        cells: dict[tuple[str, str], float] = {}
        for r in groups[setting]:
            key = (r.arm.norm, r.arm.placement)
            cells[key] = min(cells.get(key, math.inf), r.best_loss)
        rows = [[norm, *(_loss(cells.get((norm, p), math.nan)) for p in places)] for norm in norms]
        title = ", ".join(f"{d}={v}" for d, v in zip(rest, setting) if v is not None)
        tables.append((title, ["norm", *places], rows))
    return tables


def _loss(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "—"
