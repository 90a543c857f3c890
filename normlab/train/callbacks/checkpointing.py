"""Checkpointing: saves checkpoints at step boundaries, and stops the run at one once preemption is signalled."""

from __future__ import annotations

import signal
from typing import Any, Sequence

import normlab.train.distributed as distributed
from normlab.train.callbacks.base import Callback
from normlab.train.checkpoint.file import Checkpointer
from normlab.train.preempt import Preempted, requested, training_started
from normlab.train.state import TrainState

# Under DDP, asking every rank whether any was signalled is a collective (a host sync): ask every
# this many steps, at checkpoint steps and at the last step. A preempted DDP run so stops up to this
# many steps after the signal: keep the scheduler's warning time above that many step times.
PREEMPT_CHECK_EVERY = 10


class Checkpointing(Callback):
    """Saves the train state and every callback's state at step boundaries (every ckpt.every steps and
    at the end of a completed run), and stops the run with Preempted, after a checkpoint, once a
    preemption signal has arrived (preempt.py). Under DDP all ranks agree on stopping at the same step.
    Until the first step starts, a signal stops start-up at once (preempt.starting); from then on it
    waits for a step boundary, the one before an evaluation included (one process only): a signal
    received while the model is evaluated stops the run before the next training step."""

    name = "checkpointing"

    def __init__(self, checkpointer: Checkpointer, callbacks: Sequence[Callback], max_steps: int):
        self.checkpointer, self.callbacks, self.max_steps = checkpointer, callbacks, max_steps

    def _save(self, state: TrainState) -> None:
        if state.rows is not None:  # every row before the checkpoint's step on disk first (a telemetry step's waits)
            state.rows.flush()
        with state.phases.time("checkpoint"):
            self.checkpointer.save(state, self.callbacks)

    def on_step_start(self, state: TrainState) -> None:
        training_started()
        if requested() is not None and not distributed.is_active():
            # Signalled during this step's evaluation: its record is not out yet, so the step's boundary
            # is still here, and the run resumes by evaluating again.
            self._save(state)
            raise Preempted(requested(), state.step)

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None:
        # A step boundary: state.step updates are done and every record before it is emitted.
        due = self.checkpointer.due(state.step)
        stop = requested() is not None
        if distributed.is_active():
            # A collective: all ranks ask at the same steps, so all stop at the same step.
            asks = due or state.step % PREEMPT_CHECK_EVERY == 0 or state.step == self.max_steps
            stop = asks and distributed.any_rank(stop)
        if stop or due:
            self._save(state)
        if stop:
            distributed.barrier()  # no rank exits before rank 0's checkpoint is on disk
            raise Preempted(requested() or signal.SIGTERM, state.step)

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        if summary.get("status") == "completed":
            self._save(state)
