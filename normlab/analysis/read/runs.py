"""Run dirs read back: the files a run writes, and each run as compare sees it (Run).

A run dir is any directory holding summary.json, metrics.jsonl, metrics.csv or config.json (the
run's RunConfig as train() writes it); a run killed before it wrote summary.json is read from the
others. find_run_dirs finds them under a run dir, a sweep dir or the outputs/ root, load_run
reads one, load_runs reads them all. Its metric rows come from records.py.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from normlab import keys
from normlab.analysis.read.records import METRICS, METRICS_FILES, layer_series, number_text, read_records
from normlab.config import flatten_config
from normlab.config.errors import shown
from normlab.util.errors import one_line

SUMMARY = "summary.json"
CONFIG = "config.json"
HYDRA_CONFIG = Path(".hydra") / "config.yaml"  # read only in run dirs without config.json

# What compare ranks runs by: validation loss in nats per token, or in bits per byte when the runs'
# tokenizers differ (nats per token of different tokenizers are not comparable; bits per byte are).
MEASURES = {"val_loss": "val loss", "val_bpb": "val bits/byte"}
BYTE_TOKENIZER = "bytes-v1"  # the identity of runs that record no tokenizer: before tokenizers, normlab read bytes

ATTN_LOGIT_MAX = "attn/logit_max"  # per-layer telemetry: the largest pre-softmax attention logit of the block
# The whole-block per-layer statistics compare reads: its layer profiles' and the largest attention logit.
LAYER_STATS = frozenset([*(stat for stat, _, _ in keys.LAYER_PROFILES), ATTN_LOGIT_MAX])

# Summary keys, and the config keys they fall back to.
SUMMARY_TO_CONFIG = {"norm": "norm.name", "placement": "placement", "depth": "depth", "lr": "lr", "seed": "seed"}


class CompareError(Exception):
    """Input compare cannot use; the message is one line."""


@dataclass
class Run:
    """One run dir as compare sees it: its summary, its config (flat dotted keys) and its metric rows."""

    path: Path
    summary: dict[str, Any]
    settings: dict[str, Any]
    rows: list[dict[str, Any]]
    bad_lines: int = 0  # metrics lines that were not readable rows (a run killed mid-write, a damaged file)
    measure: str = "val_loss"  # the validation measure its losses below are in (a key of MEASURES)
    metrics_file: str | None = METRICS  # the file its rows were read from: metrics.jsonl, metrics.csv, or None
    _curves: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict, repr=False, compare=False)

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
        return self._marked_divergence

    @cached_property
    def _marked_divergence(self) -> int | None:
        """The step of the first row marked `"status": "diverged"` (compare reads it often: once)."""
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
    def did_not_start(self) -> bool:
        """Failed before its first step (bad data, a tokenizer error, wandb unreachable): no metric row at all."""
        return self.status == "failed" and not self.rows

    @property
    def error(self) -> str:
        """summary.json's error, on one line."""
        return one_line(self.summary.get("error") or "no error recorded")

    @property
    def environment(self) -> dict[str, Any] | None:
        """summary.json's environment block (python, torch, cuda, device, torch_threads, ...), None without one."""
        block = self.summary.get("environment")
        return block if isinstance(block, dict) else None

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
        if key not in self._curves:
            self._curves[key] = self._read_curve(key)
        return self._curves[key]

    def _read_curve(self, key: str) -> tuple[list[int], list[float]]:
        steps, values, cut = [], [], self._cut()
        for row in self.rows:
            if key in row and "step" in row and row["step"] < cut:
                value = keys.to_float(row[key])
                if math.isfinite(value):
                    steps.append(row["step"])
                    values.append(value)
        return steps, values

    @cached_property
    def _layers(self) -> dict[str, list[tuple[int, dict[int, float]]]]:
        """The per-layer statistics compare shows (LAYER_STATS), of the rows before any divergence, read once."""
        return layer_series(self._rows_before_cut(), LAYER_STATS)

    def _rows_before_cut(self) -> list[dict[str, Any]]:
        cut = self._cut()
        return [row for row in self.rows if row.get("step", math.inf) < cut]

    def layer_series(self, stat: str) -> list[tuple[int, dict[int, float]]]:
        """[(step, {layer index: value}), ...] of per-layer statistic `stat` (one of LAYER_STATS) at every
        telemetry row before any divergence."""
        if stat not in LAYER_STATS:
            return layer_series(self._rows_before_cut(), frozenset([stat])).get(stat, [])
        return self._layers.get(stat, [])

    def layer_profile(self, stat: str, which: str) -> dict[int, float]:
        """{layer index: value} of per-layer statistic `stat` (e.g. 'grad/norm') at the first or last
        telemetry row before any divergence; `which` is 'first' or 'last'. Empty if the run has none."""
        series = self.layer_series(stat)
        if not series:
            return {}
        return series[0 if which == "first" else -1][1]

    def has_layer_stat(self, stat: str) -> bool:
        return bool(self.layer_series(stat))


