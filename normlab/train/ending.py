"""A run's end: its records closed (record_end), at once or, for a sweep's job, off the critical path (hand_over).

At the end of a run, summary.json says how it ended, the sinks are finished, and summary.json is written again
with their time. A completed sweep job hands the rest of its end over once its summary.json says how it ended:
the end-of-run products (rendered, then handed to the sinks), the sinks' finish and the last summary.json run
in this process's end thread, so the next job starts at once.

One end thread, so the ends run one at a time in the order the runs handed them over; it is not a daemon, so
the process waits for it before it exits (Python joins such threads first of all). Whoever reads what a run's
end writes (a sweep's closing table) calls `drain()` first. A handed-over end holds the run dir's lock until it
is done.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from typing import Any, Callable, Sequence

from normlab.train.phases import Phases, RunClock
from normlab.train.sinks import RunDir, Sink, finish_all

_lock = threading.Lock()
_pending: collections.deque[Callable[[], None]] = collections.deque()
_thread: threading.Thread | None = None


class RunEnd:
    """The products of one run still to make, in order: tasks that each render something and hand it to the sinks."""

    def __init__(self) -> None:
        self.tasks: list[Callable[[], None]] = []

    def add(self, task: Callable[[], None]) -> None:
        self.tasks.append(task)


def record_end(run_dir: RunDir | None, summary: dict[str, Any], sinks: list[Sink], exit_code: int,
               phases: Phases | None = None, clock: RunClock | None = None,
               products: Sequence[Callable[[], None]] = ()) -> BaseException | None:
    """Make the `products` (each timed as `products`; one that fails makes the run failed), write summary.json
    (into `run_dir`, when given) and finish every sink, whatever fails on the way; return the first failure, or
    None. With `phases`, summary.json is written again once the sinks are finished, with their time and the whole
    wall time the run's `clock` counts."""
    return _close(run_dir, summary, sinks, exit_code, phases, clock, products)


def _close(run_dir: RunDir | None, summary: dict[str, Any], sinks: list[Sink], exit_code: int, phases: Phases | None,
           clock: RunClock | None, products: Sequence[Callable[[], None]] = ()) -> BaseException | None:
    failure: BaseException | None = None
    writes = run_dir is not None and run_dir.gone() is None  # never into a dir made again at a vanished one's path
    timed = (lambda name: phases.time(name)) if phases is not None else (lambda name: contextlib.nullcontext())

    def write() -> None:
        nonlocal failure, writes
        if clock is not None:
            clock.record(summary)
        if phases is not None:
            summary["phases"] = phases.record()
        if writes:
            try:
                with timed("setup"):
                    run_dir.write_summary(summary)
            except Exception as err:
                writes, failure = False, failure or err

    for task in products:  # before the sinks that show them finish
        try:
            with timed("products"):
                task()
        except Exception as err:
            summary.update(status="failed", error=f"{type(err).__name__}: {err}")
            exit_code, failure = 1, failure or err
    write()
    with timed("sinks"):
        finished = finish_all(sinks, summary, exit_code)
    if phases is not None:
        write()
    return failure or finished


def hand_over(run_dir: RunDir, summary: dict[str, Any], sinks: list[Sink], phases: Phases, clock: RunClock,
              end: RunEnd) -> BaseException | None:
    """A completed run's end, off the critical path: summary.json now, with how the run ended; then, in the end
    thread, under the run dir's lock, the products, the sinks' finish and summary.json again (its wall_time_s:
    the run's time until now plus the end's own). Where summary.json cannot be written now, the whole end runs
    at once, as record_end runs it, and its failure is returned. A failure of the end in the thread is recorded
    in summary.json (status failed, `error`) and said on stderr."""
    clock.record(summary)
    summary["phases"] = phases.record()
    try:
        if run_dir.gone() is not None:
            raise FileNotFoundError(run_dir.path)
        with phases.time("setup"):
            run_dir.write_summary(summary)
        release = run_dir.hold()
    except Exception:
        return record_end(run_dir, summary, sinks, 0, phases, clock, end.tasks)
    final = dict(summary)  # the caller's summary stays as it was handed over

    def finish() -> None:
        try:
            trouble = _close(run_dir, final, sinks, 0, phases, clock, end.tasks)
            if trouble is not None and final.get("status") != "failed":
                final.update(status="failed", error=f"the run's end: {type(trouble).__name__}: {trouble}")
                if run_dir.gone() is None:
                    run_dir.write_summary(final)
        finally:
            release()
        if trouble is not None:  # on stderr, not in a log file: the next job's normlab.log may be the one open
            print(f"normlab: {final.get('name')}: the run's end failed: {type(trouble).__name__}: {trouble}",
                  file=sys.stderr)

    defer(finish)
    return None


def defer(task: Callable[[], None]) -> None:
    """Run `task` in this process's end thread, after the tasks handed over before it. `task` records its own
    failures: whatever escapes it is said on stderr and dropped, since no caller waits for it."""
    global _thread
    with _lock:
        _pending.append(task)
        if _thread is None:
            _thread = threading.Thread(target=_work, name="normlab-run-ends", daemon=False)
            _thread.start()


def _work() -> None:
    global _thread
    while True:
        with _lock:
            if not _pending:
                _thread = None  # a later defer() starts a new thread
                return
            task = _pending.popleft()
        try:
            task()
        except BaseException as err:  # noqa: BLE001 - the thread goes on to the next run's end
            print(f"normlab: a run's end failed: {type(err).__name__}: {err}", file=sys.stderr)


def drain() -> None:
    """Wait until every run's end handed over so far has run (at once from the end thread itself)."""
    while True:
        with _lock:
            thread = _thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join()
