"""The `csv` sink (MetricsCsv): metrics.csv, the run-level scalars of each record."""

from __future__ import annotations

import csv  # the standard library's (imports are absolute), not this module
import io
from pathlib import Path
from typing import Any

from normlab.train.sinks.base import Sink, SinkContext
from normlab.train.sinks.rundir import AppendOnlyLines, jsonable
from normlab.util.files import write_bytes_atomic


class MetricsCsv(Sink):
    """metrics.csv: one row per record with the run-level scalars (COLUMNS): every key the training loop
    writes into a record; the telemetry's keys (act/..., grad/..., attn/...) stay in metrics.jsonl."""

    COLUMNS = ("step", "tokens", "loss", "z_loss", "val_loss", "val_bpb", "lr", "grad_norm", "tokens_per_s", "status")

    def __init__(self, path: Path, start_step: int | None = None):
        kept = _rows_before(path, start_step) if start_step is not None else []
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
        self._fh.write_line(self._row({k: jsonable(v) for k, v in record.items() if k in self.COLUMNS}))

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        self._fh.close()


def _rows_before(path: Path, step: int) -> list[dict[str, str]]:
    """The rows of a metrics.csv whose step is below `step` (a resumed run writes the later ones again)."""
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return [row for row in csv.DictReader(fh) if row.get("step", "").isdigit() and int(row["step"]) < step]