RUN_FILES = (SUMMARY, *METRICS_FILES, CONFIG)  # a dir holding any of them is a run dir: a killed run has no summary.json


def path_list(given: Iterable[Any]) -> list[str | os.PathLike]:
    """The paths `given` names, each a path (a str or an os.PathLike) or a list (any iterable) of paths, in order:
    load_runs(a, b), load_runs([a, b]) and compare([a, b]) alike. TypeError naming anything else."""
    paths: list[str | os.PathLike] = []
    for item in given:
        single = isinstance(item, (str, bytes, os.PathLike)) or not isinstance(item, Iterable)
        for path in [item] if single else item:
            if not isinstance(path, (str, os.PathLike)):
                raise TypeError(f"{shown(path)} is not a path: give run dirs, sweep dirs or outputs/ (a str or an "
                                "os.PathLike each), one by one or in a list")
            paths.append(path)
    return paths


def find_run_dirs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Every run dir (a dir holding summary.json, metrics.jsonl, metrics.csv or config.json) at or under `paths`,
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
    """Read one run dir: summary.json, its config (see _read_config) and its metric rows (metrics.jsonl, else metrics.csv).

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
    rows, bad_lines, metrics_file = read_records(path)
    return Run(path=path, summary=summary, settings=settings, rows=rows, bad_lines=bad_lines, metrics_file=metrics_file)


class SkippedRun(UserWarning):
    """A run dir load_runs left out, as `normlab compare` leaves it out: the message says which and why."""


def load_runs(*paths: str | os.PathLike | Iterable[str | os.PathLike], errors: str = "skip") -> list[Run]:
    """Every run dir at or under `paths` (run dirs, sweep dirs, the outputs/ root; given one by one or in a list, as
    compare takes them), loaded, sorted by path.

    For a notebook: `[{**run.settings, **run.summary} for run in load_runs("multirun/...")]` is a table,
    one row per run. A run dir load_run cannot read (a damaged summary.json) is, with errors="skip" (the
    default), left out with a SkippedRun warning saying "skipped <why>", as compare notes it; with
    errors="raise", a CompareError. A path that does not exist raises CompareError either way.
    """
    if errors not in ("skip", "raise"):
        raise ValueError(f"errors={errors!r}: choose 'skip' or 'raise'")
    runs = []
    for path in sorted(find_run_dirs(path_list(paths))):
        try:
            runs.append(load_run(path))
        except CompareError as err:
            if errors == "raise":
                raise
            warnings.warn(f"skipped {err}", SkippedRun, stacklevel=2)
    return runs


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
        if float in types and isinstance(value, str) and not number_text(value):
            raise CompareError(f"{path}: {key}={json.dumps(value)[:60]} is not a number: a number, or \"inf\", \"-inf\" or \"nan\" as text")


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
        from omegaconf import OmegaConf  # only for run dirs of old versions: most reads never need it

        try:
            container = OmegaConf.to_container(OmegaConf.load(run_dir / HYDRA_CONFIG), resolve=False)
        except Exception:  # OmegaConf raises a variety of errors on a damaged file
            return {}
    else:
        return {}
    if not isinstance(container, dict):
        return {}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in flatten_config(container).items()}
