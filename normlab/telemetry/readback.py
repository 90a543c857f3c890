"""A telemetry step's statistics on their way to the host: one flat vector, copied without blocking the host.

On CUDA the vector is copied into pinned host memory with non_blocking=True and a CUDA event is recorded after the
copy: the host goes on with the next step at once, and `values()` waits for that event alone (by then the copy has
landed, long before the device finishes the work queued after it). Elsewhere (the CPU, MPS) the copy is an ordinary
one, done when the Readback is made. Either way the statistics are read where the caller reads them, so a run
defers its reading in the same way on every device.
"""

from __future__ import annotations

import torch


class Readback:
    """The host's copy of `values` (a vector no later step writes into: the Probe's freshly concatenated
    statistics), and when it has landed."""

    def __init__(self, values: torch.Tensor):
        self._landed: torch.cuda.Event | None = None
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._landed = torch.cuda.Event()
            self._landed.record()
        else:
            self._host = values.to("cpu")

    def ready(self) -> bool:
        """Whether the copy has landed: reading now would not wait."""
        return self._landed is None or self._landed.query()

    def values(self) -> list[float]:
        """The vector as Python floats, once its copy has landed (waiting for the copy alone)."""
        if self._landed is not None:
            self._landed.synchronize()
        return self._host.tolist()
