"""Where a run's records go: the run dir (RunDir), and the sinks the config chooses.

The training loop owns the run dir: it writes config.json and summary.json itself. Sinks only
add: `jsonl` (metrics.jsonl), `csv` (metrics.csv) and `wandb`, chosen by the config's `sinks`
list and built by name from SINKS. The loop hands every sink the same flat records (slash-grouped
keys, as wandb's dashboard groups them), and at the end of a run the same tables and PNG images
(named like 'telemetry/layers'). A sink never changes what it is given. A new sink is one class
here and one row of SINKS.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any


class Sink:
    """A destination for a run's records; every method does nothing unless a sink overrides it."""

    @classmethod
    def open(cls, run: "SinkContext") -> "Sink":
        """The sink for `run`, as train() builds it from the config's `sinks` list."""
        return cls()

    def log(self, record: dict[str, Any]) -> None:
        """One record (a logged step): {'step': s, 'tokens': ..., 'loss': ..., per-layer keys, ...}."""

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        """An end-of-run table, e.g. 'telemetry/layers'."""

    def log_image(self, name: str, png: bytes) -> None:
        """An end-of-run PNG image, e.g. 'telemetry/resid_rms'."""

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        """The run is over (summary.json is written); release what the sink holds."""


@dataclass
class SinkContext:
    """What a sink may need to open: the run's config, dir and name, and where the run starts."""

    cfg: Any  # the RunConfig
    run_dir: "RunDir"
    name: str
    run_id: str | None = None  # the wandb run id, kept across resumes
    start_step: int | None = None  # the checkpoint's step when resuming, None for a fresh run
    history: list[dict[str, Any]] = field(default_factory=list)  # records a resumed run already holds


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/inf; diverged runs must still write valid lines.
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` via a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str, allow_nan=False) + "\n")
    os.replace(tmp, path)


class RunDir:
    """The files of one run: config.json (the resolved config), summary.json, and what sinks add
    (metrics.jsonl: one object per logged step)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    def write_config(self, config: dict[str, Any]) -> None:
        """The run's resolved config as nested JSON (RunConfig.to_dict()), written atomically."""
        write_json_atomic(self.config_path, config)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary_path, {k: _jsonable(v) for k, v in summary.items()})

    def write_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> Path:
        """Write a table as `<name>.csv` in the run dir ('telemetry/layers' -> telemetry/layers.csv); None is an empty cell."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
        return self._write_atomic(f"{name}.csv", buffer.getvalue().encode())

    def write_image(self, name: str, png: bytes) -> Path:
        """Write PNG bytes as `<name>.png` in the run dir."""
        return self._write_atomic(f"{name}.png", png)

    def _write_atomic(self, relative: str, data: bytes) -> Path:
        path = self.path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return path


class MetricsFile(Sink):
    """Appends each record as one JSON line to the run dir's metrics.jsonl, flushed at once;
    writes end-of-run tables and images as CSV and PNG files in the run dir."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self._fh = open(run_dir.metrics_path, "a", buffering=1)

    @classmethod
    def open(cls, run: SinkContext) -> "MetricsFile":
        return cls(run.run_dir)  # train() has rewound metrics.jsonl to the checkpoint's step

    def log(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps({k: _jsonable(v) for k, v in record.items()}, allow_nan=False) + "\n")

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run_dir.write_table(name, columns, rows)

    def log_image(self, name: str, png: bytes) -> None:
        self.run_dir.write_image(name, png)

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        self._fh.close()


class MetricsCsv(Sink):
    """metrics.csv: one row per record with the run-level scalars (COLUMNS); per-layer keys stay in metrics.jsonl."""

    COLUMNS = ("step", "tokens", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "status")

    def __init__(self, path: Path, start_step: int | None = None):
        kept = _csv_rows_before(path, start_step) if start_step is not None else []
        self._fh = open(path, "w", newline="", buffering=1)
        self._writer = csv.DictWriter(self._fh, self.COLUMNS, extrasaction="ignore", lineterminator="\n")
        self._writer.writeheader()
        self._writer.writerows(kept)

    @classmethod
    def open(cls, run: SinkContext) -> "MetricsCsv":
        return cls(run.run_dir.path / "metrics.csv", run.start_step)

    def log(self, record: dict[str, Any]) -> None:
        self._writer.writerow({k: _jsonable(v) for k, v in record.items() if k in self.COLUMNS})

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        self._fh.close()


def _csv_rows_before(path: Path, step: int) -> list[dict[str, str]]:
    """The rows of a metrics.csv whose step is below `step` (a resumed run writes the later ones again)."""
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return [row for row in csv.DictReader(fh) if row.get("step", "").isdigit() and int(row["step"]) < step]


class WandbSink(Sink):
    """One wandb run per normlab run; offline by default, so no account is needed."""

    def __init__(
        self,
        wandb_cfg,
        run_dir: RunDir,
        name: str,
        config: dict[str, Any],
        tags: list[str],
        run_id: str | None = None,
        history: list[dict[str, Any]] | None = None,
    ):
        """`run_id`: the wandb run's id. `history`: when resuming, the records the run already holds.

        A resumed run continues the same id. Online, wandb resumes after the run's last recorded
        step; offline, wandb 0.31 ignores `resume` and starts a new offline-run-*-<id> dir, which
        `wandb sync` uploads after the earlier ones as the same run. Either way wandb drops a step
        lower than one it already has, so the history is replayed from the run's current step
        (0 offline): steps an earlier, killed process never got to wandb are filled in, none twice.
        """
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            id=run_id,
            resume="allow" if history is not None else None,
            project=wandb_cfg.project,
            entity=wandb_cfg.entity,
            group=wandb_cfg.group,
            name=name,
            tags=sorted(set(tags) | set(wandb_cfg.tags)),
            config=config,
            dir=str(run_dir.path),
            mode=wandb_cfg.mode,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        self._step: int | None = None
        for record in history or []:
            if record.get("step", -1) >= self.run.step:
                self.log(record)

    @classmethod
    def open(cls, run: SinkContext) -> "WandbSink":
        cfg = run.cfg
        tags = [f"norm={cfg.norm.label}", f"placement={cfg.placement}", f"qk_norm={str(cfg.qk_norm).lower()}"]
        history = run.history if run.start_step is not None else None
        return cls(cfg.wandb, run.run_dir, run.name, cfg.to_dict(), tags, run_id=run.run_id, history=history)

    def log(self, record: dict[str, Any]) -> None:
        self._step = record.get("step")
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=self._step)

    # Tables and images join the last record's step, so end-of-run products do not add steps to the run.
    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({name: self._wandb.Table(columns=columns, data=rows)}, step=self._step)

    def log_image(self, name: str, png: bytes) -> None:
        from PIL import Image

        self.run.log({name: self._wandb.Image(Image.open(io.BytesIO(png)))}, step=self._step)

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        try:
            self.run.summary.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
            if summary.get("status") == "preempted":
                self.run.mark_preempting()
        finally:
            self.run.finish(exit_code=exit_code)


# The sinks a config's `sinks` list may name.
SINKS: dict[str, type[Sink]] = {"jsonl": MetricsFile, "csv": MetricsCsv, "wandb": WandbSink}


def open_sinks(run: SinkContext) -> list[Sink]:
    """The sinks `run.cfg.sinks` names, in its order; wandb is left out under wandb.mode=disabled."""
    return [SINKS[name].open(run) for name in run.cfg.sinks if not (name == "wandb" and run.cfg.wandb.mode == "disabled")]
