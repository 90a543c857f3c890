"""Where a run's records go: the run dir (RunDir), and the sinks the config chooses.

The training loop owns the run dir: it writes config.json and summary.json itself. Sinks only
add: `jsonl` (metrics.jsonl), `csv` (metrics.csv) and `wandb`, chosen by the config's `sinks`
list and built by name from SINKS. The loop hands every sink the same flat records (slash-grouped
keys, as wandb's dashboard groups them), and at the end of a run the same tables and PNG images
(named like 'telemetry/layers'). A sink never changes what it is given. A new sink is one class
here and one row of SINKS.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import logging
import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Iterator

RESERVE_NAME = ".summary.reserve"
RESERVE_BYTES = 256 * 1024  # room kept for summary.json, so a run that fills the disk still records how it ended


class RunDirBusy(RuntimeError):
    """Another process is writing this run dir; the message is one line."""

from normlab import keys
from normlab.util.files import exclusive, write_bytes_atomic, write_json_atomic

log = logging.getLogger("normlab")


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


def disk_full(err: BaseException) -> bool:
    """Whether `err` says the disk (or the user's quota) is full."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


# The run dirs this process holds locked: path -> holders. flock locks belong to an open file, so a second
# lock of the same dir in this process (the Hydra layer's, then train()'s) reuses the first.
_HELD: dict[Path, int] = {}


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
        """summary.json, written atomically; the room reserve() kept is given back first, so the summary
        of a run that filled the disk still fits."""
        (self.path / RESERVE_NAME).unlink(missing_ok=True)
        write_json_atomic(self.summary_path, {k: _jsonable(v) for k, v in summary.items()})

    def reserve(self) -> None:
        """Keep RESERVE_BYTES of disk for summary.json (a hidden file that write_summary removes)."""
        path = self.path / RESERVE_NAME
        try:
            with open(path, "wb") as fh:
                fh.write(bytes(RESERVE_BYTES))
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the run dir's lock (an flock on the directory itself, so no file is added) for the duration;
        raise RunDirBusy at once if another process holds it. The kernel drops the lock when its process
        dies, however it dies."""
        key = self.path.resolve()
        with contextlib.ExitStack() as held:
            if key not in _HELD:
                try:
                    held.enter_context(exclusive(key, wait=False))
                except BlockingIOError:
                    raise RunDirBusy(
                        f"{self.path} is in use: another normlab run is writing it; wait for that run to end, or choose another run dir"
                    ) from None
                held.callback(_HELD.pop, key)
            _HELD[key] = _HELD.get(key, 0) + 1
            try:
                yield
            finally:
                _HELD[key] -= 1

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
        write_bytes_atomic(path, data)
        return path


class AppendOnlyLines:
    """A file that grows by whole lines only: each line goes to the file in one write() and, if that write
    fails or falls short (a full disk), the file is cut back to its last complete line before the error is raised."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size

    def write_line(self, line: str) -> None:
        data = line.encode()
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        except BaseException:
            os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class MetricsFile(Sink):
    """Appends each record as one JSON line to the run dir's metrics.jsonl, at once and whole (a line
    that cannot be written in full is not left torn); writes end-of-run tables and images as CSV and
    PNG files in the run dir."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self._fh = AppendOnlyLines(run_dir.metrics_path)

    @classmethod
    def open(cls, run: SinkContext) -> "MetricsFile":
        return cls(run.run_dir)  # train() has rewound metrics.jsonl to the checkpoint's step

    def log(self, record: dict[str, Any]) -> None:
        self._fh.write_line(json.dumps({k: _jsonable(v) for k, v in record.items()}, allow_nan=False) + "\n")

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
        write_bytes_atomic(path, "".join(self._row(row) for row in [dict(zip(self.COLUMNS, self.COLUMNS)), *kept]).encode())
        self._fh = AppendOnlyLines(path)

    @classmethod
    def open(cls, run: SinkContext) -> "MetricsCsv":
        return cls(run.run_dir.path / "metrics.csv", run.start_step)

    def _row(self, row: dict[str, Any]) -> str:
        buffer = io.StringIO()
        csv.DictWriter(buffer, self.COLUMNS, extrasaction="ignore", lineterminator="\n").writerow(row)
        return buffer.getvalue()

    def log(self, record: dict[str, Any]) -> None:
        self._fh.write_line(self._row({k: _jsonable(v) for k, v in record.items() if k in self.COLUMNS}))

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        self._fh.close()


def _csv_rows_before(path: Path, step: int) -> list[dict[str, str]]:
    """The rows of a metrics.csv whose step is below `step` (a resumed run writes the later ones again)."""
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return [row for row in csv.DictReader(fh) if row.get("step", "").isdigit() and int(row["step"]) < step]


class WandbUnavailable(RuntimeError):
    """An online wandb run could not start (no network, no API key) and wandb.on_unreachable=stop; one line."""


# Keys whose wandb summary is the best (min) value and the final one.
MINIMIZED = ("val_loss", "val_bpb")


class WandbSink(Sink):
    """One wandb run per normlab run; offline unless the user's wandb settings or the config say otherwise.

    What the user set in wandb's own way (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_ID,
    WANDB_RESUME, a `wandb agent`'s run, `wandb offline`/`wandb online`) applies unless the config
    sets the same thing (a non-null wandb.mode, wandb.project, wandb.entity). An online run that
    cannot start within wandb.init_timeout seconds either records offline, with one warning, or
    raises WandbUnavailable, as wandb.on_unreachable says.
    """

    def __init__(self, wandb_cfg, run_dir: RunDir, name: str, config: dict[str, Any], tags: list[str],
                 run_id: str | None = None, history: list[dict[str, Any]] | None = None):
        """`run_id`: the wandb run's id (WANDB_RUN_ID wins over it). `history`: when resuming, the records
        the run already holds.

        A resumed run continues the same id. Online, wandb resumes after the run's last recorded
        step; offline, wandb 0.31 ignores `resume` and starts a new offline-run-*-<id> dir, which
        `wandb sync` uploads after the earlier ones as the same run. Either way wandb drops a step
        lower than one it already has, so the history is replayed from the run's current step
        (0 offline): steps an earlier, killed process never got to wandb are filled in, none twice.
        """
        import wandb

        self._wandb = wandb
        self._layers = wandb_cfg.layers
        user = user_wandb_settings()
        given = user.model_fields_set
        kwargs = dict(
            id=user.run_id if "run_id" in given else run_id,
            resume=user.resume if "resume" in given else None if history is None else "allow",
            project=wandb_cfg.project or (user.project if "project" in given else "normlab"),
            entity=wandb_cfg.entity or (user.entity if "entity" in given else None),
            group=wandb_cfg.group,
            job_type="train",
            name=name,
            tags=sorted(set(tags) | set(wandb_cfg.tags)),
            config=config,
            dir=str(run_dir.path),
            mode=wandb_cfg.mode or (user.mode if "mode" in given else "offline"),
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", init_timeout=wandb_cfg.init_timeout,
                                    login_timeout=wandb_cfg.init_timeout),
        )
        self.run = self._init(kwargs, wandb_cfg.on_unreachable)
        self._define_metrics()
        self._step: int | None = None
        for record in history or []:
            if record.get("step", -1) >= self.run.step:
                self.log(record)

    def _init(self, kwargs: dict[str, Any], on_unreachable: str):
        """wandb.init(**kwargs); an online run that cannot start records offline, or raises WandbUnavailable."""
        try:
            return self._wandb.init(**kwargs)
        except self._wandb.errors.Error as err:  # UsageError: no API key; CommError: no network, timed out
            if kwargs["mode"] in ("offline", "dryrun"):  # nothing to reach: a fault of its own
                raise
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if on_unreachable == "stop":
            raise WandbUnavailable(
                f"wandb could not start an online run ({reason}); set wandb.on_unreachable=offline to record "
                "offline and `wandb sync` later, or wandb.mode=offline"
            )
        log.warning("wandb could not start an online run (%s): recording offline under %s/wandb; "
                    "`wandb sync` uploads it later", reason, kwargs["dir"])
        # wandb's service still holds the failed run's id; a fresh service lets the offline run keep it.
        self._wandb.teardown()
        return self._wandb.init(**{**kwargs, "mode": "offline"})

    def _define_metrics(self) -> None:
        """`step` is every key's x-axis (`tokens` may be chosen instead); val_loss and val_bpb are summarised
        by their minimum and their last value."""
        self.run.define_metric("step")
        self.run.define_metric("tokens")
        self.run.define_metric("*", step_metric="step")
        for key in MINIMIZED:
            self.run.define_metric(key, step_metric="step", summary="min,last")

    @classmethod
    def open(cls, run: SinkContext) -> Sink:
        """The wandb run for `run`; a do-nothing sink when wandb is disabled (wandb.mode or WANDB_MODE)."""
        cfg = run.cfg
        if (cfg.wandb.mode or user_wandb_settings().mode) == "disabled":
            return Sink()
        tags = [f"norm={cfg.norm.label}", f"placement={cfg.placement}", f"qk_norm={str(cfg.qk_norm).lower()}"]
        history = run.history if run.start_step is not None else None
        return cls(cfg.wandb, run.run_dir, run.name, wandb_config(cfg, run.run_dir), tags, run_id=run.run_id,
                   history=history)

    def log(self, record: dict[str, Any]) -> None:
        self._step = record.get("step")
        if not self._layers:
            record = {k: v for k, v in record.items() if keys.parse(k) is None}
        self.run.log(record, step=self._step)

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


def user_wandb_settings():
    """wandb's settings as the user made them outside normlab: its settings files (`wandb offline`) and
    WANDB_* environment variables. `model_fields_set` names the ones that were set."""
    import wandb

    # Where `wandb offline` writes, as wandb.setup finds it.
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb").expanduser()
    settings = wandb.Settings(silent=True, settings_system=str(config_dir / "settings"))
    settings.update_from_system_settings()
    settings.update_from_env_vars(dict(os.environ))
    return settings


def wandb_config(cfg, run_dir: RunDir) -> dict[str, Any]:
    """The run's config as wandb shows it: RunConfig's sections, plus what one groups and filters runs by
    (`arm`, `norm.label`), the run dir and the command line's overrides; without the wandb section
    (its facts are the run's own) and the schema's placeholder `name`."""
    config = cfg.to_dict()
    config.pop("name", None)
    overrides = config.pop("wandb")["overrides"]
    config["norm"]["label"] = cfg.norm.label
    config.update(arm=cfg.label, run_dir=str(run_dir.path.resolve()), overrides=" ".join(overrides))
    return config


# The sinks a config's `sinks` list may name.
SINKS: dict[str, type[Sink]] = {"jsonl": MetricsFile, "csv": MetricsCsv, "wandb": WandbSink}


def open_sinks(run: SinkContext, into: list[Sink] | None = None) -> list[Sink]:
    """The sinks `run.cfg.sinks` names, in its order; wandb is left out under wandb.mode=disabled.

    Each opened sink is appended to `into` (a new list by default) as soon as it is open, so a caller
    that passed its list finishes the ones that opened even when a later one fails to."""
    opened = [] if into is None else into
    for name in run.cfg.sinks:
        if not (name == "wandb" and run.cfg.wandb.mode == "disabled"):
            opened.append(SINKS[name].open(run))
    return opened


def finish_all(sinks: list[Sink], summary: dict[str, Any], exit_code: int) -> BaseException | None:
    """Finish every sink, even when one fails; return the first failure (None if all finished)."""
    first: BaseException | None = None
    for sink in sinks:
        try:
            sink.finish(summary, exit_code)
        except Exception as err:
            first = first or err
    return first
