"""The sinks a config's `sinks` list may name (SINKS, as config.SINK_NAMES lists them), and opening them."""

from __future__ import annotations

from normlab.train.sinks.base import Sink, SinkContext
from normlab.train.sinks.csv import MetricsCsv
from normlab.train.sinks.jsonl import MetricsFile
from normlab.train.sinks.wandb import WandbSink

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
