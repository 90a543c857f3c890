"""BatchNormSteps: BatchNorm's running statistics move once per optimizer step, whatever the grad_accum."""

from __future__ import annotations

import logging
from typing import Any

import torch

import normlab.train.distributed as distributed
from normlab.config import ConfigError, RunConfig
from normlab.nn.norms import StepStatistics
from normlab.train.callbacks.base import Callback
from normlab.train.state import TrainState


class BatchNormSteps(Callback):
    """Makes the optimizer step the unit of BatchNorm's running statistics: every training forward of the
    step adds its statistic groups' statistics, and before the optimizer step the running statistics move
    once, by `momentum`, toward their mean (norms.StepStatistics). So with a fixed norm.stat_rows a run
    is the same model at any grad_accum. Warns once when grad_accum changes what BatchNorm sees
    (stat_rows null: a statistic spans the micro-batch); records the rows per statistic in the summary."""

    name = "batchnorm_steps"

    def __init__(self, model: torch.nn.Module, cfg: RunConfig):
        self.norms = [m for m in model.modules() if isinstance(m, StepStatistics)]
        self.cfg = cfg

    def on_train_start(self, state: TrainState) -> None:
        if not self.norms:
            return
        stat_rows, grad_accum = self.cfg.norm.stat_rows, self.cfg.grad_accum
        if stat_rows is not None and distributed.is_active():
            raise ConfigError(
                f"norm.stat_rows={stat_rows} under torchrun: statistic groups are single-process only; "
                "use norm.stat_rows=null (statistics over the micro-batch, see norm.sync)"
            )
        if stat_rows is None and grad_accum > 1 and distributed.is_main():
            logging.getLogger("normlab").warning(
                "norm=%s with grad_accum=%d and norm.stat_rows=null: BatchNorm takes its statistics over each "
                "micro-batch of %d sequences, so grad_accum changes the model; set norm.stat_rows to fix them",
                self.cfg.norm.label, grad_accum, self.cfg.micro_batch_size,
            )
        for norm in self.norms:
            norm.per_step = True

    def before_optimizer_step(self, state: TrainState) -> None:
        for norm in self.norms:
            norm.advance_running_statistics()

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        if self.norms:
            summary["norm_stat_rows"] = self.cfg.norm.stat_rows or self.cfg.micro_batch_size
