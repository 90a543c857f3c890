"""RunDirWatch: stops a run whose run dir was deleted, moved or replaced while it trained."""

from __future__ import annotations

from typing import Any

from normlab.train.callbacks.base import Callback
from normlab.train.sinks.rundir import RunDir
from normlab.train.state import TrainState


class RunDirWatch(Callback):
    """Raises RunDirGone (one line naming the dir) at the first step boundary, or the end of the run, at which
    the run dir is no longer the dir the run started in: the records and checkpoints written after it went
    would land in a deleted file or a dir made again, and the run would still say it completed. One stat per
    step. First among the callbacks, so the check comes before any of them writes (checkpoints, the end's
    telemetry tables)."""

    name = "run_dir_watch"

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    def on_train_start(self, state: TrainState) -> None:
        self.run_dir.check_in_place(state.step)

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None:
        self.run_dir.check_in_place(state.step)

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        self.run_dir.check_in_place(state.step)
