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

Before the first training step there is nothing to checkpoint, so nothing to wait for: while
`starting()` is in force, the handler raises `Preempted` at once, wherever start-up is (loading data,
reading a checkpoint that blocks, opening sinks, the first evaluation), except inside `deferred()`,
which train() wraps around its changes to the run dir so that none is left halfway.

SIGINT (Ctrl-C) is watched too: it stops the run the same way, at a step boundary after a checkpoint,
but as `interrupted` (exit code 130), and is never handed on to another handler.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT") if hasattr(signal, name))

_requested: int | None = None
_immediate = False  # start-up: a signal stops the run at once (see starting())


class Preempted(BaseException):
    """Training stopped on signal `signum`: after saving the checkpoint of step `step`, or, with `step`
    None, before the first step (nothing to save). A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` on the way (a checkpoint reader's, a data loader's) mistakes it for their own error."""

    def __init__(self, signum: int, step: int | None):
        super().__init__(signum, step)
        self.signum, self.step = signum, step

    @property
    def status(self) -> str:
        """The run's status in summary.json: `interrupted` for Ctrl-C (SIGINT), else `preempted`."""
        return "interrupted" if self.signum == signal.SIGINT else "preempted"

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.step is None:
            return f"stopped by {name} before the first step"
        return f"stopped by {name} after the checkpoint of step {self.step}"


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
    # During training only record: the loop saves at a step boundary, never in the middle of an update.
    request(signum)
    if _immediate:
        raise Preempted(signum, None)


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Start-up, until `training_started()`: a watched signal raises Preempted at once (one already
    received raises on entry)."""
    global _immediate
    _immediate = True
    try:
        if _requested is not None:
            raise Preempted(_requested, None)
        yield
    finally:
        _immediate = False


def training_started() -> None:
    """The first step begins: from now on a signal is only recorded, and the loop stops at a step boundary."""
    global _immediate
    _immediate = False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within start-up, a section no signal may cut short; a signal received meanwhile raises Preempted at its end."""
    global _immediate
    before, _immediate = _immediate, False
    try:
        yield
    finally:
        _immediate = before
    if before and _requested is not None:
        raise Preempted(_requested, None)


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
    requeue), then exit with 128 + signum if that handler returned. SIGINT is never handed on: its
    previous handler would only raise KeyboardInterrupt, a traceback for a stop that went as asked."""
    handler = previous.get(signum)
    sys.stdout.flush()
    sys.stderr.flush()
    if callable(handler) and signum != signal.SIGINT:
        handler(signum, None)
    sys.exit(128 + signum)
