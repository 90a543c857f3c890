"""Runs grouped into arms, their labels, and each arm's LR sensitivity and seed spread.

Runs are grouped into arms: norm × placement, split further by any other config key whose
value differs between the runs (depth, init, warmup, ...), except the learning rate (the
sweep's axis), the seed (replicates) and the bookkeeping keys. An arm's label names only what
varies across the arms compared (norm and placement first); what every run shares is one
line of common settings. For each arm this module computes the LR sensitivity of Wortsman et
al. 2023 and the seed mean and spread at each learning rate; comparison.py puts it all
together for the report and the plots.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from normlab.analysis.read.runs import Run
from normlab.analysis.stats.stability import ArmStability, arm_stability
from normlab.config import NORMS, PLACEMENTS, bookkeeping_keys, format_lr, reads_key
from normlab.keys import to_float

# Config keys that may differ inside one arm: lr is the sweep's axis, seed makes replicates, and the
# schema's bookkeeping keys (a key under a listed sub-config too) change no number of the result.
NOT_ARM_KEYS = ("lr", "seed", *bookkeeping_keys())


def order_key(value: Any, known: tuple[str, ...]) -> tuple:
    """Sort known names (norms, placements) in normlab's order, unknown ones after, alphabetically."""
    return (known.index(value), "") if value in known else (len(known), str(value))


def value_key(value: Any) -> tuple:
    """Sort config values numbers first, by size (depth 4 before 12), then anything else as text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value, "")
    return (1, 0, str(value))


NORM, PLACEMENT = "norm", "placement"  # the two dimensions of every arm; any other is a config key


def dim_order(dim: str, value: Any) -> tuple:
    """Sort a dimension's values: norms and placements in normlab's order, config values numbers first."""
    if dim == NORM:
        return order_key(value, NORMS)
    if dim == PLACEMENT:
        return order_key(value, PLACEMENTS)
    return value_key(value)


@dataclass(frozen=True)
class Arm:
    """One ablation arm: a norm in a placement, plus any other config values that set it apart.

    `label` names what tells it apart from the other arms compared (see labelled); alone, it is
    the full name ('rms-pre depth=12').
    """

    norm: str
    placement: str
    extras: tuple[tuple[str, Any], ...] = ()
    label: str = field(default="", compare=False)

    def __post_init__(self):
        if not self.label:
            object.__setattr__(self, "label", self.full_label)

    @property
    def full_label(self) -> str:
        return " ".join([f"{self.norm}-{self.placement}", *(f"{k}={v}" for k, v in self.extras)])

    def value(self, dim: str) -> Any:
        """The arm's value of `dim` (NORM, PLACEMENT or a config key; None for a knob its norm does not read)."""
        if dim == NORM:
            return self.norm
        if dim == PLACEMENT:
            return self.placement
        return dict(self.extras).get(dim)

    def sort_key(self) -> tuple:
        return (order_key(self.norm, NORMS), order_key(self.placement, PLACEMENTS), self.extras_key())

    def extras_key(self) -> tuple:
        return tuple((k, value_key(v)) for k, v in self.extras)


def arm_keys(runs: list[Run]) -> list[str]:
    """Config keys beyond norm and placement that split runs into arms: those whose values differ."""
    keys = sorted({k for run in runs for k in run.settings})
    # A run without a config file lacks most keys: that alone must not split the arms.
    varying = [k for k in keys if len({repr(run.settings[k]) for run in runs if k in run.settings}) > 1]
    return [
        k
        for k in varying
        if k not in ("norm.name", "placement") and not any(k == p or k.startswith(p + ".") for p in NOT_ARM_KEYS)
    ]


def arm_of(run: Run, keys: list[str]) -> Arm:
    """`run`'s arm: its norm, placement and values of the arm `keys`, less the keys its choices make it not
    read (config.reads_key: a LayerNorm run of a sweep over DyT's α is one LayerNorm arm, not one arm per
    unused α; a pre-norm run of a sweep over mix_p is one arm)."""
    return Arm(run.norm, run.placement, tuple((k, run.settings.get(k)) for k in keys if reads_key(run.settings, k)))


