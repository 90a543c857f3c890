"""Telemetry per member of a pack: the Probe's statistics, measured on the packed model, one record per member.

`PackedProbe` is telemetry.Probe over a PackedModel. Inside the batched call (PackedModel.losses) each member's
forward runs with the Probe's tap, a Recorder, which computes the Probe's forward statistics from what it is
shown, member by member: torch.func.vmap stacks them, shape (M, ...), and the watcher takes them back
(`absorb`). Every statistic is the Probe's own computation; only the RMS of the sites is one norm per tensor
instead of one fused norm (torch._foreach_norm has no batching rule under vmap). The stream's gradient is
collected by the Probe's BatchedCollect into one zero per member and site, passed into the batched call as the taps.
Parameter statistics (gradient, weight and update norms, gains, running variances) are taken over each member's
slices. `collect()` returns one dict per member with the Probe's keys, combined by the Probe's own arithmetic.
A pack trains eager (pack=true refuses compile=true).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from normlab.nn.packed import PackedModel, member_norms
from normlab.telemetry.probe import Probe
from normlab.telemetry.norms import NormParams
from normlab.telemetry.sites import Plan, Recorder


class PackedProbe(Probe):
    """Probe's statistics for each member of `pack` (see the module's docstring)."""

    def __init__(self, pack: PackedModel, every: int, max_steps: int):
        super().__init__(pack.template, every, max_steps)
        self.pack = pack
        self.members = pack.size
        names = {id(p): name for name, p in pack.template.named_parameters()}
        self._names = [names[id(p)] for p in self._params]  # the Probe's parameters, by name in the pack
        device = next(iter(pack.params.values())).device
        self._collectors = [torch.zeros(pack.size, device=device, requires_grad=True) for _ in self._grad_keys]
        self._watching = False
        self._call: tuple[Plan, Recorder | None, tuple] | None = None  # the batched call in flight

    def _weights(self) -> list[torch.Tensor]:
        return [self.pack.params[name] for name in self._names]

    def _norms_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return member_norms(tensors).T

    def _stacked(self, group: NormParams) -> torch.Tensor:
        tensors = self.pack.buffers if group.kind == "running_var" else self.pack.params
        return torch.stack([tensors[name] for name in group.names])

    def _collected(self) -> torch.Tensor | None:
        collected = super()._collected()
        return None if collected is None else collected.T

    # ------------------------------------------------------------------ the batched call (PackedModel.losses)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """The batched calls made inside are measured."""
        self._watching = True
        try:
            yield
        finally:
            self._watching = False

    def taps(self, members: int, x: torch.Tensor) -> list[torch.Tensor]:
        """When watching, the collectors of the stream's gradients, (M,) each; x: the call's tokens (M, B, T)."""
        if not self._watching:
            return []
        self._call = (self._plan(x.size(1), fused=False), None, ())
        self._stream_elements += x.size(-1) * x.size(-2) * self._width
        return self._collectors

    def begin(self, taps: list[torch.Tensor]) -> Recorder | None:
        """The tap of a member's forward (inside vmap: `taps` are its collectors)."""
        if self._call is None:
            return None
        recorder = Recorder(list(taps), self._call[0])
        self._call = (self._call[0], recorder, ())
        return recorder

    def end(self) -> list[torch.Tensor]:
        """The member's forward statistics: its sums and maxima."""
        if self._call is None:
            return []
        plan, recorder, _ = self._call
        sums, maxima, entries = recorder.finish()
        self._call = (plan, None, entries)
        return [sums, maxima]

    def absorb(self, values: list[torch.Tensor]) -> None:
        """The call's statistics, each (M, n), added to the step's."""
        if self._call is None:
            return
        sums, maxima = values
        self._absorb(sums, maxima, self._call[2])
        self._call = None

    # ------------------------------------------------------------------ outside it

    @torch.no_grad()
    def measure_gradients(self, scaler=None) -> None:
        """Per-member gradient norms of every parameter, before clipping (a pack trains without a GradScaler)."""
        self._grad_norms = self._norms_of([p.grad if p.grad is not None else torch.zeros_like(p) for p in self._weights()])

    def collect(self) -> list[dict[str, float]]:
        """Finish the step: the statistics of each member, as Probe.collect returns them for one model."""
        return self.stage().read()
