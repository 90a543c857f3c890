"""TrainState: everything the training loop carries from one step to the next, checkpointed as a whole.

The loop owns it and changes it; callbacks read it (and set `watched` and `forward`). A checkpoint holds its
`state_dict()` beside each callback's own state: model, optimizer, GradScaler, the data sampler
(the training-batch generator, whose state decides the next batches), the step and the loop's
counters. The learning-rate schedule is a pure function of the step, so the step is its position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from normlab.train.phases import Phases
from normlab.train.rows import Rows

# The loop's counters, saved and restored with the state: so the summary of a resumed run equals an
# uninterrupted one's.
COUNTERS = ("step", "tokens", "best_val", "last_val", "eval_time")


@dataclass
class TrainState:
    """The state of one run between steps.

    `step` counts the optimizer updates done: during step s it is s, and the loop sets it to s + 1 once
    the update is taken. The fields after the counters describe the step in flight and are never saved.
    """

    model: nn.Module  # the bare model (never the DDP or compiled wrapper): checkpoints hold its keys
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    data_gen: torch.Generator  # draws the training batches; seeded by the run's seed alone
    step: int = 0
    tokens: int = 0
    best_val: float = math.inf
    last_val: float = math.nan
    eval_time: float = 0.0  # seconds the evaluations cost beside the steps (summary.json's eval_time_s)
    # The step in flight, set by the loop and read by callbacks:
    lr: float = math.nan
    loss: torch.Tensor | None = None  # the batch's mean training loss, on the device
    grad_norm: torch.Tensor | None = None  # the total gradient norm before clipping, on the device
    watched: bool = False  # a callback watches this step: its record is logged, and it runs the eager model
    # unless `forward` is set: a callback's forward (telemetry's probe) that runs the micro-batches instead
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None
    phases: Phases = field(default_factory=Phases)  # this process's seconds by phase (summary.json's phases)
    # The logged rows on their way to the sinks while the steps run (normlab.train.rows): a callback whose figures
    # reach the host later (telemetry's) completes its record through it. None outside the loop.
    rows: Rows | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "data_sampler": self.data_gen.get_state(),
            **{name: getattr(self, name) for name in COUNTERS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.data_gen.set_state(state["data_sampler"])
        for name in COUNTERS:
            setattr(self, name, state[name])
