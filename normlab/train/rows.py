"""The run's logged rows on their way to the sinks (Rows), in step order.

A telemetry step's statistics leave the device without blocking the host (normlab.telemetry.readback), so its row
waits here for them: a callback hands Rows what completes the row and how to tell it has arrived (`later`), and
the row is written once that has been read. The loop offers the waiting rows to the sinks in the next step, once
that step's work is on the device (`flush(wait=False)`: the host reads the values and writes the row while the
device computes, and leaves a row whose copy has not landed yet for later rather than wait for it); a row still
waiting is written, waiting if it must, with the next logged row (whose step has waited for the device already) and
wherever the run needs every row so far on disk: before a checkpoint, before the run's last record, and when the
run stops (diverged, signalled, failed). A row that waits for nothing is written at once, after the rows before it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from normlab.train.sinks import Sink

Record = dict[str, Any]


class Rows:
    """The rows of one run: handed to `sinks` in step order, each once complete."""

    def __init__(self, sinks: Sequence[Sink]):
        self.sinks = sinks
        self._waiting: list[Record] = []  # rows handed to `write` that wait for a read, or for a row before them
        self._reads: list[tuple[Record, tuple[Callable[[], Mapping[str, Any]], Callable[[], bool]]]] = []
        self._then: list[tuple[Record, Callable[[Record], None]]] = []

    def later(self, record: Record, read: Callable[[], Mapping[str, Any]], ready: Callable[[], bool] = lambda: True
              ) -> None:
        """What `read()` returns joins `record` (a logged step's, not yet written) when its row is written; `ready()`
        says whether reading now would not wait."""
        self._reads.append((record, (read, ready)))

    def written(self, record: Record, then: Callable[[Record], None]) -> None:
        """Call `then(record)` once `record`'s row is written, complete: now if it is."""
        if any(row is record for row in self._waiting):
            self._then.append((record, then))
        else:
            then(record)

    def write(self, record: Record) -> None:
        """Write `record`'s row: now, with any rows that wait before it, unless it waits for a read itself."""
        self._waiting.append(record)
        if not any(row is record for row, _ in self._reads):
            self.flush()

    def flush(self, wait: bool = True) -> None:
        """Complete the waiting rows (reading what they wait for) and write them, in step order: every one, or
        without `wait` those before the first whose reads are not ready. A read that fails leaves its row without
        what it would have added; the row is written, and the first failure raised after."""
        failure: Exception | None = None
        while self._waiting:
            record = self._waiting[0]
            if not wait and not all(ready() for row, (_, ready) in self._reads if row is record):
                break
            self._waiting.pop(0)
            reads, self._reads = _split(self._reads, record)
            thens, self._then = _split(self._then, record)
            for read, _ in reads:
                try:
                    record.update(read())
                except Exception as err:
                    failure = failure or err
            for sink in self.sinks:
                sink.log(record)
            for then in thens:
                then(record)
        if failure is not None:
            raise failure

    def close(self) -> None:
        """The run stops: write the rows still waiting. A failure is said on the log rather than raised: it
        would hide the reason the run stopped."""
        try:
            self.flush()
        except Exception as err:
            logging.getLogger("normlab").warning("a logged row was written incomplete as the run stopped: %s: %s",
                                                 type(err).__name__, err)


def _split(entries: list[tuple[Record, Any]], record: Record) -> tuple[list[Any], list[tuple[Record, Any]]]:
    """The values `entries` hold for `record` (by identity), and the entries of the other records."""
    return [value for row, value in entries if row is record], [(row, value) for row, value in entries if row is not record]
