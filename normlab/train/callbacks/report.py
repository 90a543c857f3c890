"""RunReport: a line on the `normlab` logger when the run starts and one when it ends."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from normlab.train.callbacks.base import Callback
from normlab.train.state import TrainState

log = logging.getLogger("normlab")  # Hydra's job logging writes it to the terminal and the run dir's normlab.log


class RunReport(Callback):
    """Says what the run does, on the `normlab` logger: at the start one line with the run's name, device,
    precision, parameter count and run dir; at the end one with its status, final and best validation loss
    (nats per token and bits per byte), throughput and the training loop's wall time (first step to last,
    evaluations included; summary.json's wall_time_s adds the data, tokenizer and model set-up)."""

    name = "run_report"

    def __init__(self, desc: str, precision: str, run_dir: str):
        self.desc, self.precision, self.run_dir = desc, precision, run_dir
        self._started = time.monotonic()

    def on_train_start(self, state: TrainState) -> None:
        self._started = time.monotonic()
        first = next(state.model.parameters())
        n_params = sum(p.numel() for p in state.model.parameters())
        resumed = f", resuming at step {state.step}" if state.step else ""
        log.info("%s: %s, %s, %s parameters%s, run dir %s", self.desc, first.device, self.precision,
                 f"{n_params:,}", resumed, self.run_dir)

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        log.info("%s %s: final val loss %.4f (%.4f bits/byte), best %.4f (%.4f bits/byte), %.0f tokens/s, "
                 "training loop %.1f s (set-up not included)", self.desc, summary["status"], summary["final_val_loss"],
                 summary["final_val_bpb"], summary["best_val_loss"], summary["best_val_bpb"],
                 summary.get("tokens_per_s", math.nan), time.monotonic() - self._started)
