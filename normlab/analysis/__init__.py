"""The comparison's analysis: run dirs read back, grouped into arms, and each arm's LR sensitivity.

A run dir is any directory holding summary.json (next to metrics.jsonl and config.json, the
run's RunConfig as train() writes it). Runs are grouped into arms: norm × placement, split further by
any other config key whose value differs between the runs (depth, init, warmup, ...),
except the learning rate (the sweep's axis) and the seed (replicates). For each arm
this module computes the LR sensitivity of Wortsman et al. 2023 and the seed mean and
spread at each learning rate. It reads and computes only: the `compare` command
(compare.py) writes the report with report.py and plots.py, which import only this module.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from normlab import keys
from normlab.util.errors import one_line
from normlab.config import NORM_TRAITS, NORMS, PLACEMENTS, bookkeeping_keys, flatten_config, format_lr

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
CONFIG = "config.json"
HYDRA_CONFIG = Path(".hydra") / "config.yaml"  # read only in run dirs without config.json

# What compare ranks runs by: validation loss in nats per token, or in bits per byte when the runs'
# tokenizers differ (nats per token of different tokenizers are not comparable; bits per byte are).
MEASURES = {"val_loss": "val loss", "val_bpb": "val bits/byte"}
BYTE_TOKENIZER = "bytes-v1"  # the identity of runs that record no tokenizer: before tokenizers, normlab read bytes

# Summary keys, and the config keys they fall back to.
SUMMARY_TO_CONFIG = {"norm": "norm.name", "placement": "placement", "depth": "depth", "lr": "lr", "seed": "seed"}
# Config keys that may differ inside one arm: lr is the sweep's axis, seed makes replicates, and the
# schema's bookkeeping keys (a key under a listed sub-config too) change no number of the result.
NOT_ARM_KEYS = ("lr", "seed", *bookkeeping_keys())


class CompareError(Exception):
    """Input compare cannot use; the message is one line."""


def order_key(value: Any, known: tuple[str, ...]) -> tuple:
    """Sort known names (norms, placements) in normlab's order, unknown ones after, alphabetically."""
    return (known.index(value), "") if value in known else (len(known), str(value))


