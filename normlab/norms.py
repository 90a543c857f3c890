"""Normalization layers, each exactly as its paper (and torch's reference module) defines it.

Every norm acts on the last dimension of a (..., d) tensor, computes in float32
and casts back, so mixed precision never changes its arithmetic. `build_norm`
is the one factory: it builds the class that the norm's registry row
(`config.NORM_TRAITS`) names; `norm=none` gives `nn.Identity`, so every ablation
arm has the same module tree. The row also names each norm's gain parameters,
which telemetry reports.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import NORM_TRAITS, NormConfig, norm_traits

# Every Norm subclass by class name: the registry rows name their classes, build_norm finds them here.
NORM_CLASSES: dict[str, type["Norm"]] = {}


class Norm(nn.Module):
    """A normalization module that `build_norm` makes; its registry row names its class."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        NORM_CLASSES[cls.__name__] = cls

    @classmethod
    def from_config(cls, cfg: NormConfig, dim: int, role: str, positions: int | None) -> "Norm":
        """The module `cfg` asks for: by default the constructor takes the norm's knobs as keywords."""
        return cls(dim, **{knob: getattr(cfg, knob) for knob in NORM_TRAITS[cfg.name].knobs})


class LayerNorm(Norm):
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


class RMSNorm(Norm):
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


class BatchNorm(Norm):
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

    @classmethod
    def from_config(cls, cfg: NormConfig, dim: int, role: str, positions: int | None) -> Norm:
        """BatchNorm, or with norm.causal=true CausalBatchNorm over `positions` positions (the model's context)."""
        if not cfg.causal:
            return cls(dim, cfg.eps, cfg.momentum, cfg.weight, cfg.bias)
        if positions is None:
            raise ValueError("causal BatchNorm keeps statistics per position: build_norm needs `positions`")
        return CausalBatchNorm(dim, positions, cfg.eps, cfg.momentum, cfg.weight, cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.num_batches_tracked.add_(1)
        flat = x.reshape(-1, self.dim).float()
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        if self.training and self.process_group is not None:
            y = global_batch_norm(flat, self.running_mean, self.running_var, w, b, self.momentum, self.eps,
                                  self.process_group)
        else:
            y = F.batch_norm(flat, self.running_mean, self.running_var, w, b, self.training, self.momentum, self.eps)
        return y.reshape(x.shape).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, momentum={self.momentum}, affine={self.weight is not None}"


class CausalBatchNorm(Norm):
    """BatchNorm with statistics per feature *and per position*, over the batch only (never across time).

    For x of shape (B, T, d), position t is normalized with the mean and biased
    variance of the B vectors at position t, so its output depends on no token
    after t. Eval mode uses per-position running statistics (`positions` rows),
    updated as torch's BatchNorm updates its own (momentum, unbiased variance).
    """

    def __init__(
        self, dim: int, positions: int, eps: float = 1e-5, momentum: float = 0.1, weight: bool = True, bias: bool = True
    ):
        super().__init__()
        self.dim, self.positions, self.eps, self.momentum = dim, positions, eps, momentum
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.register_buffer("running_mean", torch.zeros(positions, dim))
        self.register_buffer("running_var", torch.ones(positions, dim))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self.process_group = None  # as BatchNorm's: set by distributed.wrap for norm.sync=true

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        if T > self.positions:
            raise ValueError(f"sequence of length {T} exceeds the {self.positions} positions CausalBatchNorm tracks")
        if self.training:
            self.num_batches_tracked.add_(1)
        # One fused batch_norm over T·d channels, each a (position, feature) pair; the buffer
        # rows 0..T-1 are views, so the kernel updates the running statistics in place.
        flat = x.reshape(B, T * d).float()
        w = None if self.weight is None else self.weight.float().repeat(T)
        b = None if self.bias is None else self.bias.float().repeat(T)
        mean, var = self.running_mean[:T].view(-1), self.running_var[:T].view(-1)
        if self.training and self.process_group is not None:
            y = global_batch_norm(flat, mean, var, w, b, self.momentum, self.eps, self.process_group)
        else:
            y = F.batch_norm(flat, mean, var, w, b, self.training, self.momentum, self.eps)
        return y.reshape(x.shape).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, positions={self.positions}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.weight is not None}"
        )


