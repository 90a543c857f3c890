"""`normlab.train_run`: train() as `normlab train` runs it, for a notebook or a script.

The command line checks a run's config before anything is made, and leaves a run that already ended where it
ended; train() itself is the training, which callers inside normlab reach only past those checks. train_run
holds a call from Python to the same promises.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Sequence

from normlab.config import RunConfig
from normlab.train.callbacks import Callback
from normlab.train.checkpoint import ended_message, ended_run
from normlab.train.run import train
from normlab.train.sinks import RunDir, Sink
from normlab.train.sinks.rundir import check_output_dir


def train_run(
    cfg: RunConfig, run_dir: str | RunDir, sinks: list[Sink] | None = None, callbacks: Sequence[Callback] = (),
    echo: bool = True,
) -> dict[str, Any]:
    """Train one model as `cfg` says into `run_dir` and return its summary (train(), whose arguments these are),
    as `normlab train` would: `cfg` is validated first (ConfigError, one line, and nothing is made); a run that
    already ended in `run_dir` with this config (completed or diverged, under resume=auto) is not trained again:
    its recorded summary is returned, one line on stderr says so (not with echo=False), and the dir stays byte
    for byte as it was (overwrite=true trains it afresh). A `cfg` that is not a RunConfig, or a `run_dir` that is
    not a path, is a TypeError; a `run_dir` where no dir can be made (a file's path, or a path under a file),
    a ConfigError that names it."""
    _check_types(cfg, run_dir)
    cfg.validate()
    path = run_dir.path if isinstance(run_dir, RunDir) else Path(run_dir)
    if not path.is_dir():
        check_output_dir(os.fspath(path), "run_dir")  # as `normlab train` checks hydra.run.dir: nothing is made
        return train(cfg, run_dir, sinks, callbacks, echo)
    with RunDir(path).lock():  # held through train(), which takes it again: no run starts there in between
        ended = ended_run(cfg, path)
        if ended is None:
            return train(cfg, run_dir, sinks, callbacks, echo)
    if echo:
        print(ended_message(cfg, path, ended), file=sys.stderr)
    return ended


def _check_types(cfg: Any, run_dir: Any) -> None:
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"cfg is {_kind(cfg)}, not a RunConfig: RunConfig.from_dict({{...}}) makes one of a mapping, "
                        "RunConfig(...) of keywords (RunConfig() is normlab train's defaults)")
    if not isinstance(run_dir, (str, os.PathLike, RunDir)):
        raise TypeError(f"run_dir is {_kind(run_dir)}, not a path: give the run dir as a str or an os.PathLike")


def _kind(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"
