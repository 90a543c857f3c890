"""The run's log: the `normlab` logger's lines (RunReport's first and last, ProgressLog's) go to the run dir's
normlab.log and to the terminal, whether `normlab train` started the run or Python did (`train_run`).

Under `normlab train`, Hydra's job logging already writes both (its console handler and
`<run dir>/normlab.log`), so `run_log` adds nothing there; from Python, where nothing handles the
logger's INFO lines, it adds the file and, unless told not to echo, a console handler in Hydra's format.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Iterator

LOG_NAME = "normlab.log"  # Hydra's `${hydra.job.name}.log`, the job name conf/config.yaml sets
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default job logging's


@contextlib.contextmanager
def run_log(run_dir: Path, echo: bool = True) -> Iterator[None]:
    """For the duration, the `normlab` logger's INFO lines reach `run_dir`/normlab.log (appended to, created
    at the first line, so a refused run leaves no file) and, with `echo`, the terminal (stdout, as Hydra's).

    Where the logging already set up shows them (Hydra's, or the caller's own at INFO) they go on there,
    and only a missing normlab.log is added; else (or without `echo`) the run's handlers take the lines
    alone, so `echo=False` keeps them off the terminal."""
    logger = logging.getLogger("normlab")
    path = (Path(run_dir) / LOG_NAME).resolve()
    shown = echo and logger.isEnabledFor(logging.INFO) and logger.hasHandlers()
    handlers: list[logging.Handler] = []
    if not _writes_to(logger, path, ancestors=shown):  # cut off from its ancestors, the logger needs its own
        handlers.append(logging.FileHandler(path, delay=True))
    if echo and not shown:
        handlers.append(logging.StreamHandler(sys.stdout))
    level, propagate = logger.level, logger.propagate
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    if not shown:
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        yield
    finally:
        logger.setLevel(level)
        logger.propagate = propagate
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()


def _writes_to(logger: logging.Logger, path: Path, ancestors: bool) -> bool:
    """Whether a file handler of `logger`, or with `ancestors` of a logger it propagates to, writes `path`
    (Hydra's job log is a handler of the root logger)."""
    node: logging.Logger | None = logger
    while node is not None:
        if any(Path(h.baseFilename).resolve() == path for h in node.handlers if isinstance(h, logging.FileHandler)):
            return True
        node = node.parent if ancestors and node.propagate else None
    return False
