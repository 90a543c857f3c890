"""SIGTERM that unwinds a block of the launching process before it ends the process: for what that process must
clean up itself (the sweep's own MPS daemon, normlab.launch.mps).

SIGTERM's default action ends a process at once, running no `finally`. Within `unwinding()`, SIGTERM raises
Terminated in the main thread instead (it interrupts a wait for futures or a join, as Ctrl-C's KeyboardInterrupt
does), so the block's clean-up runs; then SIGTERM's previous handler is put back and the process sends itself
SIGTERM, so that it ends as SIGTERM ends it (exit status -15; 143 in a shell). A later SIGTERM raises Terminated
again, cutting short a wait of the clean-up (for the workers), but within `deferred()` (a clean-up that must not be
cut short: a daemon's stop, itself bounded in time) it is acted on only at the section's end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Callable, Iterator


class Terminated(BaseException):
    """SIGTERM arrived within `unwinding()`. A BaseException, as KeyboardInterrupt is, so that no `except Exception`
    on the way takes it for an error of its own."""

    def __str__(self) -> str:
        return "SIGTERM"


_received = False  # a SIGTERM came while the handler was installed
_deferring = False  # within deferred(): a SIGTERM is acted on at its end
_pending = False  # a SIGTERM came within deferred()


def _handler(signum: int, frame: Any) -> None:
    global _received, _pending
    _received = True
    if _deferring:
        _pending = True
        return
    raise Terminated()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A section that an unwinding SIGTERM does not cut short: one received meanwhile raises Terminated at its end
    (with no handler installed, a SIGTERM ends the process as it would anyway)."""
    global _deferring, _pending
    before, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = before
    if not before and _pending:
        _pending = False
        raise Terminated()


@contextlib.contextmanager
def unwinding() -> Iterator[Callable[[], None]]:
    """SIGTERM unwinds the block, then ends the process by SIGTERM (see the module's docstring). Installed only in
    the main thread (the only one Python runs handlers in), and not where SIGTERM is ignored or its handler was not
    set from Python. Yields `release`, which puts the previous handler back at once: the block has nothing left to
    clean up, and SIGTERM acts as it did before."""
    global _received, _deferring, _pending
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield lambda: None
        return
    installed = [True]

    def release() -> None:
        if installed[0]:
            signal.signal(signal.SIGTERM, previous)
            installed[0] = False

    _received = _deferring = _pending = False
    signal.signal(signal.SIGTERM, _handler)
    try:
        yield release
    except Terminated:
        pass  # the process ends below, as SIGTERM ends it
    finally:
        release()
        if _received:  # also where the block swallowed Terminated or ends by another exception
            _received = False
            os.kill(os.getpid(), signal.SIGTERM)  # the previous handler's turn: by default the process ends here
            raise SystemExit(128 + signal.SIGTERM)  # a handler of the caller's returned: end as a shell reports it
