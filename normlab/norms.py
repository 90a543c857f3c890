"""Normalization layers, each exactly as its paper (and torch's reference module) defines it.

Every norm acts on the last dimension of a (..., d) tensor, computes in float32
and casts back, so mixed precision never changes its arithmetic. `build_norm`
is the one factory; `norm=none` gives `nn.Identity`, so every ablation arm has
the same module tree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import NormConfig


class LayerNorm(nn.Module):
    """y = γ ⊙ (x − μ) / sqrt(σ² + ε) + β over the last dim (Ba et al. 2016); biased variance."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True, bias: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (self.dim,), w, b, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """y = w ⊙ x / sqrt(mean(x²) + ε) (Zhang & Sennrich 2019), ε inside the root as in torch.nn.RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (self.dim,), w, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"


class BatchNorm(nn.Module):
    """y = γ ⊙ (x − μ_B) / sqrt(σ²_B + ε) + β with statistics per feature over every
    position of the batch (batch × time); running statistics in eval mode (Ioffe & Szegedy 2015).

    In training mode a position's output depends on every other position in the
    batch, later tokens included: it is not causal. Eval mode is.

    `process_group` (None unless `distributed.wrap` sets it for norm.sync=true): in training mode
    the statistics are then taken over the rows of every process in the group, exactly as one
    process holding the whole batch would take them, gradients included.
    """

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float = 0.1, weight: bool = True, bias: bool = True):
        super().__init__()
        self.dim, self.eps, self.momentum = dim, eps, momentum
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self.process_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.num_batches_tracked.add_(1)
        flat = x.reshape(-1, self.dim).float()
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        if self.training and self.process_group is not None:
            y = self._global_batch_norm(flat, w, b)
        else:
            y = F.batch_norm(flat, self.running_mean, self.running_var, w, b, self.training, self.momentum, self.eps)
        return y.reshape(x.shape).to(x.dtype)

    def _global_batch_norm(self, flat: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        """F.batch_norm's training-mode arithmetic with the sums taken over all ranks.

        Two passes (mean, then squared deviations) rather than E[x²] − μ², which loses precision
        when |μ| ≫ σ. The all-reduces carry gradients (their backward sums over ranks), so each
        rank's input gradient includes the other ranks' losses through the shared statistics.
        """
        rows = torch.full((1,), flat.shape[0], dtype=flat.dtype, device=flat.device)
        sums = _SumOverRanks.apply(torch.cat([flat.sum(0), rows]), self.process_group)
        n = sums[-1]
        mean = sums[:-1] / n
        centered = flat - mean
        var = _SumOverRanks.apply((centered * centered).sum(0), self.process_group) / n
        y = centered * torch.rsqrt(var + self.eps)
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        with torch.no_grad():
            unbiased = var * (n / (n - 1).clamp(min=1))
            self.running_mean.lerp_(mean.detach(), self.momentum)
            self.running_var.lerp_(unbiased.detach(), self.momentum)
        return y

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, momentum={self.momentum}, affine={self.weight is not None}"


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) that carries gradients: every rank's loss depends on the sum, so the gradient
    reaching one rank's summand is the sum of every rank's gradient of the sum."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def build_norm(cfg: NormConfig, dim: int) -> nn.Module:
    """The norm module that `cfg` names, for feature size `dim`."""
    if cfg.name == "none":
        return nn.Identity()
    if cfg.name == "layer":
        return LayerNorm(dim, cfg.eps, cfg.weight, cfg.bias)
    if cfg.name == "rms":
        return RMSNorm(dim, cfg.eps, cfg.weight)
    if cfg.name == "batch":
        return BatchNorm(dim, cfg.eps, cfg.momentum, cfg.weight, cfg.bias)
    raise ValueError(f"unknown norm {cfg.name!r}")


def is_norm(module: nn.Module) -> bool:
    """True for the modules `build_norm` makes (excluding the identity)."""
    return isinstance(module, (LayerNorm, RMSNorm, BatchNorm))