class DyT(Norm):
    """Dynamic Tanh, y = γ ⊙ tanh(α x) + β with α one learnable scalar (Zhu et al. 2025)."""

    def __init__(self, dim: int, alpha: float = 0.5, weight: bool = True, bias: bool = True):
        super().__init__()
        self.dim = dim
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    @classmethod
    def from_config(cls, cfg: NormConfig, dim: int, role: str, positions: int | None) -> Norm:
        """DyT with the initial α of its slot's role."""
        alpha = {"attn": cfg.alpha_attn, "mlp": cfg.alpha_mlp, "final": cfg.alpha_final}[role]
        return cls(dim, alpha, cfg.weight, cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.alpha.float() * x.float())
        if self.weight is not None:
            y = y * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, weight={self.weight is not None}, bias={self.bias is not None}"


class ScaleNorm(Norm):
    """ScaleNorm, y = g · x / max(‖x‖₂, ε) with g one learnable scalar, g₀ = sqrt(d) (Nguyen & Salazar 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.g.float() * F.normalize(x.float(), dim=-1, eps=self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class L2Norm(Norm):
    """Unit length, y = x / max(‖x‖₂, ε); no parameters."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x.float(), dim=-1, eps=self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


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


def global_batch_norm(
    flat: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    momentum: float,
    eps: float,
    group,
) -> torch.Tensor:
    """F.batch_norm's training-mode arithmetic on (rows, channels) with the sums taken over every
    rank of `group`: the result one process holding all ranks' rows would get. Updates the
    running statistics in place, as F.batch_norm does.

    Two passes (mean, then squared deviations) rather than E[x²] − μ², which loses precision
    when |μ| ≫ σ. The all-reduces carry gradients (their backward sums over ranks), so each
    rank's input gradient includes the other ranks' losses through the shared statistics.
    """
    rows = torch.full((1,), flat.shape[0], dtype=flat.dtype, device=flat.device)
    sums = _SumOverRanks.apply(torch.cat([flat.sum(0), rows]), group)
    n = sums[-1]
    mean = sums[:-1] / n
    centered = flat - mean
    var = _SumOverRanks.apply((centered * centered).sum(0), group) / n
    y = centered * torch.rsqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    with torch.no_grad():
        unbiased = var * (n / (n - 1).clamp(min=1))
        running_mean.lerp_(mean.detach(), momentum)
        running_var.lerp_(unbiased.detach(), momentum)
    return y


NORM_ROLES = ("attn", "mlp", "final")


def build_norm(cfg: NormConfig, dim: int, role: str = "attn", positions: int | None = None) -> nn.Module:
    """The norm module that `cfg` names, for feature size `dim`.

    `role` is the slot the norm serves: 'attn' (the attention sublayer's norms and
    QK-norm), 'mlp' or 'final'; only DyT's initial α depends on it. `positions`
    (the model's context) is needed by causal BatchNorm, which keeps statistics per position.
    """
    if role not in NORM_ROLES:
        raise ValueError(f"unknown norm role {role!r}: choose one of {', '.join(NORM_ROLES)}")
    classes = norm_traits(cfg.name).classes
    if not classes:
        return nn.Identity()
    return NORM_CLASSES[classes[0]].from_config(cfg, dim, role, positions)


def is_norm(module: nn.Module) -> bool:
    """True for the modules `build_norm` makes (excluding the identity)."""
    return isinstance(module, Norm)


def needs_ddp_sync(module: nn.Module) -> bool:
    """True for a norm module whose registry row says DDP must sync its statistics (BatchNorm's)."""
    return is_norm(module) and any(
        traits.ddp_sync and type(module).__name__ in traits.classes for traits in NORM_TRAITS.values()
    )
