"""A sink: where a run's records, end-of-run tables and images go (Sink), what it opens with (SinkContext),
and finishing every sink of a run (finish_all)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from normlab.train.sinks.rundir import RunDir


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
    run_dir: RunDir
    name: str
    run_id: str | None = None  # the wandb run id, kept across resumes
    start_step: int | None = None  # the checkpoint's step when resuming, None for a fresh run
    history: list[dict[str, Any]] = field(default_factory=list)  # records a resumed run already holds


def finish_all(sinks: list[Sink], summary: dict[str, Any], exit_code: int) -> BaseException | None:
    """Finish every sink, even when one fails; return the first failure (None if all finished)."""
    first: BaseException | None = None
    for sink in sinks:
        try:
            sink.finish(summary, exit_code)
        except Exception as err:
            first = first or err
    return first