def varying_dims(arms: list[Arm]) -> list[str]:
    """What differs between `arms`: NORM, PLACEMENT (each if it takes more than one value), then the config keys."""
    extras = list(dict.fromkeys(k for arm in arms for k, _ in arm.extras))
    return [dim for dim in (NORM, PLACEMENT, *extras) if len({repr(arm.value(dim)) for arm in arms}) > 1]


def labelled(arm: Arm, dims: list[str], named: Iterable[str] = ()) -> Arm:
    """`arm` labelled by its values of `dims` alone: 'rms-pre' when both norm and placement vary, 'rms' or 'pre'
    when one does, then the `named` words (a preset: 'model=tiny'), then `key=value` of each other key (a knob
    its norm does not read is left out)."""
    head = "-".join(str(arm.value(d)) for d in (NORM, PLACEMENT) if d in dims)
    tail = [*named, *(f"{d}={arm.value(d)}" for d in dims if d not in (NORM, PLACEMENT) and arm.value(d) is not None)]
    return replace(arm, label=" ".join(filter(None, [head, *tail])) or arm.full_label)


def common_settings(runs: list[Run]) -> list[tuple[str, Any]]:
    """The config keys every run (that records the key) shares, as (key, value): norm and placement first, then
    the config's order; unset values, bookkeeping keys and keys no run reads (config.reads_key) left out."""
    keys = list(dict.fromkeys(k for run in runs for k in run.settings))
    shared = []
    for key in keys:
        values = {repr(run.settings[key]) for run in runs if key in run.settings}
        value = next(run.settings[key] for run in runs if key in run.settings)
        if len(values) > 1 or value in (None, (), []):
            continue
        bookkeeping = any(key == p or key.startswith(p + ".") for p in NOT_ARM_KEYS if p not in ("lr", "seed"))
        if not bookkeeping and any(reads_key(run.settings, key) for run in runs):
            shared.append(("norm" if key == "norm.name" else key, value))
    first = [item for item in shared if item[0] in (NORM, PLACEMENT)]
    return first + [item for item in shared if item[0] not in (NORM, PLACEMENT)]


def setting_text(key: str, value: Any) -> str:
    """`key=value` as an override would write it: lr as 3e-3, a list as [a,b]."""
    if key == "lr":
        return f"lr={format_lr(to_float(value))}"
    if isinstance(value, (list, tuple)):
        return f"{key}=[{','.join(map(str, value))}]"
    return f"{key}={value}"


def condition_label(arm: Arm, lr: float) -> str:
    """What a plot panel holds fixed across arms: the lr and the extra keys, e.g. 'lr=1e-3 depth=8'."""
    return " ".join([f"lr={format_lr(lr)}", *(f"{k}={v}" for k, v in arm.extras)])


def lr_sensitivity(loss_at_lr: Mapping[float, float], init_loss: float) -> float:
    """Wortsman et al. 2023: mean over the swept lrs η of [min(ℓ(η), ℓ₀) − ℓ*], with ℓ* = min_η ℓ(η).

    ℓ(η) is +inf for a run that diverged or failed, so it contributes ℓ₀ − ℓ*.
    NaN when there are fewer than two lrs (one lr says nothing of the sensitivity, and its formula
    would give 0), no ℓ₀, or every lr diverged (no ℓ*).
    """
    losses = list(loss_at_lr.values())
    best = min(losses, default=math.inf)
    if not (len(losses) > 1 and math.isfinite(best) and math.isfinite(init_loss)):
        return math.nan
    return sum(min(loss, init_loss) - best for loss in losses) / len(losses)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN std for fewer than two values)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


@dataclass
class LrPoint:
    """The runs of one arm at one learning rate, one per seed."""

    lr: float
    runs: list[Run]

    @property
    def counted(self) -> list[Run]:
        return [run for run in self.runs if run.outcome_loss is not None]

    @property
    def loss(self) -> float:
        """ℓ(η): the seeds' mean final val loss, +inf if any seed diverged or failed; NaN if none finished."""
        losses = [run.outcome_loss for run in self.counted]
        return statistics.fmean(losses) if losses else math.nan

    @property
    def finished_losses(self) -> list[float]:
        return [run.final_val_loss for run in self.counted if math.isfinite(run.outcome_loss)]

    @property
    def n_lost(self) -> int:
        """Seeds that diverged or failed."""
        return sum(1 for run in self.counted if not math.isfinite(run.outcome_loss))


