"""Preemption: a signal asks the training loop to checkpoint at the next step boundary and stop.

SLURM warns a job before its time limit with the signal given to `--signal` (submitit passes
USR2 by default, see `hydra/launcher=slurm`) and sends SIGTERM before preempting or cancelling it.
normlab treats SIGTERM, SIGUSR1 and SIGUSR2 alike: the handler only records the signal; the loop
looks at it once per step, saves a checkpoint and raises `Preempted`.

Inside a submitit job, submitit has already installed handlers of its own (USR2: call the
launcher's `checkpoint()`, requeue the job and exit; SIGTERM: log and ignore). `watch()` keeps
them, and `chain()` hands the signal on to the handler that was there before normlab's once the
checkpoint is on disk, so submitit's requeue still happens, just after normlab has saved. Where
there was no handler, `chain()` exits with code 128 + the signal number, as a shell reports it.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))

_requested: int | None = None


class Preempted(Exception):
    """Training stopped on signal `signum` after saving the checkpoint of step `step`."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after the checkpoint of step {step}")
        self.signum, self.step = signum, step


def request(signum: int) -> None:
    """Ask the loop to checkpoint and stop (what the signal handler does; tests may call it directly)."""
    global _requested
    if _requested is None:
        _requested = signum


def requested() -> int | None:
    """The first signal received since the last `clear()`, or None."""
    return _requested


def clear() -> None:
    global _requested
    _requested = None


def _handler(signum: int, frame: Any) -> None:
    # Only record: the loop saves at a step boundary, never in the middle of an update.
    request(signum)


@contextlib.contextmanager
def watch() -> Iterator[dict[int, Any]]:
    """Install normlab's handlers for the duration; yield the handlers they replaced, and put those back after.

    Signals the process was told to ignore stay ignored. Outside the main thread (where Python
    cannot install handlers) nothing is installed.
    """
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            handler = signal.getsignal(signum)
            if handler is not signal.SIG_IGN:
                previous[signum] = handler
                signal.signal(signum, _handler)
    clear()
    try:
        yield previous
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        clear()


def chain(signum: int, previous: dict[int, Any]) -> None:
    """After the checkpoint is saved: run the handler that `signum` had before normlab's (submitit's
    requeue), then exit with 128 + signum if that handler returned."""
    handler = previous.get(signum)
    sys.stdout.flush()
    sys.stderr.flush()
    if callable(handler):
        handler(signum, None)
    sys.exit(128 + signum)
