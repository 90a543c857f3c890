"""Where a run's records go: the run dir (RunDir), and the sinks the config chooses.

The training loop owns the run dir: it writes config.json and summary.json itself. Sinks only
add: `jsonl` (metrics.jsonl), `csv` (metrics.csv) and `wandb`, chosen by the config's `sinks`
list and built by name from SINKS. The loop hands every sink the same flat records (slash-grouped
keys, as wandb's dashboard groups them), and at the end of a run the same tables and PNG images
(named like 'telemetry/layers'). A sink never changes what it is given. A new sink is one module
here (beside jsonl.py, csv.py, wandb.py) and one row of SINKS (registry.py).
"""

from normlab.train.sinks.base import Sink, SinkContext, finish_all
from normlab.train.sinks.csv import MetricsCsv
from normlab.train.sinks.jsonl import MetricsFile
from normlab.train.sinks.registry import SINKS, open_sinks
from normlab.train.sinks.rundir import (
    RESERVE_BYTES,
    RESERVE_NAME,
    AppendOnlyLines,
    RunDir,
    RunDirBusy,
    RunDirGone,
    disk_full,
)
from normlab.train.sinks.wandb import MINIMIZED, WandbSink, WandbUnavailable, user_wandb_settings, wandb_config

__all__ = [
    "MINIMIZED", "RESERVE_BYTES", "RESERVE_NAME", "SINKS",
    "AppendOnlyLines", "MetricsCsv", "MetricsFile", "RunDir", "RunDirBusy", "RunDirGone", "Sink", "SinkContext", "WandbSink",
    "WandbUnavailable",
    "disk_full", "finish_all", "open_sinks", "user_wandb_settings", "wandb_config",
]
