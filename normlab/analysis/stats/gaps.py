"""How sure the ranking is: each arm's gap to the best arm with its 95% interval, and the answer's verdict.

An arm's gap is its final loss minus the best arm's, each at its own best lr: paired over the seeds both
ran there (a seed fixes the training batches and, across norms, placements and lrs of one shape, the
initialization: docs/compare.md), Welch's over all their seeds when they share fewer than two, and no
interval when either ran one seed. An arm whose interval holds 0 is within noise of the best.
"""

from __future__ import annotations

import math
from typing import Any

from normlab.analysis.stats.arms import Arm, ArmResult
from normlab.analysis.stats.intervals import Interval, difference


def seed_losses(result: ArmResult) -> dict[Any, float]:
    """The arm's final loss by seed at its best lr (seeds that finished; all do at a best lr)."""
    point = result.best_point
    if point is None:
        return {}
    return {run.seed: run.final_val_loss for run in point.counted if math.isfinite(run.outcome_loss)}


def gaps_to_best(ranked: list[ArmResult]) -> dict[Arm, Interval]:
    """Each ranked arm but the best (and those without a best lr): its loss minus the best arm's."""
    if not ranked or ranked[0].best_point is None:
        return {}
    best = seed_losses(ranked[0])
    return {r.arm: difference(seed_losses(r), best) for r in ranked[1:] if seed_losses(r)}


def signed(value: float) -> str:
    return f"{value:+.4f}".replace("-", "−") if math.isfinite(value) else "—"


def over(gap: Interval) -> str:
    """What the interval is over: '3 paired seeds', 'Welch, 2 vs 3 seeds', '1 seed: no interval'."""
    if gap.kind == "paired" and gap.n >= 2:
        return f"{gap.n} paired seeds"
    if gap.has_interval:
        return f"Welch, {gap.n} vs {gap.n_other} seeds"
    return "1 seed: no interval"


def interval_text(gap: Interval) -> str:
    return f"[{signed(gap.low)}, {signed(gap.high)}]" if gap.has_interval else "—"


def verdict(ranked: list[ArmResult], gaps: dict[Arm, Interval]) -> str:
    """How sure the ranking's top is, in one sentence; '' when fewer than two arms can be ranked."""
    if len(ranked) < 2 or ranked[1].arm not in gaps:
        return ""
    best, second = ranked[0].arm.label, ranked[1].arm.label
    gap = gaps[ranked[1].arm]
    if not gap.has_interval:
        single = [r.arm.label for r in ranked[:2] if len(seed_losses(r)) < 2]
        return f"No interval for its gap to {second}: {' and '.join(single)} ran one seed; add seeds."
    noise = {r.arm for r in ranked[1:] if r.arm in gaps and gaps[r.arm].covers_zero}
    if not noise:
        return f"{best} beats {second} by {gap.diff:.4f} {interval_text(gap)}, {over(gap)}."
    top = 1 + next((i for i, r in enumerate(ranked[1:]) if r.arm not in noise), len(ranked) - 1)
    if top == 1 + len(noise):
        return f"The top {top} arms are within noise of {best} (95% intervals of their gaps cover 0): add seeds."
    return f"{len(noise)} arm{'s are' if len(noise) > 1 else ' is'} within noise of {best}, {second} among them: add seeds."


def seed_count_note(ranked: list[ArmResult]) -> str | None:
    """A note when the arms ran different numbers of seeds at their best lr; None when they all ran as many."""
    by_count: dict[int, list[str]] = {}
    for result in ranked:
        if n := len(seed_losses(result)):
            by_count.setdefault(n, []).append(result.arm.label)
    if len(by_count) < 2:
        return None
    listed = "; ".join(f"{n} seed{'s' if n > 1 else ''}: {', '.join(labels)}" for n, labels in sorted(by_count.items(), reverse=True))
    return (f"The arms ran different numbers of seeds at their best lr ({listed}): their gaps to the best are over "
            "different n, and a 1-seed arm has no interval.")
