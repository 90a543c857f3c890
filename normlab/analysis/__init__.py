"""Analysis: what runs wrote, read back and compared, in three stages.

    read/     run dirs into Run objects: config, summary, metric rows
    stats/    runs into arms, intervals, gaps, factor effects: a Comparison (numbers only)
    render/   a Comparison into the ranked table, report.md, plots and exports

The commands sit on top: `normlab compare` (compare.py) and `normlab ls` (listing.py). This package reads run
dirs with normlab.config, normlab.keys and normlab.util alone; it never imports the training code.
"""

from normlab.analysis.stats.arms import (
    NOT_ARM_KEYS,
    Arm,
    ArmResult,
    condition_label,
    lr_sensitivity,
    mean_std,
    order_key,
)
from normlab.analysis.stats.comparison import Comparison, build_comparison
from normlab.analysis.read.runs import (
    CONFIG,
    MEASURES,
    METRICS,
    SUMMARY,
    CompareError,
    Run,
    SkippedRun,
    find_run_dirs,
    load_run,
    load_runs,
)

__all__ = [
    "CONFIG",
    "MEASURES",
    "METRICS",
    "NOT_ARM_KEYS",
    "SUMMARY",
    "Arm",
    "ArmResult",
    "CompareError",
    "Comparison",
    "Run",
    "SkippedRun",
    "build_comparison",
    "condition_label",
    "find_run_dirs",
    "load_run",
    "load_runs",
    "lr_sensitivity",
    "mean_std",
    "order_key",
]
