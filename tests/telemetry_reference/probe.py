# FROZEN REFERENCE: a verbatim copy of normlab/train/probe.py at commit 9034483a19e1d273422b5896e68008abef312981,
# its imports of the other probe modules pointed at this package. tests/test_telemetry_golden.py compares
# the live Probe's statistics against it. Do not edit it (not even to follow a rename or a fix): it is what
# the statistics meant before issue 36 changed the Probe. A key whose definition changes on purpose keeps
# its old definition here; the golden test compares the live key against the new one, computed in the test.
"""Per-layer telemetry: the Probe that measures how activations, gradients and updates flow through depth.

On a telemetry step the training loop runs its micro-batches inside `probe.watch()`,
then calls `measure_gradients` (accumulated, un-scaled gradient, before clipping),
`before_update` (just before the optimizer step) and `collect` (after it); the Telemetry
callback (normlab.train.callbacks) makes those calls. On any other step the Probe has no hook
registered and does nothing. The Probe measures and returns records; it keeps no history
and draws nothing (the end-of-run table and heatmaps are made from the records).

Every statistic is reduced on the device to scalars or short vectors (norms, maxima, sums with
their count); `collect` moves them to the host in one transfer. Each micro-batch adds to the step's
sums, so a statistic is over the whole step's batch whatever grad_accum is. Hooks attach to the eager modules and statistics are
computed outside the model's forward, so a loop that runs a compiled model must run
the eager one on telemetry steps.

Keys (built by normlab.keys; L03 = block 3, zero-padded so wandb's panels sort):
    act/resid_rms/L03, act/resid_max/L03    the residual stream after block 3
    act/out_rms/L03/attn, .../mlp           a sublayer's output, before any output norm
    act/norm_in_rms/L03/norm1, act/norm_out_rms/L03/norm1, ... and .../norm_f
    act/embed_rms, act/embed_max            token + position embedding (before embed_norm's norm)
    act/block_angle/L03, act/token_cos/L03  input/output angle of block 3; cosine between its output's tokens
    act/block_angle_last/L03                the input/output angle of each sequence's last token
    act/kurtosis/L03, act/max_median/L03    outlier features and massive activations after block 3
    act/max_median_max/L03, act/top_median/L03   the largest per-token ratio; Sun et al.'s per-sequence ratio
    grad/resid_rms/L03, grad/embed_rms      RMS of dLoss/d(stream) after block 3 / d(embedding)
    grad/norm/L03, grad/norm/L03/{attn,mlp,norms}, grad/embed_norm, grad/norm_embed_norm, grad/norm_f_norm
    update_ratio/L03 (attn and mlp together), update_ratio/L03/{attn,mlp,norms}, update_ratio/embed, .../norm_embed,
        .../norm_f
    norm/gain_mean/L03/norm1, .../L03/q_norm (QK-norm), .../norm_embed, norm/gain_std/..., norm/alpha/...,
        norm/shift/... (Derf), norm/running_var/..., norm/eps_ratio/... (input RMS / sqrt(eps))
    attn/logit_max/L03, attn/entropy/L03, attn/entropy_min/L03
    out/logz                                mean log-partition function of the output logits
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import nn

from normlab.keys import layer_key, layer_label, parse
from telemetry_reference.probe_norms import eps_floors, eps_ratios, norm_modules, norm_parameter_stats
from telemetry_reference.probe_stats import (
    attention_stats,
    block_angle_sum,
    feature_kurtosis,
    feature_square_sums,
    head_entropy_stats,
    l2,
    l2_norms,
    logz_sum,
    max_abs,
    max_median_ratios,
    token_cos_sum,
    top_median_sum,
)

# The gradient-norm keys of the parameter groups outside the blocks (a block's group 'L03/attn' is grad/norm/L03/attn).
GROUP_GRAD_KEYS = {"embed": "grad/embed_norm", "norm_embed": "grad/norm_embed_norm", "norm_f": "grad/norm_f_norm"}

# The attention statistics and the max/median ratio are taken on the step's first PROBE_SEQS sequences,
# however many micro-batches hold them (grad_accum cuts the batch into consecutive chunks, so they are the
# same sequences whatever its value): the explicit T×T score matrix and the per-token median are the most
# expensive statistics.
PROBE_SEQS = 8


def _as_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Queries or keys as (B, n_head, T, head_dim): a QK-norm over the whole projection sees them as (B, T, C)."""
    if x.dim() == 4:
        return x
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(1, 2)


