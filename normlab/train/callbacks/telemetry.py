"""Telemetry: runs the Probe (per-layer statistics) on its steps."""

from __future__ import annotations

import logging
from typing import Any

from normlab.train.callbacks.base import Callback
from normlab.telemetry.probe import Pending, Probe
from normlab.telemetry.norms import EpsWarnings
from normlab.train.state import TrainState


class Telemetry(Callback):
    """Runs the Probe on its steps: the step's micro-batches through the Probe's forward (the model with a
    tap; compiled under compile=true), gradient and weight statistics, and the step's statistics sent to the host
    without blocking it (one copy). They join the step's record when its row is written (state.rows, during the
    next step: normlab.train.rows). Telemetry steps are watched, so always logged. A norm slot found
    eps-dominated is named in one warning line of the run's log, once per run."""

    name = "telemetry"

    def __init__(self, probe: Probe):
        self.probe = probe
        self._active = False
        self._eps_warnings = EpsWarnings()

    def on_step_start(self, state: TrainState) -> None:
        self._active = self.probe.active(state.step)
        if self._active:
            state.watched = True
            state.forward = self.probe.forward

    def after_backward(self, state: TrainState) -> None:
        if self._active:
            self.probe.measure_gradients(state.scaler)  # the accumulated, un-scaled gradient, before clipping

    def before_optimizer_step(self, state: TrainState) -> None:
        if self._active:
            self.probe.before_update()

    def after_optimizer_step(self, state: TrainState, record: dict[str, Any] | None) -> None:
        if not self._active:
            return
        pending, step = self.probe.stage(), state.step - 1  # on its way to the host; the Probe is free again
        if record is None:  # a telemetry step is always logged: only a caller outside the loop gets here
            return

        def read() -> dict[str, float]:
            return self._read(pending, step)

        if state.rows is not None:
            state.rows.later(record, read, pending.ready)
        else:
            record.update(read())

    def _read(self, pending: Pending, step: int) -> dict[str, float]:
        """The statistics of telemetry step `step`, and the warning about its eps-dominated norms."""
        stats = pending.read()[0]
        warning = self._eps_warnings.line(stats, step)
        if warning:
            logging.getLogger("normlab").warning(warning)
        return stats