@dataclass
class ArmResult:
    """An arm's runs by learning rate, with its ℓ₀, ℓ*, and LR sensitivity."""

    arm: Arm
    points: list[LrPoint]
    init_loss: float = math.nan
    best_loss: float = math.nan
    best_lr: float = math.nan
    sensitivity: float = math.nan
    sensitivity_std: float = math.nan  # over seeds that ran every lr, when there are two or more
    n_seeds_for_std: int = 0
    stability: ArmStability | None = None

    @property
    def runs(self) -> list[Run]:
        return [run for point in self.points for run in point.runs]

    @property
    def best_point(self) -> LrPoint | None:
        """The runs at the best lr (None when no lr finished every seed)."""
        return next((p for p in self.points if p.lr == self.best_lr), None)

    @property
    def n_lost(self) -> int:
        return sum(point.n_lost for point in self.points)

    @property
    def n_counted(self) -> int:
        return sum(len(point.counted) for point in self.points)

    def rank_key(self) -> tuple:
        """Best final validation loss first; arms without one last, in normlab's order."""
        finite = math.isfinite(self.best_loss)
        return (not finite, self.best_loss if finite else 0.0, self.arm.sort_key())


def summarize_arm(arm: Arm, runs: list[Run]) -> ArmResult:
    by_lr: dict[float, list[Run]] = {}
    for run in runs:
        by_lr.setdefault(run.lr, []).append(run)
    points = [LrPoint(lr, sorted(rs, key=lambda r: (value_key(r.seed), str(r.path)))) for lr, rs in sorted(by_lr.items())]
    result = ArmResult(arm, points, stability=arm_stability(runs))
    result.init_loss = _mean_finite(run.init_loss for run in runs)
    loss_at_lr = {p.lr: p.loss for p in points if p.counted}
    if loss_at_lr:
        best_lr = min(loss_at_lr, key=loss_at_lr.get)
        if math.isfinite(loss_at_lr[best_lr]):
            result.best_lr, result.best_loss = best_lr, loss_at_lr[best_lr]
    result.sensitivity = lr_sensitivity(loss_at_lr, result.init_loss)
    per_seed = _per_seed_sensitivities(points)
    if len(per_seed) > 1:
        result.sensitivity_std = statistics.stdev(per_seed)
        result.n_seeds_for_std = len(per_seed)
    return result


def _per_seed_sensitivities(points: list[LrPoint]) -> list[float]:
    """One LR sensitivity per seed that finished a run at every lr of the arm (with its own ℓ₀)."""
    lrs = [p.lr for p in points if p.counted]
    seeds = {run.seed for p in points for run in p.counted}
    values = []
    for seed in seeds:
        mine = {p.lr: [r for r in p.counted if r.seed == seed] for p in points}
        if any(len(mine[lr]) != 1 for lr in lrs):
            continue
        sens = lr_sensitivity({lr: mine[lr][0].outcome_loss for lr in lrs}, _mean_finite(mine[lr][0].init_loss for lr in lrs))
        if math.isfinite(sens):
            values.append(sens)
    return values


def _mean_finite(values: Iterable[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def sensitivity_reason(result: ArmResult) -> str | None:
    """Why the arm has no LR sensitivity, in a few words; None when it has one."""
    if math.isfinite(result.sensitivity):
        return None
    lrs = [p.lr for p in result.points if p.counted]
    if not lrs:
        return "no run of the arm has ended (all still running or killed)"
    if len(lrs) == 1:
        return f"it needs at least two learning rates; the arm ran one (lr={format_lr(lrs[0])})"
    if not math.isfinite(result.best_loss):
        return "every learning rate of the arm diverged or failed, so there is no best loss ℓ*"
    return "no validation loss at step 0 (ℓ₀): the runs did not evaluate at initialization"