class Probe:
    """Measures one model's per-layer statistics on the steps `active` says.

    `model` is a normlab GPT (or anything with `blocks`, `tok_emb`, `pos_emb`, `norm_f`, `head` and
    attention modules with `n_head` and `q_norm`/`k_norm`). `every=0` makes no step active.

    On the device, each hooked tensor is reduced to its L2 norm, its max |x| or a sum (probe_stats) and
    each parameter to the L2 norm of its gradient, weight and update; `collect` moves these few hundred
    values to the host at once and combines them there (RMS over micro-batches, sums over their counts,
    norms over parameter groups).
    """

    def __init__(self, model: nn.Module, every: int, max_steps: int):
        self.model = model
        self.every = every
        self.last_step = max_steps - 1
        depth = len(model.blocks)
        self.labels = [layer_label(i, depth) for i in range(depth)]
        self._params, self._groups = self._param_groups()
        self._norms = norm_modules(model, self.labels)
        self._eps_floors = eps_floors(self._norms)
        self._reset()

    def _reset(self) -> None:
        self._calls: dict[str, list[tuple[torch.Tensor, int]]] = {}  # RMS keys: (L2 norm, numel) per hooked call
        self._maxima: dict[str, list[torch.Tensor]] = {}
        self._scalars: dict[str, torch.Tensor] = {}  # finished statistics (norm parameters)
        self._sums: dict[str, list[tuple[torch.Tensor, int]]] = {}  # (sum, how many terms) per hooked call
        self._taken: dict[str, int] = {}  # sequences of the step measured so far, per hook site
        self._grad_norms: torch.Tensor | None = None  # one entry per parameter, aligned with self._params
        self._weight_norms: torch.Tensor | None = None
        self._before: torch.Tensor | None = None  # the weights before the update, all in one flat copy
        self._scale: torch.Tensor | None = None
        self._qk: dict[str, torch.Tensor] = {}

    def _param_groups(self) -> tuple[list[nn.Parameter], dict[str, list[int]]]:
        """The model's parameters (each once) and groups of their indices by location:
        'L03' (the whole block), 'L03/attn', 'L03/mlp', 'L03/norms', 'embed', 'norm_embed', 'norm_f'.

        'L03/norms' holds every norm parameter of the block, QK-norm's gains included; 'L03/attn'
        holds the attention's projections only."""
        params: list[nn.Parameter] = []
        index: dict[int, int] = {}

        def ids(modules_params) -> list[int]:
            out = []
            for p in modules_params:
                if id(p) not in index:
                    index[id(p)] = len(params)
                    params.append(p)
                out.append(index[id(p)])
            return out

        groups = {
            "embed": ids([self.model.tok_emb.weight, self.model.pos_emb.weight]),  # tok_emb is also the tied head
            "norm_embed": ids(getattr(self.model, "norm_embed", nn.Identity()).parameters()),
            "norm_f": ids(self.model.norm_f.parameters()),
        }
        for label, block in zip(self.labels, self.model.blocks):
            groups[label] = ids(block.parameters())
            for name, child in block.named_children():
                part = "norms" if name.startswith("norm") else name
                qk_norms = [child.q_norm, child.k_norm] if name == "attn" else []
                qk = {id(p) for norm in qk_norms for p in norm.parameters()}
                groups.setdefault(f"{label}/{part}", []).extend(ids(p for p in child.parameters() if id(p) not in qk))
                groups.setdefault(f"{label}/norms", []).extend(ids(p for norm in qk_norms for p in norm.parameters()))
        return params, {loc: members for loc, members in groups.items() if members}

    def _update_members(self, loc: str, members: list[int]) -> list[int]:
        """The parameters of update_ratio/<loc>: a whole block's figure ('L03') is over its sublayers'
        weights (attn and mlp) alone. Norm gains sit near 1 and, in the denominator, would make the
        figure differ between norms whose sublayers update alike; they have update_ratio/L03/norms."""
        if loc not in self.labels:
            return members
        return self._groups.get(f"{loc}/attn", []) + self._groups.get(f"{loc}/mlp", [])

    def active(self, step: int) -> bool:
        """True at step 0, every `every` steps and at the last training step; never when `every` is 0."""
        return self.every > 0 and (step % self.every == 0 or step == self.last_step)

    # ------------------------------------------------------------------ activations

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Hook the model for the forward and backward passes run inside; every hook is removed on exit."""
        # The token + position embedding: the input of embed_norm=true's norm, else what enters block 0.
        embed_norm = self._norms.get("norm_embed")
        handles = [(self.model.blocks[0] if embed_norm is None else embed_norm).register_forward_pre_hook(self._on_embed)]
        for label, block in zip(self.labels, self.model.blocks):
            handles.append(block.register_forward_hook(self._on_stream(label)))
            handles.append(block.attn.register_forward_hook(self._on_attention(label)))
            handles.append(block.attn.q_norm.register_forward_hook(self._on_qk(label, "q")))
            handles.append(block.attn.k_norm.register_forward_hook(self._on_qk(label, "k")))
            handles.append(block.mlp.register_forward_hook(self._on_output(layer_key("act/out_rms", label, "mlp"))))
        handles.append(self.model.head.register_forward_hook(self._on_logits))
        for loc, norm in self._norms.items():
            handles.append(norm.register_forward_hook(self._on_norm(loc)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._qk.clear()

    def _record(self, key: str, x: torch.Tensor) -> None:
        self._calls.setdefault(key, []).append((l2(x), x.numel()))

    def _watch_gradient(self, key: str, x: torch.Tensor) -> None:
        if x.requires_grad:
            x.register_hook(lambda grad: self._record(key, grad))

    def _on_embed(self, module, args):
        x = args[0]
        self._record("act/embed_rms", x)
        self._maxima.setdefault("act/embed_max", []).append(max_abs(x))
        self._watch_gradient("grad/embed_rms", x)

    def _on_stream(self, label: str):
        def hook(module, args, out):
            self._record(layer_key("act/resid_rms", label), out)
            self._maxima.setdefault(layer_key("act/resid_max", label), []).append(max_abs(out))
            self._watch_gradient(layer_key("grad/resid_rms", label), out)
            self._measure_stream(label, args[0], out)

        return hook

    @torch.no_grad()
    def _measure_stream(self, label: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Block influence, token similarity and outlier statistics of the stream `out` (B, T, d) after
        the block `label`, whose input was `x`."""
        tokens = out.numel() // out.size(-1)
        self._add(layer_key("act/block_angle", label), block_angle_sum(x, out), tokens)
        # Gromov et al.'s and the Curse of Depth's angular distance: the sequence's last token alone.
        self._add(layer_key("act/block_angle_last", label), block_angle_sum(x[..., -1, :], out[..., -1, :]), out.size(0))
        self._add(layer_key("act/kurtosis", label), feature_square_sums(out), tokens)
        if out.size(-2) > 1:  # a pair of distinct tokens needs two
            self._add(layer_key("act/token_cos", label), token_cos_sum(out), out.size(0))
        rows = self._probe_rows(f"{label}/stream", out.size(0))
        if rows:
            ratios = max_median_ratios(out[:rows])
            self._add(layer_key("act/max_median", label), ratios.sum(), rows * out.size(-2))
            self._maxima.setdefault(layer_key("act/max_median_max", label), []).append(ratios.amax())
            self._add(layer_key("act/top_median", label), top_median_sum(out[:rows]), rows)

    def _on_logits(self, module, args, out):
        with torch.no_grad():
            self._add("out/logz", logz_sum(out), out.numel() // out.size(-1))

    def _add(self, key: str, total: torch.Tensor, count: int) -> None:
        """Record a sum of `count` terms; the step's statistic is the sum over its calls / their count."""
        self._sums.setdefault(key, []).append((total, count))

    def _on_output(self, key: str):
        def hook(module, args, out):
            self._record(key, out)

        return hook

    def _on_norm(self, loc: str):
        def hook(module, args, out):
            self._record(f"act/norm_in_rms/{loc}", args[0])
            self._record(f"act/norm_out_rms/{loc}", out)

        return hook

    def _on_qk(self, label: str, which: str):
        def hook(module, args, out):
            self._qk[f"{label}/{which}"] = out

        return hook

    def _on_attention(self, label: str):
        def hook(module, args, out):
            self._record(layer_key("act/out_rms", label, "attn"), out)
            q, k = self._qk.pop(f"{label}/q", None), self._qk.pop(f"{label}/k", None)
            if q is None or k is None:
                return  # heads() did not run its q/k norms
            q, k = _as_heads(q, module.n_head), _as_heads(k, module.n_head)
            rows = self._probe_rows(f"{label}/attn", q.size(0))
            if rows:
                with torch.no_grad():
                    logit_max, head_entropy = attention_stats(q[:rows], k[:rows], getattr(module, "softcap", None))
                self._maxima.setdefault(layer_key("attn/logit_max", label), []).append(logit_max)
                self._add(layer_key("attn/entropy", label), head_entropy, rows)

        return hook

    def _probe_rows(self, site: str, batch: int) -> int:
        """How many leading sequences of this micro-batch of `batch` are among the step's first PROBE_SEQS."""
        taken = self._taken.get(site, 0)
        rows = max(0, min(batch, PROBE_SEQS - taken))
        self._taken[site] = taken + rows
        return rows

    # ------------------------------------------------------------------ gradients and updates

    @torch.no_grad()
    def measure_gradients(self, scaler: torch.amp.GradScaler) -> None:
        """Gradient statistics of the step. Call after `scaler.unscale_` and before clipping.

        The residual-stream gradients were captured during backward with the loss scaled by the
        GradScaler; its current scale is kept (as a device tensor: no host sync) to divide them by.
        """
        self._grad_norms = l2_norms([p.grad for p in self._params])
        self._scale = scaler.scale(torch.ones((), device=self._params[0].device))

    @torch.no_grad()
    def before_update(self) -> None:
        """Snapshot the weights (for the update ratios) and measure the norms' parameters. Call just before the optimizer step."""
        self._before = torch.cat([p.detach().reshape(-1) for p in self._params])
        self._weight_norms = l2_norms(list(self._params))
        for loc, norm in self._norms.items():
            params = ((name, p.unsqueeze(0)) for name, p in norm.named_parameters(recurse=False))
            running_var = getattr(norm, "running_var", None)
            running_var = running_var.unsqueeze(0) if isinstance(running_var, torch.Tensor) else None
            self._scalars.update({k: v[0] for k, v in norm_parameter_stats(loc, params, running_var).items()})

    @torch.no_grad()
    def collect(self) -> dict[str, float]:
        """Finish the step and return every statistic as {key: float}.

        Call after the optimizer step: the update ratio ‖ΔW‖/‖W‖ is over the step just taken.
        All device values reach the host in one transfer.
        """
        deltas = None
        if self._before is not None:
            before = [b.view_as(p) for b, p in zip(self._before.split([p.numel() for p in self._params]), self._params)]
            deltas = l2_norms(torch._foreach_sub([p.detach() for p in self._params], before))
        parts = self._device_parts(deltas)
        flat = [t.float().reshape(-1) for ts in parts.values() for t in ts]
        host_values = torch.cat(flat).tolist() if flat else []  # the one host transfer
        host: dict[str, list[float]] = {}
        offset = 0
        for name, ts in parts.items():
            size = sum(t.numel() for t in ts)
            host[name] = host_values[offset : offset + size]
            offset += size
        stats = self._combine(host)
        self._reset()
        return stats

    def _device_parts(self, deltas: torch.Tensor | None) -> dict[str, list[torch.Tensor]]:
        """The step's device values by part name, in the order that `collect` transfers them and `_combine`
        reads them back; `deltas` are the parameters' update norms."""
        vectors = {"grad": self._grad_norms, "weight": self._weight_norms, "delta": deltas}
        return {
            **{f"calls:{k}": [n for n, _ in calls] for k, calls in self._calls.items()},
            **{f"max:{k}": v for k, v in self._maxima.items()},
            **{f"scalar:{k}": [v] for k, v in self._scalars.items()},
            **{f"sums:{k}": [torch.stack([t for t, _ in entries]).sum(0)] for k, entries in self._sums.items()},
            **{name: [] if v is None else [v] for name, v in vectors.items()},
            "scale": [] if self._scale is None else [self._scale],
        }

    def _combine(self, host: dict[str, list[float]]) -> dict[str, float]:
        """Host-side arithmetic on the transferred scalars."""
        stats: dict[str, float] = {}
        scale = host["scale"][0] if host["scale"] else 1.0
        for key, calls in self._calls.items():
            # Mean of the calls' mean squares: with equal micro-batches that is the whole batch's mean
            # square. A stream gradient of a micro-batch whose loss was scaled by 1/grad_accum is exactly
            # its slice of the full-batch gradient, so the same holds for grad/*.
            mean_square = sum(n * n / numel for n, (_, numel) in zip(host[f"calls:{key}"], calls)) / len(calls)
            stats[key] = math.sqrt(mean_square) / (scale if key.startswith("grad/") else 1.0)
        for key in self._maxima:
            stats[key] = max(host[f"max:{key}"])
        for key in self._scalars:
            stats[key] = host[f"scalar:{key}"][0]
        stats.update(eps_ratios(stats, self._eps_floors))
        for key, entries in self._sums.items():
            stats.update(_finish_sum(key, host[f"sums:{key}"], sum(n for _, n in entries)))
        for loc, members in self._groups.items():
            if host["grad"]:
                key = GROUP_GRAD_KEYS.get(loc, f"grad/norm/{loc}")
                stats[key] = _group_norm(host["grad"], members)
            if host["delta"]:
                updated = self._update_members(loc, members)
                weight = _group_norm(host["weight"], updated)
                stats[f"update_ratio/{loc}"] = _group_norm(host["delta"], updated) / weight if weight > 0 else math.nan
        return dict(sorted(stats.items()))


def _finish_sum(key: str, sums: list[float], count: int) -> dict[str, float]:
    """The statistics of a summed key: `sums` over the step's calls, of `count` terms in all."""
    parsed = parse(key)
    if parsed and parsed.stat == "attn/entropy":
        mean, smallest = head_entropy_stats(sums, count)
        return {key: mean, layer_key("attn/entropy_min", parsed.label): smallest}
    if parsed and parsed.stat == "act/kurtosis":
        return {key: feature_kurtosis(sums)}
    return {key: sums[0] / count}


def _group_norm(norms: list[float], members: list[int]) -> float:
    """The L2 norm of a group of tensors, from each member's L2 norm."""
    return math.sqrt(sum(norms[i] ** 2 for i in members))
