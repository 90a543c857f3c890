"""What became of a sweep's job when its run dir cannot say: the dir went mid-run, or another process holds it.

A job whose dir was deleted or moved away has no summary.json to read (and must not get one: nothing is
written at its path again), and a job refused because another process holds its dir would read that
process's. The task notes the job's status in the job's own process (`note`, from the error that stopped
it: `status_of`); the sweep's callback takes it there for the job's line (`noted`), which sweep.log keeps.
The sweep's table reads each job dir; a job whose dir is gone it finds by its line in sweep.log, and a dir
another process holds without a finished record shows as busy (`busy`).

Imports stay light (no torch): the sweep's callback imports this module before any job runs.
"""

from __future__ import annotations

import os
from pathlib import Path

from normlab.train.sinks.rundir import RunDirBusy, RunDirGone
from normlab.util.files import lock_holder

# Job dir (absolute) -> its status for the job's line, in the process that ran the job.
_NOTED: dict[str, str] = {}


def status_of(err: BaseException) -> str | None:
    """The job-line status of a job stopped by `err` when its run dir cannot tell it: "failed: run dir deleted or
    moved away at step 4" (RunDirGone), "busy: held by PID 1234" (RunDirBusy); None for any other error."""
    if isinstance(err, RunDirGone):
        return f"failed: run dir {err.what or 'gone'}" + (f" at step {err.step}" if err.step is not None else "")
    if isinstance(err, RunDirBusy):
        return f"busy: held by PID {err.holder}" if err.holder else "busy: held by another process"
    return None


def note(run_dir: str | os.PathLike, status: str) -> None:
    """Record `status` as the line's status of the job in `run_dir` (in this process, until `noted` takes it)."""
    _NOTED[os.path.abspath(run_dir)] = status


def noted(run_dir: str | os.PathLike) -> str | None:
    """The status `note` recorded for the job in `run_dir`, taken (so a later job in the same dir starts afresh)."""
    return _NOTED.pop(os.path.abspath(run_dir), None)


def busy(run_dir: str | os.PathLike) -> str | None:
    """"busy: held by PID N" when another process than this one holds `run_dir`'s lock, else None."""
    holder = lock_holder(Path(run_dir))
    return f"busy: held by PID {holder}" if holder and holder != os.getpid() else None
