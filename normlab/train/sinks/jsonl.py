"""The `jsonl` sink (MetricsFile): metrics.jsonl, and end-of-run tables and images as files in the run dir."""

from __future__ import annotations

import json
from typing import Any

from normlab.train.sinks.base import Sink, SinkContext
from normlab.train.sinks.rundir import AppendOnlyLines, RunDir, jsonable


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
        self._fh.write_line(json.dumps({k: jsonable(v) for k, v in record.items()}, allow_nan=False) + "\n")

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run_dir.write_table(name, columns, rows)

    def log_image(self, name: str, png: bytes) -> None:
        self.run_dir.write_image(name, png)

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        self._fh.close()
