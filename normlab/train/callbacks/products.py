"""TelemetryProducts: the per-layer table and layer × step heatmaps a completed run hands its sinks."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from normlab import keys
from normlab.train.callbacks.base import Callback
from normlab.train.sinks.base import Sink
from normlab.train.state import TrainState


class TelemetryProducts(Callback):
    """Keeps the per-layer part of every record and, when the run completes, hands the sinks the
    per-layer table ('telemetry/layers') and layer × step heatmaps ('telemetry/resid_rms',
    'telemetry/grad_norm'), made from those records as compare makes its plots."""

    name = "telemetry_products"
    HEATMAPS = {keys.RESID_RMS: "telemetry/resid_rms", keys.GRAD_NORM: "telemetry/grad_norm"}

    def __init__(self, sinks: Sequence[Sink], later: Callable[[Callable[[], None]], None] | None = None):
        """`later`: given, the products are made by the task it is handed (a sweep's job hands it to the run's
        end, normlab.train.ending), not at once in on_train_end."""
        self.sinks = sinks
        self.later = later
        self.records: list[dict[str, Any]] = []

    def on_step_end(self, state: TrainState | None, record: dict[str, Any] | None) -> None:
        if record is None:
            return
        if state is not None and state.rows is not None:
            state.rows.written(record, self._keep)  # a telemetry step's statistics join its record when it is written
        else:
            self._keep(record)

    def _keep(self, record: dict[str, Any]) -> None:
        per_layer = {k: v for k, v in record.items() if keys.parse(k) is not None}
        if per_layer:
            self.records.append({"step": record["step"], **per_layer})

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        if summary.get("status") != "completed" or not self.records or not self.sinks:
            return
        if self.later is None:
            self.write()
        else:
            self.later(self.write)

    def write(self) -> None:
        """Make the table and the heatmaps of the records kept so far and hand them to every sink."""
        # Here, not at the top: it imports matplotlib, slow and needed only at the end of a completed run.
        from normlab.analysis.render.heatmap import layer_heatmap

        columns, rows = keys.layer_table(self.records)
        titles = {stat: title for stat, _, title in keys.LAYER_PROFILES}
        images = {name: layer_heatmap(self.records, stat, titles[stat]) for stat, name in self.HEATMAPS.items()}
        for sink in self.sinks:
            sink.log_table("telemetry/layers", columns, rows)
            for name, png in images.items():
                sink.log_image(name, png)

    def state_dict(self) -> dict[str, Any]:
        return {"records": [dict(record) for record in self.records]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = [dict(record) for record in state["records"]]
