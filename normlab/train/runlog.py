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
from typing import Callable, Iterator

LOG_NAME = "normlab.log"  # Hydra's `${hydra.job.name}.log`, the job name conf/config.yaml sets
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default job logging's


@contextlib.contextmanager
def run_log(run_dir: Path, echo: bool = True) -> Iterator[None]:
    """For the duration, the `normlab` logger's INFO lines reach `run_dir`/normlab.log (appended to, created
    at the first line, so a refused run leaves no file) and, with `echo`, the terminal (stdout, as Hydra's).

    Only what is missing is added: no file handler where one writes normlab.log already (Hydra's), no
    console handler where one writes to the terminal already. The lines still go on to the loggers above
    (pytest's caplog, your own logging), so `echo=False` adds nothing to the terminal itself."""
    logger = logging.getLogger("normlab")
    path = (Path(run_dir) / LOG_NAME).resolve()
    handlers: list[logging.Handler] = []
    if not _writes_to(logger, lambda h: isinstance(h, logging.FileHandler) and Path(h.baseFilename).resolve() == path):
        handlers.append(logging.FileHandler(path, delay=True))
    if echo and not _writes_to(logger, lambda h: type(h) is logging.StreamHandler and h.stream in (sys.stdout, sys.stderr)):
        handlers.append(logging.StreamHandler(sys.stdout))
    level = logger.level
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.setLevel(level)
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()


def _writes_to(logger: logging.Logger, writes: Callable[[logging.Handler], bool]) -> bool:
    """Whether a handler of `logger`, or of a logger its records propagate to, `writes` (Hydra's job logging
    puts its console and file handlers on the root logger)."""
    node: logging.Logger | None = logger
    while node is not None:
        if any(writes(h) for h in node.handlers):
            return True
        node = node.parent if node.propagate else None
    return False