def value_key(value: Any) -> tuple:
    """Sort config values numbers first, by size (depth 4 before 12), then anything else as text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value, "")
    return (1, 0, str(value))


# ------------------------------------------------------------------------------------------ runs


@dataclass
class Run:
    """One run dir as compare sees it: its summary, its config (flat dotted keys) and its metric rows."""

    path: Path
    summary: dict[str, Any]
    settings: dict[str, Any]
    rows: list[dict[str, Any]]
    bad_lines: int = 0  # metrics.jsonl lines that were not readable rows (a run killed mid-write, a damaged file)
    measure: str = "val_loss"  # the validation measure its losses below are in (a key of MEASURES)

    @property
    def norm(self) -> str:
        return str(self.settings.get("norm.name", "?"))

    @property
    def placement(self) -> str:
        return str(self.settings.get("placement", "?"))

    @property
    def depth(self) -> int | None:
        return self.settings.get("depth")

    @property
    def lr(self) -> float:
        return keys.to_float(self.settings.get("lr"))

    @property
    def seed(self) -> int | None:
        return self.settings.get("seed")

    @property
    def last_step(self) -> int | None:
        """The last step metrics.jsonl holds a row for, or None."""
        return max((row["step"] for row in self.rows if isinstance(row.get("step"), int)), default=None)

    @property
    def diverged_step(self) -> int | None:
        if self.summary.get("diverged_step") is not None:
            return int(self.summary["diverged_step"])
        marked = [row["step"] for row in self.rows if row.get("status") == "diverged" and "step" in row]
        return int(marked[0]) if marked else None

    @property
    def status(self) -> str:
        """completed | diverged | failed | running (the process was killed, or still runs) | incomplete (no summary.json)."""
        if self.summary.get("status"):
            return str(self.summary["status"])
        if self.diverged_step is not None:
            return "diverged"
        return "completed" if math.isfinite(self.final_val_loss) else "running"

    @property
    def tokenizer(self) -> str:
        return str(self.summary.get("tokenizer") or BYTE_TOKENIZER)

    @property
    def final_val_loss(self) -> float:
        """The last validation loss, in the run's `measure` (as are best_val_loss, init_loss, outcome_loss)."""
        if f"final_{self.measure}" in self.summary:
            return keys.to_float(self.summary[f"final_{self.measure}"])
        steps, values = self.curve(self.measure)
        return values[-1] if steps else math.nan

    @property
    def best_val_loss(self) -> float:
        if f"best_{self.measure}" in self.summary:
            return keys.to_float(self.summary[f"best_{self.measure}"])
        _, values = self.curve(self.measure)
        return min(values, default=math.nan)

    @property
    def tokens_per_s(self) -> float:
        return keys.to_float(self.summary.get("tokens_per_s"))

    @property
    def init_loss(self) -> float:
        """ℓ₀: the validation loss at initialization (step 0), NaN if step 0 was not evaluated."""
        for row in self.rows:
            if row.get("step") == 0 and self.measure in row:
                return keys.to_float(row[self.measure])
        return math.nan

    @property
    def outcome_loss(self) -> float | None:
        """ℓ(η) for the LR sensitivity: the final val loss; +inf if the run diverged or failed; None while running."""
        if self.status in ("diverged", "failed"):
            return math.inf
        if self.status != "completed":
            return None
        loss = self.final_val_loss
        return loss if math.isfinite(loss) else math.inf

    def _cut(self) -> float:
        step = self.diverged_step
        return math.inf if step is None else step

    def curve(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of metric `key`: finite values only, and only before the divergence step."""
        steps, values = [], []
        for row in self.rows:
            if key in row and "step" in row and row["step"] < self._cut():
                value = keys.to_float(row[key])
                if math.isfinite(value):
                    steps.append(row["step"])
                    values.append(value)
        return steps, values

    def layer_profile(self, stat: str, which: str) -> dict[int, float]:
        """{layer index: value} of per-layer statistic `stat` (e.g. 'grad/norm') at the first or last
        telemetry row before any divergence; `which` is 'first' or 'last'. Empty if the run has none."""
        rows = [row for row in self.rows if row.get("step", math.inf) < self._cut() and keys.layer_values(row, stat)]
        if not rows:
            return {}
        return keys.layer_values(rows[0] if which == "first" else rows[-1], stat)

    def has_layer_stat(self, stat: str) -> bool:
        return any(keys.layer_values(row, stat) for row in self.rows)


RUN_FILES = (SUMMARY, METRICS, CONFIG)  # a dir holding any of them is a run dir: a killed run has no summary.json


def find_run_dirs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Every run dir (a dir holding summary.json, metrics.jsonl or config.json) at or under `paths`,
    skipping wandb/ and hidden dirs."""
    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise CompareError(f"{raw}: no such file or directory")
        if path.is_file():
            if path.name not in RUN_FILES:
                raise CompareError(f"{raw}: not a directory: give a run dir, a sweep dir or the outputs/ root")
            path = path.parent
        for root, dirs, files in os.walk(path):
            if any(name in files for name in RUN_FILES):
                found[Path(root).resolve()] = None
                dirs[:] = []
            else:
                dirs[:] = sorted(d for d in dirs if d != "wandb" and not d.startswith("."))
    return list(found)


def load_run(path: Path) -> Run:
    """Read one run dir: summary.json, its config (see _read_config) and metrics.jsonl.

    A run without summary.json (killed before it wrote one) is read from its other files, with
    status "incomplete". Raises CompareError if its summary.json is not a JSON object (or not UTF-8),
    or a value compare uses has the wrong type.
    """
    summary: dict[str, Any] = {"status": "incomplete"}
    if (path / SUMMARY).exists():
        try:
            summary = json.loads((path / SUMMARY).read_bytes().decode("utf-8"))
        except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError
            raise CompareError(f"{path / SUMMARY}: unreadable ({one_line(err, limit=10**6)})") from None
        if not isinstance(summary, dict):
            raise CompareError(f"{path / SUMMARY}: not a JSON object")
        _check_summary_types(path / SUMMARY, summary)
    settings = _read_config(path)
    for summary_key, config_key in SUMMARY_TO_CONFIG.items():
        if summary.get(summary_key) is not None:
            settings[config_key] = summary[summary_key]
    rows, bad_lines = _read_metrics(path / METRICS)
    return Run(path=path, summary=summary, settings=settings, rows=rows, bad_lines=bad_lines)


# Summary keys compare computes with, and the JSON types each may hold (null is allowed for all).
SUMMARY_TYPES = {
    "status": (str,), "error": (str,), "norm": (str,), "placement": (str,), "lr": (int, float, str), "seed": (int,),
    "depth": (int,), "diverged_step": (int,), "final_val_loss": (int, float, str), "best_val_loss": (int, float, str),
    "tokens_per_s": (int, float, str), "steps": (int,),
}  # fmt: skip


def _check_summary_types(path: Path, summary: dict[str, Any]) -> None:
    for key, types in SUMMARY_TYPES.items():
        value = summary.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            allowed = " or ".join("a number" if t is float else {int: "an integer", str: "a string"}[t] for t in types)
            raise CompareError(f"{path}: {key}={json.dumps(value)[:60]} has the wrong type: it must be {allowed}")


def _read_config(run_dir: Path) -> dict[str, Any]:
    """The run's config as flat dotted keys, from normlab's own <run dir>/config.json (RunConfig.to_dict()).

    Run dirs written before normlab wrote config.json have only Hydra's .hydra/config.yaml: that is
    read instead, and only then. A missing or damaged config gives {}: it costs the run every config
    key but those its summary.json holds, not its place in the comparison.
    """
    if (run_dir / CONFIG).is_file():
        try:
            container = json.loads((run_dir / CONFIG).read_text())
        except (OSError, ValueError):
            return {}
    elif (run_dir / HYDRA_CONFIG).is_file():
        from omegaconf import OmegaConf

        try:
            container = OmegaConf.to_container(OmegaConf.load(run_dir / HYDRA_CONFIG), resolve=False)
        except Exception:  # OmegaConf raises a variety of errors on a damaged file
            return {}
    else:
        return {}
    if not isinstance(container, dict):
        return {}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in flatten_config(container).items()}


