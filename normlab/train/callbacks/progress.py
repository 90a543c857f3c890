"""The run's progress: a tqdm bar on a terminal (ProgressBar), else a line per tenth of the run (ProgressLog)."""

from __future__ import annotations

import logging
import sys
from typing import Any

from tqdm.auto import tqdm

from normlab.train.callbacks.base import Callback
from normlab.train.state import TrainState

log = logging.getLogger("normlab")  # Hydra's job logging writes it to the terminal and the run dir's normlab.log


class ProgressBar(Callback):
    """A tqdm bar over the steps, with the last logged loss, lr and throughput."""

    name = "progress"

    def __init__(self, total: int, desc: str):
        self.total, self.desc = total, desc
        self.bar = None

    def on_train_start(self, state: TrainState) -> None:
        self.bar = tqdm(total=self.total, initial=state.step, desc=self.desc, unit="step", dynamic_ncols=True)

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None:
        if record is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        self.bar.update(1)

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        self.bar.close()

    def on_train_stop(self, state: TrainState) -> None:
        if self.bar is not None:
            self.bar.close()  # else tqdm redraws it when it is collected, after the line that says why the run stopped


class ProgressLog(Callback):
    """The progress bar's stand-in when output is not a terminal (a batch job's log): a line at the first
    logged step past each tenth of the run, with the step, loss, val loss when evaluated, lr and throughput."""

    name = "progress"

    def __init__(self, total: int, desc: str, lines: int = 10):
        self.total, self.desc = total, desc
        self.every = max(1, total // lines)
        self._next = 0

    def on_train_start(self, state: TrainState) -> None:
        self._next = state.step

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None:
        if record is None or record["step"] < self._next:
            return
        val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        log.info("%s: step %d/%d loss %.4f%s lr %.2e %.0f tokens/s", self.desc, record["step"], self.total,
                 record["loss"], val, record["lr"], record["tokens_per_s"])
        self._next = (record["step"] // self.every + 1) * self.every


def progress(total: int, desc: str) -> Callback:
    """A tqdm bar when stderr is a terminal, else periodic log lines (ProgressLog)."""
    return ProgressBar(total, desc) if sys.stderr.isatty() else ProgressLog(total, desc)
