"""95% t intervals of loss differences: paired over seeds, Welch's for unpaired samples, and a mean's.

Each is the textbook t interval, mean ± t₀.₉₇₅(df) · standard error, with Student's t quantile from
scipy (`scipy.special.stdtrit`): scipy.stats would compute the same intervals (the tests check them
against `ttest_rel`, `ttest_ind(equal_var=False)` and `ttest_1samp`), but importing it costs compare
about a second of CPU, and scipy.special a third of that. The intervals are per comparison, not
adjusted for how many comparisons a report makes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A difference (a − b) with its 95% interval; `low`/`high` are NaN where there is none (n = 1).

    `kind` is "paired" (over `n` shared seeds), "Welch" (over `n` and `n_other` values) or "mean" (of
    `n` differences); `n_other` is 0 except for Welch's.
    """

    diff: float
    low: float
    high: float
    kind: str
    n: int
    n_other: int = 0

    @property
    def has_interval(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    @property
    def covers_zero(self) -> bool:
        """Within noise: the interval holds 0 (False without an interval)."""
        return self.has_interval and self.low <= 0 <= self.high


def t_quantile(df: float) -> float:
    """Student's t quantile at (1 + LEVEL) / 2 for `df` degrees of freedom."""
    from scipy.special import stdtrit  # scipy only once an interval is computed

    return float(stdtrit(df, (1 + LEVEL) / 2))


def mean_interval(diffs: list[float], kind: str = "mean") -> Interval:
    """The mean of `diffs` with its t interval (n − 1 degrees of freedom); no interval for fewer than two."""
    n = len(diffs)
    mean = statistics.fmean(diffs) if diffs else math.nan
    if n < 2:
        return Interval(mean, math.nan, math.nan, kind, n)
    half = t_quantile(n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, kind, n)


def paired(a: dict, b: dict) -> Interval:
    """mean(a[s] − b[s]) over the keys (seeds) both hold, with its paired t interval."""
    shared = [s for s in a if s in b]
    return mean_interval([a[s] - b[s] for s in shared], kind="paired")


def welch(a: list[float], b: list[float]) -> Interval:
    """mean(a) − mean(b) with Welch's t interval (Welch–Satterthwaite degrees of freedom); none unless
    each sample holds two values or more."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return Interval(diff, math.nan, math.nan, "Welch", len(a), len(b))
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(diff, diff, diff, "Welch", len(a), len(b))
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(df) * se
    return Interval(diff, diff - half, diff + half, "Welch", len(a), len(b))


def difference(a: dict, b: dict) -> Interval:
    """a − b for two arms' losses by seed: paired over the seeds both ran when there are two or more, else
    Welch's over all their seeds; without an interval when either arm has one seed."""
    if sum(1 for s in a if s in b) >= 2:
        return paired(a, b)
    return welch(list(a.values()), list(b.values()))
