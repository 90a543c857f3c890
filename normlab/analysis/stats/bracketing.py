"""Whether each arm's best lr is bracketed: an lr below and one above it were run (a diverged one counts).

When the best lr is the smallest or the largest the arm ran, its optimum may lie beyond the grid: the
ranked table marks it and a note names the lr to add, one step of the arm's own grid further (the ratio
of its two outermost lrs on that side), rounded to a nearby 1, 2, 3 or 5 × 10ᵏ when one is within 15%
(a 1e-3, 3e-3 grid goes on to 1e-2, as such grids do).
"""

from __future__ import annotations

import math

from normlab.analysis.stats.arms import ArmResult
from normlab.config import format_lr

ROUND = (1.0, 2.0, 3.0, 5.0)
NEAR = 1.15


def run_lrs(result: ArmResult) -> list[float]:
    """The lrs of the arm that have an ended run (completed, diverged or failed), ascending."""
    return [p.lr for p in result.points if p.counted and math.isfinite(p.lr)]


def edge(result: ArmResult) -> str | None:
    """'largest', 'smallest' or 'only' when the arm's best lr is at that edge of the lrs it ran; else None."""
    lrs = run_lrs(result)
    if not math.isfinite(result.best_lr) or not lrs:
        return None
    if len(lrs) == 1:
        return "only"
    if result.best_lr == lrs[-1]:
        return "largest"
    if result.best_lr == lrs[0]:
        return "smallest"
    return None


def rounded(lr: float) -> float:
    """`lr` as the nearest 1, 2, 3 or 5 × 10ᵏ when one is within 15%, else to two significant digits."""
    exponent = math.floor(math.log10(lr))
    candidates = [float(f"{m:g}e{e}") for e in (exponent, exponent + 1) for m in ROUND]  # 3e-4, not 3 × 1e-4
    near = min(candidates, key=lambda c: abs(math.log(c / lr)))
    return near if max(near / lr, lr / near) <= NEAR else float(f"{lr:.1e}")


def next_lr(result: ArmResult) -> float | None:
    """The lr to add beyond the edge the best lr sits at, by the arm's grid ratio; None when not at an edge
    of two lrs or more."""
    lrs, at = run_lrs(result), edge(result)
    if at == "largest":
        return rounded(lrs[-1] * lrs[-1] / lrs[-2])
    if at == "smallest":
        return rounded(lrs[0] * lrs[0] / lrs[1])
    return None


def _advice(result: ArmResult) -> str | None:
    at = edge(result)
    if at is None:
        return None
    best = format_lr(result.best_lr)
    if at == "only":
        return f"ran one lr ({best}), so the optimum is not bracketed; add a smaller and a larger lr"
    return f"best lr {best} is the {at} run; add lr={format_lr(next_lr(result))}"


def bracket_notes(results: list[ArmResult]) -> list[str]:
    """'layer-pre: best lr 3e-3 is the largest run; add lr=1e-2', one note per advice (arms that share
    one are listed together); none when every best lr is bracketed."""
    arms: dict[str, list[str]] = {}
    for result in results:
        if (advice := _advice(result)) is not None:
            arms.setdefault(advice, []).append(result.arm.label)
    every = len(results) > 2  # 'every arm' reads better than eight labels, and says it of the whole grid
    return [f"{'every arm' if every and len(labels) == len(results) else ', '.join(labels)}: {advice}"
            for advice, labels in arms.items()]
