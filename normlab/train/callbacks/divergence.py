"""DivergenceGuard: ends the run as diverged at the first step whose loss is non-finite or too high."""

from __future__ import annotations

import math
from typing import Any

import torch

from normlab.train.callbacks.base import Callback, Diverged
from normlab.train.state import TrainState


class DivergenceGuard(Callback):
    """Remembers, on the device, the first step whose training loss is non-finite or above
    `factor` × the initial loss (factor 0: only non-finite counts). The host reads it on logged steps only."""

    name = "divergence_guard"

    def __init__(self, factor: float, device: torch.device):
        self.factor = factor
        self.limit: torch.Tensor | None = None
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)

    def observe(self, step: int, loss: torch.Tensor) -> None:
        if self.limit is None:
            self.limit = loss * self.factor if self.factor > 0 else torch.full_like(loss, math.inf)
        bad = ~torch.isfinite(loss) | (loss > self.limit)
        self.first_bad = torch.where(bad & (self.first_bad < 0), step, self.first_bad)

    def diverged_at(self) -> int | None:
        step = int(self.first_bad.item())
        return None if step < 0 else step

    def after_backward(self, state: TrainState) -> None:
        self.observe(state.step, state.loss)

    def after_optimizer_step(self, state: TrainState, record: dict[str, Any] | None) -> None:
        if record is not None and (step := self.diverged_at()) is not None:
            raise Diverged(step)

    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "limit": self.limit, "first_bad": self.first_bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.first_bad.device
        self.limit = None if state["limit"] is None else state["limit"].to(device)
        self.first_bad = state["first_bad"].to(device)
