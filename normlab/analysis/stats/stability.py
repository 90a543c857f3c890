"""Training stability from what a run already logs: its largest gradient norm, its largest attention
logit, and its loss spikes.

A loss spike follows OLMo-core's StabilityMonitorCallback: a value is a spike when it exceeds the
mean of the `window` values before it by more than `k` of their standard deviations (population
std), checked only once `window` values precede it, and never when their std is ~0. OLMo-core's
defaults are k = 6 over 128 steps; normlab's records hold one loss every `log_every` steps (every
10 by default), so the window here counts logged losses: 20 of them, 200 steps at log_every=10.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from normlab.analysis.read.runs import ATTN_LOGIT_MAX, Run

SPIKE_K = 6.0  # standard deviations above the running mean (OLMo-core's threshold_std)
SPIKE_WINDOW = 20  # logged training losses the running mean and std are taken over
GRAD_NORM = "grad_norm"  # the loop's global gradient norm, before clipping


def spike_steps(steps: Sequence[int], losses: Sequence[float], k: float = SPIKE_K, window: int = SPIKE_WINDOW) -> list[int]:
    """The steps whose loss exceeds the mean of the `window` losses before it by more than `k` standard deviations."""
    spikes = []
    for i in range(window, len(losses)):
        before = losses[i - window : i]
        mean = math.fsum(before) / window
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in before) / window)
        if std > 1e-10 and losses[i] > mean + k * std:
            spikes.append(steps[i])
    return spikes


@dataclass(frozen=True)
class RunStability:
    """One run's stability figures, up to any divergence; NaN or None where the run logged nothing to measure."""

    max_grad_norm: float
    max_attn_logit: float
    spikes: int | None  # None: fewer than SPIKE_WINDOW + 1 logged losses, too few to tell


def run_stability(run: Run) -> RunStability:
    grad_norms = run.curve(GRAD_NORM)[1]
    logits = [value for _, values in run.layer_series(ATTN_LOGIT_MAX) for value in values.values()]
    steps, losses = run.curve("loss")
    return RunStability(
        max_grad_norm=max(grad_norms, default=math.nan),
        max_attn_logit=max(logits, default=math.nan),
        spikes=len(spike_steps(steps, losses)) if len(losses) > SPIKE_WINDOW else None,
    )


@dataclass(frozen=True)
class ArmStability:
    """An arm's stability over all its runs (every lr and seed): the largest of each figure, the spikes summed."""

    max_grad_norm: float
    max_attn_logit: float
    spikes: int | None  # None when none of its runs was long enough to tell
    runs_with_spikes: int
    runs_checked: int

    @property
    def spikes_per_run(self) -> float:
        return self.spikes / self.runs_checked if self.spikes is not None else math.nan


def arm_stability(runs: Iterable[Run]) -> ArmStability:
    figures = [run_stability(run) for run in runs]
    checked = [f.spikes for f in figures if f.spikes is not None]
    return ArmStability(
        max_grad_norm=_max_finite(f.max_grad_norm for f in figures),
        max_attn_logit=_max_finite(f.max_attn_logit for f in figures),
        spikes=sum(checked) if checked else None,
        runs_with_spikes=sum(1 for n in checked if n),
        runs_checked=len(checked),
    )


def _max_finite(values: Iterable[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan
