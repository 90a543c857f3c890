"""The comparison's analysis: run dirs read back (runs.py), grouped into arms with each arm's LR
sensitivity (arms.py), put together as a Comparison (comparison.py). It reads and computes only: the
`compare` command (compare.py) writes the report with report.py and plots.py.
"""

from normlab.analysis.arms import (
    NOT_ARM_KEYS,
    Arm,
    ArmResult,
    condition_label,
    lr_sensitivity,
    mean_std,
    order_key,
)
from normlab.analysis.comparison import Comparison, build_comparison
from normlab.analysis.runs import (
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
