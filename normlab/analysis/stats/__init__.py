"""The statistics of a comparison: runs grouped into arms (arms.py), repeats counted once (repeats.py), stability
(stability.py), 95% intervals (intervals.py), gaps to the best arm (gaps.py), factor effects (factors.py), the lr
grid's edges (bracketing.py), all put together as a Comparison (comparison.py). Numbers only: nothing is drawn or
written here."""
