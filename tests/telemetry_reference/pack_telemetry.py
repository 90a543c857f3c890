# FROZEN REFERENCE: a verbatim copy of normlab/train/pack/telemetry.py at commit 9034483a19e1d273422b5896e68008abef312981,
# its imports of the other probe modules pointed at this package. tests/test_telemetry_golden.py compares
# the live Probe's statistics against it. Do not edit it (not even to follow a rename or a fix): it is what
# the statistics meant before issue 36 changed the Probe. A key whose definition changes on purpose keeps
# its old definition here; the golden test compares the live key against the new one, computed in the test.
"""Telemetry per member of a pack: the Probe's statistics, measured on the packed model, one record per member.

`PackedProbe` is telemetry.Probe over a PackedModel. Its hooks are the Probe's own, attached to the
pack's template modules; inside the batched call each hooked tensor is one member's, so every statistic
the Probe reduces on the device comes out per member: the watcher hands them out of the batched call
(`end`) and takes them back stacked, shape (M,) (`absorb`). Gradients of the residual stream cannot be
hooked on a batched tensor, so the stream passes through a zero "tap" (x + 0, exact) that is an input of
the batched call; the tap's gradient is the stream's gradient, member by member. Parameter statistics
(gradient, weight and update norms, gains, running variances) are taken over each member's slices.
`collect()` returns one dict per member with the Probe's keys, combined by the Probe's own arithmetic.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from normlab.keys import layer_key
from normlab.nn.packed import PackedModel, member_norms
from telemetry_reference.probe import Probe
from telemetry_reference.probe_norms import norm_parameter_stats


class PackedProbe(Probe):
    """Probe's statistics for each member of `pack` (see the module's docstring)."""

    def __init__(self, pack: PackedModel, every: int, max_steps: int):
        super().__init__(pack.template, every, max_steps)
        self.pack = pack
        names = {id(p): name for name, p in pack.template.named_parameters()}
        self._names = [names[id(p)] for p in self._params]  # the Probe's parameters, by name in the pack
        self._taps: list[list[torch.Tensor]] = []
        self._tap_iter = iter(())
        self._watching = False
        self._marks: tuple[dict[str, int], dict[str, int], set[str], dict[str, int]] = ({}, {}, set(), {})

    def _stacked(self) -> list[torch.Tensor]:
        return [self.pack.params[name] for name in self._names]

    def _reset(self) -> None:
        super()._reset()
        self._taps = []

    # ------------------------------------------------------------------ inside the batched call

    def taps(self, members: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Zero taps for the stream entering block 0 and after each block, (M, B, T, d), when watching."""
        if not self._watching:
            return []
        shape = (*x.shape, self.model.tok_emb.embedding_dim)  # x: (M, B, T) token ids
        dtype = self.model.tok_emb.weight.dtype
        taps = [torch.zeros(shape, dtype=dtype, device=x.device, requires_grad=True) for _ in range(len(self.labels) + 1)]
        self._taps.append(taps)
        return taps

    def begin(self, taps: list[torch.Tensor]) -> None:
        self._tap_iter = iter(taps)
        self._marks = ({k: len(v) for k, v in self._calls.items()}, {k: len(v) for k, v in self._maxima.items()},
                       set(self._scalars), {k: len(v) for k, v in self._sums.items()})

    def _new_entries(self):
        """(where, key, index) of each statistic recorded since `begin`, in a fixed order."""
        calls, maxima, scalars, sums = self._marks
        for key, entries in self._calls.items():
            for i in range(calls.get(key, 0), len(entries)):
                yield "calls", key, i
        for key, entries in self._maxima.items():
            for i in range(maxima.get(key, 0), len(entries)):
                yield "max", key, i
        for key in self._scalars:
            if key not in scalars:
                yield "scalar", key, None
        for key, entries in self._sums.items():
            for i in range(sums.get(key, 0), len(entries)):
                yield "sums", key, i

    def end(self) -> list[torch.Tensor]:
        out = []
        for where, key, i in self._new_entries():
            if where == "calls":
                out.append(self._calls[key][i][0])
            elif where == "max":
                out.append(self._maxima[key][i])
            elif where == "sums":
                out.append(self._sums[key][i][0])
            else:
                out.append(self._scalars[key])
        return out

    def absorb(self, values: list[torch.Tensor]) -> None:
        """Put the batched call's statistics back, each now (M, ...), where the hooks recorded them; a sum
        that is a vector goes back as (..., M), the member last, as `collect` reads every value."""
        for (where, key, i), value in zip(list(self._new_entries()), values):
            if where == "calls":
                self._calls[key][i] = (value, self._calls[key][i][1])
            elif where == "max":
                self._maxima[key][i] = value
            elif where == "sums":
                self._sums[key][i] = (value.movedim(0, -1), self._sums[key][i][1])
            else:
                self._scalars[key] = value

    def _tap(self, x: torch.Tensor) -> torch.Tensor:
        tap = next(self._tap_iter, None)
        return x if tap is None else x + tap

    def _watch_gradient(self, key: str, x: torch.Tensor) -> None:
        pass  # the taps carry the stream's gradient (measure_gradients)

    def _on_embed(self, module, args):
        super()._on_embed(module, args)
        return (self._tap(args[0]), *args[1:])

    def _on_stream(self, label: str):
        record = super()._on_stream(label)

        def hook(module, args, out):
            record(module, args, out)
            return self._tap(out)

        return hook

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Probe.watch, and taps for the batched calls made inside."""
        self._watching = True
        try:
            with super().watch():
                yield
        finally:
            self._watching = False

    # ------------------------------------------------------------------ outside it

    @torch.no_grad()
    def measure_gradients(self, scaler=None) -> None:
        """Per-member gradient norms of every parameter and of the stream (from the taps), before clipping."""
        stacked = self._stacked()
        self._grad_norms = member_norms([p.grad if p.grad is not None else torch.zeros_like(p) for p in stacked])
        keys = ["grad/embed_rms", *(layer_key("grad/resid_rms", label) for label in self.labels)]
        for taps in self._taps:
            for key, tap in zip(keys, taps):
                if tap.grad is not None:
                    norms = member_norms([tap.grad])[0]
                    self._calls.setdefault(key, []).append((norms, tap[0].numel()))
        self._taps = []

    @torch.no_grad()
    def before_update(self) -> None:
        stacked = self._stacked()
        self._before = [p.detach().clone() for p in stacked]
        self._weight_norms = member_norms(stacked)
        params, buffers = self.pack.params, self.pack.buffers
        prefix = {id(m): name for name, m in self.model.named_modules()}
        for loc, norm in self._norms.items():
            owner = prefix[id(norm)]
            named = ((name, params[f"{owner}.{name}"]) for name, _ in norm.named_parameters(recurse=False))
            self._scalars.update(norm_parameter_stats(loc, named, buffers.get(f"{owner}.running_var")))

    @torch.no_grad()
    def collect(self) -> list[dict[str, float]]:
        """Finish the step: the statistics of each member, as Probe.collect returns them for one model."""
        members = self.pack.size
        deltas = None
        if self._before is not None:
            deltas = member_norms([p.detach() - b for p, b in zip(self._stacked(), self._before)])
        parts = self._device_parts(deltas)  # no "scale": a pack trains without a GradScaler
        rows = [t.float().reshape(-1, members) for ts in parts.values() for t in ts]
        table = torch.cat(rows).T.tolist() if rows else [[] for _ in range(members)]  # the one host transfer
        stats = []
        for column in table:
            host, offset = {}, 0
            for name, ts in parts.items():
                size = sum(t.numel() // members for t in ts)
                host[name] = column[offset: offset + size]
                offset += size
            stats.append(self._combine(host))
        self._reset()
        return stats
