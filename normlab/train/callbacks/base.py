"""The callback: a part of the training loop with named hooks (Callback), and Diverged, which ends a run.

The loop calls the hooks in the order of a step (see normlab.train):

    on_train_start(state)                 before the first step (after a resume's restore)
    on_step_start(state)                  the step begins: `state.step` is its number
    after_backward(state)                 gradients accumulated and un-scaled, before clipping
    before_optimizer_step(state)          gradients clipped, weights not yet changed
    after_optimizer_step(state, record)   update taken (`state.step` is now s + 1): measure, add to the
                                          record (None on a step that is not logged); raise Diverged to stop
    on_step_end(state, record)            the record (None if not logged); a telemetry step's statistics join it
                                          when its row is written, in a later step (state.rows.written)
    on_train_end(state, summary)          the run completed or diverged: add to the summary, write products
    on_train_stop(state)                  the steps stopped short (a signal, an error): release what it holds

Every hook does nothing unless a callback overrides it. A callback's `state_dict()` goes into every
checkpoint under its `name`, so a resumed run's callbacks continue as they were. A new monitor is
one class (a module of normlab.train.callbacks, or anywhere), passed to train(); the loop does not change.
"""

from __future__ import annotations

from typing import Any

from normlab.train.state import TrainState


class Diverged(Exception):
    """Raised by a callback (or the loop) to end the run as diverged at `step`."""

    def __init__(self, step: int):
        super().__init__(f"diverged at step {step}")
        self.step = step


class Callback:
    """A part of the loop with named hooks, all no-ops here, and its own checkpointed state."""

    name = "callback"  # the key of its state in a checkpoint; unique within a run

    def on_train_start(self, state: TrainState) -> None: ...

    def on_step_start(self, state: TrainState) -> None: ...

    def after_backward(self, state: TrainState) -> None: ...

    def before_optimizer_step(self, state: TrainState) -> None: ...

    def after_optimizer_step(self, state: TrainState, record: dict[str, Any] | None) -> None: ...

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None: ...

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None: ...

    def on_train_stop(self, state: TrainState) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