def _read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    if not path.is_file():
        return [], 0
    rows, bad = [], 0
    with open(path, "rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))  # a line of invalid UTF-8 is a bad line, like torn JSON
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict) and _row_is_sound(row):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def _row_is_sound(row: dict[str, Any]) -> bool:
    """A metrics row compare can use: an integer step (if any) and number-like values where it reads numbers."""
    step = row.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        return False
    return all(_number_like(v) for k, v in row.items() if k not in ("step", "status") and not isinstance(v, str))


def _number_like(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


# ------------------------------------------------------------------------------------------ arms


@dataclass(frozen=True)
class Arm:
    """One ablation arm: a norm in a placement, plus any other config values that set it apart."""

    norm: str
    placement: str
    extras: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return " ".join([f"{self.norm}-{self.placement}", *(f"{k}={v}" for k, v in self.extras)])

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
    """`run`'s arm: its norm, placement and values of the arm `keys`, less the norm knobs its norm does not
    read (a LayerNorm run of a sweep over DyT's α is one LayerNorm arm, not one arm per unused α)."""
    return Arm(run.norm, run.placement, tuple((k, run.settings.get(k)) for k in keys if _reads(run.norm, k)))


def _reads(norm: str, key: str) -> bool:
    """Whether a run of `norm` reads config key `key`: every key but a `norm.KNOB` of a known norm without
    that knob."""
    knob = key.removeprefix("norm.")
    return knob == key or norm not in NORM_TRAITS or knob in NORM_TRAITS[norm].knobs


def condition_label(arm: Arm, lr: float) -> str:
    """What a plot panel holds fixed across arms: the lr and the extra keys, e.g. 'lr=1e-3 depth=8'."""
    return " ".join([f"lr={format_lr(lr)}", *(f"{k}={v}" for k, v in arm.extras)])


def lr_sensitivity(loss_at_lr: Mapping[float, float], init_loss: float) -> float:
    """Wortsman et al. 2023: mean over the swept lrs η of [min(ℓ(η), ℓ₀) − ℓ*], with ℓ* = min_η ℓ(η).

    ℓ(η) is +inf for a run that diverged or failed, so it contributes ℓ₀ − ℓ*.
    NaN when there is no lr, no ℓ₀, or every lr diverged (no ℓ*).
    """
    losses = list(loss_at_lr.values())
    best = min(losses, default=math.inf)
    if not (losses and math.isfinite(best) and math.isfinite(init_loss)):
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

    @property
    def runs(self) -> list[Run]:
        return [run for point in self.points for run in point.runs]


def summarize_arm(arm: Arm, runs: list[Run]) -> ArmResult:
    by_lr: dict[float, list[Run]] = {}
    for run in runs:
        by_lr.setdefault(run.lr, []).append(run)
    points = [LrPoint(lr, sorted(rs, key=lambda r: (value_key(r.seed), str(r.path)))) for lr, rs in sorted(by_lr.items())]
    result = ArmResult(arm, points)
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


# ------------------------------------------------------------------------------------------ the comparison


@dataclass
class Comparison:
    """Everything the report and the plots show: runs sorted by arm, lr and seed, and one result per arm."""

    runs: list[Run]
    arms: list[ArmResult]
    arm_of: dict[Path, Arm]
    root: Path  # common ancestor of the run dirs; run dirs are shown relative to it
    notes: list[str] = field(default_factory=list)
    measure: str = "val_loss"  # what every loss of the comparison is in (see comparison_measure)

    def run_label(self, run: Run) -> str:
        rel = os.path.relpath(run.path, self.root)
        return run.path.name if rel == "." else rel


def build_comparison(run_dirs: list[Path]) -> Comparison:
    """Load the run dirs and group them into arms. Unreadable runs are skipped with a note."""
    runs, notes = [], []
    for path in run_dirs:
        try:
            runs.append(load_run(path))
        except CompareError as err:
            notes.append(f"skipped {err}")
    if not runs:
        raise CompareError(f"no readable runs: {notes[0].removeprefix('skipped ')}" if notes else "no runs")
    measure = comparison_measure(runs)
    for run in runs:
        run.measure = measure
    keys = arm_keys(runs)
    arm_by_path = {run.path: arm_of(run, keys) for run in runs}
    grouped: dict[Arm, list[Run]] = {}
    for run in runs:
        grouped.setdefault(arm_by_path[run.path], []).append(run)
    grouped = {arm: _once_each(members, keys, notes) for arm, members in grouped.items()}
    arms = [summarize_arm(arm, grouped[arm]) for arm in sorted(grouped, key=Arm.sort_key)]
    ordered = [run for result in arms for run in result.runs]
    root = Path(os.path.commonpath([run.path for run in ordered]))
    for run in ordered:
        if run.outcome_loss is None:
            notes.append(f"{run.path.name} has status {run.status!r} (killed or still running): left out of the LR sensitivity")
        if run.bad_lines:
            notes.append(f"{run.path.name}: {run.bad_lines} line(s) of {METRICS} were not readable rows (torn, not UTF-8 JSON, or of the wrong types) and were ignored")
    return Comparison(runs=ordered, arms=arms, arm_of=arm_by_path, root=root, notes=notes, measure=measure)


def _once_each(members: list[Run], keys: list[str], notes: list[str]) -> list[Run]:
    """An arm's runs with each training counted once: of runs at the same lr and seed that differ only in
    norm knobs the arm's norm does not read (arm_of leaves those out), the first is kept and the others
    noted. Runs of one config at one lr and seed (a sweep run twice) are kept, as before."""
    first: dict[tuple, Run] = {}
    kept = []
    for run in members:
        twin = first.setdefault((run.lr, run.seed), run)
        unread = [k for k in keys if twin.settings.get(k) != run.settings.get(k)]
        if twin is not run and unread:
            notes.append(f"{run.path.name}: the same training as {twin.path.name} ({run.norm} does not read "
                         f"{', '.join(unread)}): counted once")
            continue
        kept.append(run)
    return kept


def comparison_measure(runs: list[Run]) -> str:
    """val_bpb when the runs' tokenizers differ (their losses per token are not comparable), else val_loss."""
    return "val_bpb" if len({run.tokenizer for run in runs}) > 1 else "val_loss"
