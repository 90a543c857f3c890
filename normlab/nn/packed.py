"""The packed model and its optimizer: M models of one architecture trained as one, with a leading member dimension.

Every parameter and buffer of the M members is stacked along a new first dimension
(torch.func.stack_module_state), and one forward runs all members in batched kernels: torch.func.vmap
over a functional call of a template GPT (torch.func.functional_call), which holds the module tree
and whose own weights are never used. So the members run the very modules an unpacked run runs (every
norm, every placement), with weights, statistics and data of their own: a member's forward, loss and
gradient are its unpacked run's, up to the summation order of batched kernels. Attention alone leaves vmap's
batching: all members' attention is one call of torch's fused kernel, the members folded into its batch
(FoldedAttention).

The optimizer is AdamW written over the stacked tensors with one learning rate per member
(torch's AdamW takes one lr per parameter group), the update torch.optim.AdamW takes, term by term.
Clipping is per member: each member's gradient is scaled by its own total norm, as
torch.nn.utils.clip_grad_norm_ scales an unpacked run's. A member can be frozen (lr 0, gradient 0):
a diverged member stops changing and its NaNs stay in its own slices, since no kernel mixes members.
The module knows nothing of Hydra, sinks or the training loop.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from normlab.nn import sublayers
from normlab.nn.norms import StepStatistics

# Attention under vmap (fold_attention false): on the CPU torch has no batching rule for its flash-attention
# kernel, so vmap runs attention member by member (correct, slower) and warns once per process.
warnings.filterwarnings("ignore", message=r".*not yet implemented the batching rule for aten::_scaled_dot_product")


def attention_kernels(device: torch.device):
    """The attention kernels a packed forward that runs attention under vmap (PackedModel.fold_attention false)
    may use on `device`. On CUDA, torch's own math kernel alone: under vmap the fused kernels' backward fails
    ("LSE is not correctly aligned (strideH)", measured on an H200 with torch 2.11 in fp32 and bf16; a known
    limit of the memory-efficient kernel's backward under vmap), while the math kernel is plain matmuls and a
    softmax, which vmap batches. It holds the T×T scores of every member at once (M·B·n_head·T² values).
    On the CPU the choice is torch's, as in an unpacked run."""
    return sdpa_kernel([SDPBackend.MATH]) if device.type == "cuda" else nullcontext()


class FoldedAttention(torch.autograd.Function):
    """Causal attention (sublayers.causal_attention) whose rule under vmap folds the member dimension into the
    batch: q, k, v of shape (M, B, n_head, T, head_dim) become one call of F.scaled_dot_product_attention on
    (M·B, n_head, T, head_dim), outside vmap's batching. So torch picks its fused kernel for all members at
    once (flash, cuDNN or memory-efficient on CUDA, flash on the CPU) and differentiates it with that kernel's
    own backward; each batch row's attention is computed as an unpacked run computes it.

    Outside vmap it is F.scaled_dot_product_attention, its gradient taken by recomputing the forward."""

    @staticmethod
    def forward(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            return torch.autograd.grad(F.scaled_dot_product_attention(*inputs, is_causal=True), inputs, grad)

    @staticmethod
    def vmap(info, in_dims, q, k, v):
        members = info.batch_size

        def fold(t, dim):
            t = t.expand(members, *t.shape) if dim is None else t.movedim(dim, 0)
            return t.flatten(0, 1)

        y = F.scaled_dot_product_attention(*(fold(t, d) for t, d in zip((q, k, v), in_dims)), is_causal=True)
        return y.unflatten(0, (members, -1)), 0


@contextmanager
def folded_attention():
    """Within it, the model's causal attention (sublayers.causal_attention) is FoldedAttention. A pack's forward
    runs in one thread; an unpacked model in another thread at the same time would run it too (the same values)."""
    plain = sublayers.causal_attention
    sublayers.causal_attention = FoldedAttention.apply
    try:
        yield
    finally:
        sublayers.causal_attention = plain


class PackedModel:
    """M members of one architecture, stacked: `params` and `buffers` map the template's names to tensors
    of shape (M, *shape). `params` are leaves that collect gradients; `template` is the module tree the
    forward runs (train()/eval() on it set every member's mode).

    `fold_attention`: attention runs as FoldedAttention, all members in one call of torch's fused kernel; else
    vmap batches torch's attention (on CUDA its math kernel alone: attention_kernels), which the benchmark
    (scripts/bench/pack.py --attention) compares."""

    def __init__(self, members: Sequence[nn.Module], fold_attention: bool = True):
        if not members:
            raise ValueError("a pack needs at least one member")
        self.template = members[0]
        self.size = len(members)
        self.fold_attention = fold_attention
        params, buffers = stack_module_state(list(members))
        self.params: dict[str, torch.Tensor] = params
        self.buffers: dict[str, torch.Tensor] = buffers
        self._stepper = _AdvanceStatistics(self.template)  # built once: advance runs every step
        self._linear_biases = {f"{name}.bias" for name, module in self.template.named_modules()
                               if isinstance(module, nn.Linear) and f"{name}.bias" in params}

    def _forward_params(self) -> dict[str, torch.Tensor]:
        """The parameters a forward takes. Under autocast a Linear's bias joins its matmul in autocast's dtype
        (addmm); under vmap linear becomes a matmul, which autocast casts, and an add of the float32 bias, which
        would promote the layer's output, and all that follows it, to float32. So the biases are cast first,
        and a member's layers compute in its unpacked run's dtype."""
        device = next(iter(self.params.values())).device.type
        if not self._linear_biases or not torch.is_autocast_enabled(device):
            return self.params
        dtype = torch.get_autocast_dtype(device)
        return {name: p.to(dtype) if name in self._linear_biases else p for name, p in self.params.items()}

    def _member_logits(self, params, buffers, idx: torch.Tensor, tap=None) -> torch.Tensor:
        with folded_attention() if self.fold_attention else attention_kernels(idx.device):
            return functional_call(self.template, (params, buffers), (idx,), {} if tap is None else {"tap": tap})

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """(M, B, T, vocab) logits for token ids of shape (M, B, T): member m reads idx[m]."""
        return vmap(self._member_logits)(self._forward_params(), self.buffers, idx)

    def losses(self, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, shared: bool = False, watcher=None):
        """Each member's loss_fn(logits, targets), shape (M,). `shared`: x and y, (B, T), are the same for
        every member (held-out batches), else (M, B, T).

        `watcher` (telemetry, normlab.telemetry.packed.PackedProbe) sees inside the batched call: `taps(x)`
        gives tensors (M, ...) passed in per member, `begin(taps)` runs before each member's forward and
        returns the tap (normlab.nn.tap) the forward runs with, or None, and `end()` runs after it, returning
        per-member tensors that `absorb` receives, stacked, after the call."""
        data_dims = None if shared else 0
        if watcher is None:
            def member(params, buffers, xm, ym):
                return loss_fn(self._member_logits(params, buffers, xm), ym)

            return vmap(member, in_dims=(0, 0, data_dims, data_dims))(self._forward_params(), self.buffers, x, y)

        def watched(params, buffers, xm, ym, taps):
            tap = watcher.begin(taps)
            loss = loss_fn(self._member_logits(params, buffers, xm, tap), ym)
            return loss, watcher.end()

        taps = watcher.taps(self.size, x)
        loss, seen = vmap(watched, in_dims=(0, 0, data_dims, data_dims, 0))(self._forward_params(), self.buffers, x,
                                                                            y, taps)
        watcher.absorb(seen)
        return loss

    def advance_running_statistics(self) -> None:
        """One step of every BatchNorm's running statistics, per member (norms.StepStatistics)."""
        if not self._stepper.norms:
            return

        def advance(buffers):
            return functional_call(self._stepper, {f"model.{k}": v for k, v in buffers.items()}, ())

        vmap(advance)(self.buffers)

    def set_per_step(self, per_step: bool) -> None:
        for norm in self._stepper.norms:
            norm.per_step = per_step

    def member_state_dict(self, m: int) -> dict[str, torch.Tensor]:
        """Member m's weights and persistent buffers under the template's state_dict keys (tied weights
        under each of their names), as an unpacked model's state_dict() holds them."""
        tied = {name: p for name, p in self.template.named_parameters(remove_duplicate=False)}
        first = {id(p): name for name, p in reversed(list(tied.items()))}
        out = {}
        for key, value in self.template.state_dict().items():
            if key in self.params:
                out[key] = self.params[key][m].detach().clone()
            elif key in self.buffers:
                out[key] = self.buffers[key][m].clone()
            elif key in tied:  # a tied weight under its second name (head.weight is tok_emb.weight)
                out[key] = self.params[first[id(tied[key])]][m].detach().clone()
            else:
                raise KeyError(key)
        return out

    def load_member_state_dict(self, m: int, state: dict[str, torch.Tensor]) -> None:
        """Put an unpacked model's state_dict (e.g. from a checkpoint) into member m's slices."""
        with torch.no_grad():
            for name, value in self.params.items():
                value[m].copy_(state[name])
            persistent = set(self.template.state_dict())
            for name, value in self.buffers.items():
                if name in persistent:
                    value[m].copy_(state[name])


class _AdvanceStatistics(nn.Module):
    """A module whose forward advances the running statistics of `model`'s BatchNorms: functional_call on it
    swaps a member's buffers in, as it does for the forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.norms = [m for m in model.modules() if isinstance(m, StepStatistics)]

    def forward(self) -> torch.Tensor:
        for norm in self.norms:
            norm.advance_running_statistics()
        return torch.zeros(())


def member_view(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-member vector (M,) shaped to broadcast against a stacked tensor (M, *shape)."""
    return values.view(-1, *([1] * (like.dim() - 1)))


def member_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """(len(tensors), M): the L2 norm of each member's slice of each stacked tensor, in float32."""
    # reshape, not flatten(1): a stacked scalar parameter (DyT's α, ScaleNorm's g) is (M,), with no dim 1
    return torch.stack([torch.linalg.vector_norm(t.detach().reshape(t.shape[0], -1), dim=1, dtype=torch.float32)
                        for t in tensors])


def clip_members(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale each member's gradient to total norm at most `max_norm`, as torch.nn.utils.clip_grad_norm_
    does for one model (coefficient max_norm / (norm + 1e-6), capped at 1); return the norms before, (M,)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(member_norms(grads), dim=0)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(member_view(coef, g).to(g.dtype))
    return total


class PackedAdamW:
    """AdamW over stacked parameters with a learning rate per member (torch.optim.AdamW's update, one
    member per slice): decoupled weight decay p ← p·(1 − lr·wd), then p ← p − lr/(1 − β₁ᵗ) · m / (sqrt(v/(1 − β₂ᵗ)) + ε).

    `decay`: the names of the parameters that take weight decay (train.optim.param_groups' rule)."""

    def __init__(self, params: dict[str, torch.Tensor], decay: set[str], betas: Sequence[float], eps: float,
                 weight_decay: float):
        self.params = params
        self.decay = decay
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay = eps, weight_decay
        self.step_count = 0
        self.exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in params.items()}

    @torch.no_grad()
    def step(self, lrs: Sequence[float]) -> None:
        """One update with member m's learning rate lrs[m] (0 for a frozen member).

        The per-member factors 1 − lr·wd and lr/(1 − β₁ᵗ) are computed in double precision and rounded once,
        as torch's AdamW rounds its Python scalars, and the update is (factor·m)/denom as torch's addcdiv
        computes it: a member's update is torch's, bit for bit, for the same gradient."""
        self.step_count += 1
        bias1 = 1 - self.beta1 ** self.step_count
        bias2_sqrt = (1 - self.beta2 ** self.step_count) ** 0.5
        device = next(iter(self.params.values())).device
        decay = torch.tensor([1 - lr * self.weight_decay for lr in lrs], device=device)
        rate = torch.tensor([lr / bias1 for lr in lrs], device=device)
        for name, p in self.params.items():
            if p.grad is None:
                continue
            g, m, v = p.grad, self.exp_avg[name], self.exp_avg_sq[name]
            if name in self.decay and self.weight_decay:
                p.mul_(member_view(decay, p).to(p.dtype))
            m.lerp_(g, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
            p.sub_((member_view(rate, p).to(p.dtype) * m) / denom)

    def member_moments(self, m: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Member m's first and second moments by parameter name (copies)."""
        return {n: (self.exp_avg[n][m].clone(), self.exp_avg_sq[n][m].clone()) for n in self.params}

    @torch.no_grad()
    def load_member_moments(self, m: int, moments: dict[str, tuple[torch.Tensor, torch.Tensor]], step_count: int) -> None:
        """Put member m's moments (as member_moments gives them) back, and the step count all members share."""
        self.step_count = step_count
        for n, (first, second) in moments.items():
            self.exp_avg[n][m].copy_(first)
            self.exp_avg_sq[n][m].copy_(second)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
