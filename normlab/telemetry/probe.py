"""Per-layer telemetry: the Probe that measures how activations, gradients and updates flow through depth.

On a telemetry step the training loop runs its micro-batches through `probe.forward` in place of the
model, then calls `measure_gradients` (accumulated, un-scaled gradient, before clipping), `before_update`
(just before the optimizer step) and `stage` (after it), whose result is read when the step's row is written
(`collect` does both at once); the Telemetry callback (normlab.train.callbacks) makes those calls. On any other step the model runs as it would without the
Probe: no tap, nothing computed. The Probe measures and returns records; it keeps no history and draws
nothing (the end-of-run table and heatmaps are made from the records).

`forward` runs the model with a tap (normlab.nn.tap) that keeps the tensors it is shown, then computes the
statistics of every site for all blocks at once (telemetry.sites): stacked tensors, fused multi-tensor norms,
two flat vectors per micro-batch. The residual stream's gradient is measured in backward by an identity
(sites.Collect) whose second input collects its sum of squares. Parameter norms are fused too
(torch._foreach_norm). Each micro-batch adds to the step's sums, so a statistic is over the whole step's
batch whatever grad_accum is; `stage` sends everything to the host in one copy that does not block it
(telemetry.readback), and the Pending it returns names the values once they have landed. Under compile=true the
forward and its statistics are one compiled function (dynamic=False), a graph beside the plain step's,
compiled at the first telemetry step and reused by every later one; the backward's measurements are part of
its compiled backward. Where the plain steps run in CUDA graphs (compile_mode=reduce-overhead on CUDA), so does
this one (`graphs`): captured at the second telemetry step, replayed from the third on.

Keys (built by normlab.keys; L03 = block 3, zero-padded so wandb's panels sort):
    act/resid_rms/L03, act/resid_max/L03    the residual stream after block 3
    act/out_rms/L03/attn, .../mlp           a sublayer's output, before any output norm
    act/norm_in_rms/L03/norm1, act/norm_out_rms/L03/norm1, ... and .../norm_f
    act/embed_rms, act/embed_max            token + position embedding (before embed_norm's norm)
    act/block_angle/L03, act/token_cos/L03  input/output angle of block 3; cosine between its output's tokens
    act/block_angle_last/L03                the input/output angle of each sequence's last token
    act/kurtosis/L03                        outlier features after block 3 (He et al.'s K of the features' RMS)
    act/max_median/L03, .../max_median_max  a token's max/median |x| after centring it, mean and largest over tokens
    act/top_median/L03, act/top_median_max/L03   Sun et al.'s per-sequence ratio: mean and largest over sequences
    grad/resid_rms/L03, grad/embed_rms      RMS of dLoss/d(stream) after block 3 / d(embedding)
    grad/norm/L03 (attn and mlp together), grad/norm/L03/{attn,mlp,norms,gate1,gate2}, grad/embed_norm,
        grad/norm_embed_norm, grad/norm_f_norm
    update_ratio/L03 (attn and mlp together), update_ratio/L03/{attn,mlp,norms,gate1,gate2}, update_ratio/embed,
        .../norm_embed, .../norm_f
    norm/gain_mean/L03/norm1, .../L03/q_norm (QK-norm), .../norm_embed, norm/gain_std/..., norm/alpha/...,
        norm/shift/... (Derf), norm/running_var/..., norm/eps_ratio/... (input RMS / Norm.eps_rms)
    attn/logit_max/L03, attn/entropy/L03, attn/entropy_min/L03
    out/logz                                mean log-partition function of the output logits
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from normlab.keys import layer_key, layer_label
from normlab.telemetry.norms import (
    NormParams,
    eps_floors,
    eps_ratios,
    norm_modules,
    norm_parameter_groups,
    norm_parameter_stats,
)
from normlab.telemetry.params import group_figures, group_stats, param_groups
from normlab.telemetry.readback import Readback
from normlab.telemetry.sites import PROBE_SEQS, Entry, Plan, Recorder, read_entries
from normlab.telemetry.stats import l2_norms



def watched_forward(net: nn.Module, idx: torch.Tensor, collectors: list[torch.Tensor], plan: Plan):
    """`net`'s logits for `idx`, run with a Recorder as its tap, and the statistics of what it was shown:
    (logits, sums, maxima, entries), see sites.Recorder. The function that compile=true compiles."""
    tap = Recorder(collectors, plan)
    logits = net(idx, tap=tap)
    sums, maxima, entries = tap.finish()
    return logits, sums, maxima, entries


class Probe:
    """Measures one model's per-layer statistics on the steps `active` says.

    `model` is a normlab GPT (its forward takes a tap); `net` is what the forward runs (the DDP wrapper under
    torchrun; by default `model`); `compiled`: run the forward and its statistics compiled; `graphs`: and capture
    them, with their backward, in CUDA graphs (torch.compile's reduce-overhead mode). `every=0` makes no step
    active.
    """

    members = 1  # models measured at once (a pack's PackedProbe: its members)

    def __init__(self, model: nn.Module, every: int, max_steps: int, net: nn.Module | None = None,
                 compiled: bool = False, graphs: bool = False):
        self.model, self.net = model, model if net is None else net
        self.every = every
        self.last_step = max_steps - 1
        depth = len(model.blocks)
        self.labels = tuple(layer_label(i, depth) for i in range(depth))
        self._params, self._groups = param_groups(model, self.labels)
        self._figures = group_figures(self._groups, self.labels)
        self._norms = norm_modules(model, self.labels)
        self._eps_floors = eps_floors(self._norms)
        self._norm_groups = norm_parameter_groups(model, self._norms)
        # Each group's tensors as (module, attribute): read afresh each step (a buffer may be reassigned), without
        # walking the module tree by name.
        self._norm_sources = {group: [(model.get_submodule(owner), attr) for owner, _, attr in
                                      (name.rpartition(".") for name in group.names)] for group in self._norm_groups}
        self._softcap = getattr(model.blocks[0].attn, "softcap", None)
        self._width = model.tok_emb.embedding_dim
        self._grad_keys = ("grad/embed_rms", *(layer_key("grad/resid_rms", label) for label in self.labels))
        # Zero leaves whose gradients collect the stream's (Collect): made once, read and cleared each step.
        self._collectors = [torch.zeros((), device=model.tok_emb.weight.device, requires_grad=True)
                            for _ in self._grad_keys]
        self._plans: dict[tuple[int, bool], Plan] = {}
        self._graphs = compiled and graphs
        self._forward = watched_forward
        if compiled:
            self._forward = torch.compile(watched_forward, dynamic=False, **({"mode": "reduce-overhead"} if graphs else {}))
        if self._graphs:
            for collector in self._collectors:
                # A replay reads them where the capture did, without copying them in (their gradients are kept
                # outside the graphs' memory: _reset)
                torch._dynamo.mark_static_address(collector)
        self._reset()

    def _reset(self) -> None:
        self._sums: torch.Tensor | None = None  # the forward statistics so far, and their entries and counts
        self._maxima: torch.Tensor | None = None
        self._entries: tuple[tuple[Entry, ...], ...] = ((), ())
        self._counts: list[list[int]] = [[], []]
        self._taken = 0  # sequences of the step probed so far
        self._stream_elements = 0  # elements of the stream per member, over the step's micro-batches
        self._grad_norms: torch.Tensor | None = None  # one entry per parameter, aligned with self._params
        self._weight_norms: torch.Tensor | None = None
        self._norm_values: list[tuple[tuple[str, ...], torch.Tensor]] = []
        self._before: list[torch.Tensor] | None = None  # the weights before the update
        self._scale: torch.Tensor | None = None
        if not self._graphs:
            for collector in self._collectors:
                collector.grad = None
        elif self._collectors[0].grad is None:
            # Under CUDA graphs a gradient autograd set from a backward's output would be that graph's memory, which
            # the next micro-batch's replay overwrites: allocated here once, each backward adds into it.
            for collector in self._collectors:
                collector.grad = torch.zeros_like(collector)
        else:
            torch._foreach_zero_([collector.grad for collector in self._collectors])

    def active(self, step: int) -> bool:
        """True at step 0, every `every` steps and at the last training step; never when `every` is 0."""
        return self.every > 0 and (step % self.every == 0 or step == self.last_step)

    # ------------------------------------------------------------------ activations

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The model's logits for one micro-batch (B, T) of a telemetry step, its statistics measured on the way."""
        if self._graphs:  # each micro-batch a new replay, as a plain step's (runtime.compile_model)
            torch.compiler.cudagraph_mark_step_begin()
        logits, sums, maxima, entries = self._forward(self.net, idx, self._collectors, self._plan(idx.size(0)))
        if self._graphs:  # out of the graphs' memory, which the next micro-batch's replay overwrites
            sums, maxima = sums.clone(), maxima.clone()
        self._absorb(sums, maxima, entries)
        self._stream_elements += idx.size(-1) * idx.size(-2) * self._width
        return logits

    def _plan(self, batch: int, fused: bool = True) -> Plan:
        """The Plan of the next micro-batch of `batch` sequences: how many of them are among the step's first
        PROBE_SEQS. One Plan object per value, so that a compiled forward sees the same one every step."""
        rows = max(0, min(batch, PROBE_SEQS - self._taken))
        self._taken += rows
        if (rows, fused) not in self._plans:
            self._plans[rows, fused] = Plan(self.labels, rows, self._softcap, fused)
        return self._plans[rows, fused]

    def _absorb(self, sums: torch.Tensor, maxima: torch.Tensor, entries: tuple[tuple[Entry, ...], ...]) -> None:
        """Add one micro-batch's forward statistics to the step's."""
        if self._sums is None:
            self._sums, self._maxima, self._entries = sums, maxima, entries
            self._counts = [[entry.count for entry in group] for group in entries]
            return
        if [[e.keys for e in group] for group in entries] != [[e.keys for e in group] for group in self._entries]:
            raise RuntimeError("telemetry: the step's micro-batches measured their statistics in different orders; "
                               "their sums cannot be added key by key")
        self._sums, self._maxima = self._sums + sums, torch.maximum(self._maxima, maxima)
        for counts, group in zip(self._counts, entries):
            for i, entry in enumerate(group):
                counts[i] += entry.count

    # ------------------------------------------------------------------ gradients and updates

    @torch.no_grad()
    def measure_gradients(self, scaler: torch.amp.GradScaler) -> None:
        """Gradient statistics of the step. Call after `scaler.unscale_` and before clipping.

        The stream's gradients were collected during backward with the loss scaled by the GradScaler; its
        current scale is kept (as a device tensor: no host sync) to divide them by.
        """
        self._grad_norms = l2_norms([p.grad for p in self._params])
        if scaler.is_enabled():  # fp16; otherwise the loss was not scaled
            self._scale = scaler.scale(torch.ones((), device=self._params[0].device))

    @torch.no_grad()
    def before_update(self) -> None:
        """Snapshot the weights (for the update ratios) and measure the norms' parameters. Call just before the
        optimizer step."""
        weights = self._weights()
        self._before = torch._foreach_mul(weights, 1.0)  # one fused copy of every weight (× 1 is exact)
        self._weight_norms = self._norms_of(weights)
        self._norm_values = [norm_parameter_stats(group, self._stacked(group)) for group in self._norm_groups]

    def _weights(self) -> list[torch.Tensor]:
        """The parameters, aligned with self._params."""
        return self._params

    def _norms_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of each of `tensors` (aligned with self._params), (members, n) or (n,) for one member."""
        return l2_norms(tensors)

    def _stacked(self, group: NormParams) -> torch.Tensor:
        """The model's tensors of `group` stacked, (len(group.names), members, *shape)."""
        return torch.stack([getattr(module, attr) for module, attr in self._norm_sources[group]]).unsqueeze(1)

    def collect(self) -> dict[str, float]:
        """Finish the step and return every statistic as {key: float}, at once: `stage()` and its `read()`.

        Call after the optimizer step: the update ratio ‖ΔW‖/‖W‖ is over the step just taken."""
        return self.stage().read()[0]

    @torch.no_grad()
    def stage(self) -> Pending:
        """Finish the step on the device and send its statistics to the host without waiting for them: one
        vector, copied without blocking (telemetry.readback); the Probe is ready for its next step at once.
        `read()` on the result gives each member's statistics once the copy has landed. Call after the
        optimizer step: the update ratio ‖ΔW‖/‖W‖ is over the step just taken."""
        if self._before is not None:  # the snapshot becomes the update, in place: no second copy of every weight
            torch._foreach_sub_(self._before, self._weights())
        deltas = None if self._before is None else self._norms_of(self._before)
        parts = self._device_parts(deltas)
        layout = StepLayout(
            parts=tuple((name, part.numel() // self.members) for name, part in parts.items()),
            entries=self._entries, counts=tuple(map(tuple, self._counts)), stream_elements=self._stream_elements,
            norm_keys=tuple(key for keys, _ in self._norm_values for key in keys))
        values = torch.cat([part.reshape(self.members, -1) for part in parts.values()], 1) if parts else None
        pending = Pending(None if values is None else Readback(values.reshape(-1)), layout, self.members, self._combine)
        self._reset()
        return pending

    def _collected(self) -> torch.Tensor | None:
        """The stream's gradient sums of squares, one per grad key, or None without a backward."""
        grads = [c.grad for c in self._collectors]
        return None if any(g is None for g in grads) else torch.stack(grads)

    def _device_parts(self, deltas: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The step's device values by part name, each (members, n) or (n,) for one member, in the order that
        `stage` transfers them and `_combine` reads them back; `deltas` are the parameters' update norms."""
        parts = {"sums": self._sums, "maxima": self._maxima, "collected": self._collected(), "grad": self._grad_norms,
                 "weight": self._weight_norms, "delta": deltas, "scale": self._scale}
        if self._norm_values:
            parts["norm"] = torch.cat([values for _, values in self._norm_values]).T
        return {name: part for name, part in parts.items() if part is not None}

    def _combine(self, host: dict[str, list[float]], layout: StepLayout) -> dict[str, float]:
        """Host-side arithmetic on one member's transferred values."""
        stats: dict[str, float] = {}
        for group, (entries, counts) in zip(("sums", "maxima"), zip(layout.entries, layout.counts)):
            if group in host:
                stats.update(read_entries(entries, counts, host[group]))
        if "collected" in host:
            # The sum of squares of the stream's gradient over the step's micro-batches, each of whose losses was
            # scaled by 1/grad_accum: exactly its slice of the full-batch gradient, so this is the batch's RMS.
            scale = host["scale"][0] if "scale" in host else 1.0
            for key, total in zip(self._grad_keys, host["collected"]):
                stats[key] = math.sqrt(total / layout.stream_elements) / scale
        if "norm" in host:
            stats.update(zip(layout.norm_keys, host["norm"]))
        stats.update(eps_ratios(stats, self._eps_floors))
        stats.update(group_stats(self._figures, host.get("grad", []), host.get("weight", []), host.get("delta", [])))
        return dict(sorted(stats.items()))


@dataclass(frozen=True)
class StepLayout:
    """What the host needs besides the values to name a telemetry step's statistics: the transferred parts (name,
    values per member, in order), the forward's entries and their counts over the step, the stream's elements
    per member, and the keys of the norms' parameter statistics."""

    parts: tuple[tuple[str, int], ...]
    entries: tuple[tuple[Entry, ...], ...]
    counts: tuple[tuple[int, ...], ...]
    stream_elements: int
    norm_keys: tuple[str, ...]


class Pending:
    """A telemetry step's statistics between `Probe.stage` and its record: their Readback, and how to name them."""

    def __init__(self, readback: Readback | None, layout: StepLayout, members: int,
                 combine: Callable[[dict[str, list[float]], StepLayout], dict[str, float]]):
        self.readback, self.layout, self.members, self._combine = readback, layout, members, combine

    def ready(self) -> bool:
        """Whether the copy has landed: `read()` would not wait."""
        return self.readback is None or self.readback.ready()

    def read(self) -> list[dict[str, float]]:
        """Each member's statistics as {key: float}, once the copy has landed (waiting for it, if it has not)."""
        if self.readback is None:
            return [{} for _ in range(self.members)]
        values, out = self.readback.values(), []
        width = len(values) // self.members
        for row in range(self.members):
            host, offset = {}, row * width
            for name, size in self.layout.parts:
                host[name], offset = values[offset : offset + size], offset + size
            out.append(self._combine(host, self.layout))
        return out
