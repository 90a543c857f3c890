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

from normlab.config import NORM_TRAITS, NormConfig, norm_traits
from normlab.nn.batch_stats import global_batch_norm, grouped_batch_norm

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

    # QK-norm over the whole projection (qk_norm_axis=all): x comes in the heads' layout,
    # (B, n_head, T, head_dim), and is normalized over n_head · head_dim features per token.
    merged_heads = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.merged_heads:
            return self.normalize(x)
        B, H, T, D = x.shape
        y = self.normalize(x.transpose(1, 2).reshape(B, T, H * D))
        return y.view(B, T, H, D).transpose(1, 2)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of x over its last dimension: what each subclass defines."""
        raise NotImplementedError

    def eps_rms(self) -> float | None:
        """The input RMS below which ε, not the input, sets the norm's scale; None for a norm without ε.
        √ε where ε is added to a mean square or a variance (LayerNorm, RMSNorm, BatchNorm): an input whose
        mean square is below ε is multiplied by about 1/√ε instead of being normalized."""
        eps = getattr(self, "eps", None)
        return None if eps is None else math.sqrt(eps)


class LayerNorm(Norm):
    """y = γ ⊙ (x − μ) / sqrt(σ² + ε) + β over the last dim (Ba et al. 2016); biased variance."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True, bias: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if per_head(self.weight, self.bias):
            return affine(F.layer_norm(x.float(), (self.dim,), None, None, self.eps), self.weight, self.bias).to(x.dtype)
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

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if per_head(self.weight):
            return affine(F.rms_norm(x.float(), (self.dim,), None, self.eps), self.weight, None).to(x.dtype)
        w = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (self.dim,), w, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"


class StepStatistics:
    """Running statistics that advance once per optimizer step: the part BatchNorm and CausalBatchNorm share.

    Every training-mode forward adds the mean and unbiased variance of each of its statistic groups
    (see `BatchNorm`) to a per-step sum; `advance_running_statistics()` then moves the running
    statistics once, by `momentum`, toward the mean over all the groups the step saw, and counts one
    step in `num_batches_tracked`. Inside normlab's training loop the BatchNormSteps callback sets
    `per_step` and advances at every optimizer step, so `momentum` means the same at any grad_accum.
    Elsewhere (`per_step` false) each training forward is a step of its own, as in torch.
    The per-step sums are zero between steps, so they are not part of the state_dict.
    """

    def _init_step_statistics(self, shape: tuple[int, ...], stat_rows: int | None) -> None:
        self.stat_rows, self.per_step = stat_rows, False
        self.register_buffer("running_mean", torch.zeros(shape))
        self.register_buffer("running_var", torch.ones(shape))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self.register_buffer("step_mean_sum", torch.zeros(shape), persistent=False)
        self.register_buffer("step_var_sum", torch.zeros(shape), persistent=False)
        self.register_buffer("step_groups", torch.zeros((*shape[:-1], 1)), persistent=False)

    def groups(self, batch: int) -> int:
        """How many statistic groups a micro-batch of `batch` sequences splits into (1 for stat_rows=None)."""
        if self.stat_rows is None:
            return 1
        if batch % self.stat_rows:
            raise ValueError(f"a micro-batch of {batch} sequences does not split into groups of stat_rows={self.stat_rows}")
        return batch // self.stat_rows

    @torch.no_grad()
    def _observe(self, mean: torch.Tensor, var: torch.Tensor, positions: int | None = None) -> None:
        """Add groups' statistics, (groups, *shape) or (groups, positions, d), to the step's sums."""
        rows = slice(None) if positions is None else slice(0, positions)
        self.step_mean_sum[rows] += mean.sum(0)
        self.step_var_sum[rows] += var.sum(0)
        self.step_groups[rows] += mean.shape[0]
        if not self.per_step:
            self.advance_running_statistics()

    @torch.no_grad()
    def advance_running_statistics(self) -> None:
        """One momentum update toward the step's mean group statistics (rows no group saw stay); reset the sums."""
        seen = self.step_groups > 0
        count = self.step_groups.clamp(min=1)
        self.running_mean.copy_(torch.where(seen, self.running_mean.lerp(self.step_mean_sum / count, self.momentum),
                                            self.running_mean))
        self.running_var.copy_(torch.where(seen, self.running_var.lerp(self.step_var_sum / count, self.momentum),
                                           self.running_var))
        self.num_batches_tracked.add_(seen.any().long())
        for buffer in (self.step_mean_sum, self.step_var_sum, self.step_groups):
            buffer.zero_()


class BatchNorm(StepStatistics, Norm):
    """y = γ ⊙ (x − μ_B) / sqrt(σ²_B + ε) + β with statistics per feature over every
    position of a group of sequences (sequences × time); running statistics in eval mode (Ioffe & Szegedy 2015).

    A group is `stat_rows` consecutive sequences of the micro-batch ("ghost batches"), or the whole
    micro-batch when `stat_rows` is None. Running statistics: see `StepStatistics`.

    In training mode a position's output depends on every other position in its group, later tokens
    included: it is not causal. Eval mode is.

    `process_group` (None unless `distributed.wrap` sets it for norm.sync=true, which refuses
    stat_rows): in training mode the statistics are then taken over the rows of every process in the
    group, exactly as one process holding the whole micro-batch would take them, gradients included.
    """

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float = 0.1, weight: bool = True, bias: bool = True,
                 stat_rows: int | None = None):
        super().__init__()
        self.dim, self.eps, self.momentum = dim, eps, momentum
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self._init_step_statistics((dim,), stat_rows)
        self.process_group = None

    @classmethod
    def from_config(cls, cfg: NormConfig, dim: int, role: str, positions: int | None) -> Norm:
        """BatchNorm, or with norm.causal=true CausalBatchNorm over `positions` positions (the model's context)."""
        if not cfg.causal:
            return cls(dim, cfg.eps, cfg.momentum, cfg.weight, cfg.bias, cfg.stat_rows)
        if positions is None:
            raise ValueError("causal BatchNorm keeps statistics per position: build_norm needs `positions`")
        return CausalBatchNorm(dim, positions, cfg.eps, cfg.momentum, cfg.weight, cfg.bias, cfg.stat_rows)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.dim).float()
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        if not self.training:
            y = F.batch_norm(flat, self.running_mean, self.running_var, w, b, False, 0.0, self.eps)
        elif self.process_group is not None:
            y, mean, var = global_batch_norm(flat, w, b, self.eps, self.process_group)
            self._observe(mean[None], var[None])
        else:
            y, mean, var = grouped_batch_norm(flat, self.groups(x.shape[0]), w, b, self.eps)
            self._observe(mean, var)
        return y.reshape(x.shape).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}, momentum={self.momentum}, affine={self.weight is not None}, "
                f"stat_rows={self.stat_rows}")


class CausalBatchNorm(StepStatistics, Norm):
    """BatchNorm with statistics per feature *and per position*, over a group of sequences only (never across time).

    For x of shape (B, T, d), position t is normalized with the mean and biased variance of the
    group's vectors at position t (the group: `stat_rows` consecutive sequences, or all B when None),
    so its output depends on no token after t. Eval mode uses per-position running statistics
    (`positions` rows, each advanced as `StepStatistics` says, with the unbiased variance).
    """

    def __init__(self, dim: int, positions: int, eps: float = 1e-5, momentum: float = 0.1, weight: bool = True,
                 bias: bool = True, stat_rows: int | None = None):
        super().__init__()
        self.dim, self.positions, self.eps, self.momentum = dim, positions, eps, momentum
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self._init_step_statistics((positions, dim), stat_rows)
        self.process_group = None  # as BatchNorm's: set by distributed.wrap for norm.sync=true

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        if T > self.positions:
            raise ValueError(f"sequence of length {T} exceeds the {self.positions} positions CausalBatchNorm tracks")
        # One batch_norm over T·d channels, each a (position, feature) pair.
        flat = x.reshape(B, T * d).float()
        w = None if self.weight is None else self.weight.float().repeat(T)
        b = None if self.bias is None else self.bias.float().repeat(T)
        if not self.training:
            mean, var = self.running_mean[:T].reshape(-1), self.running_var[:T].reshape(-1)
            y = F.batch_norm(flat, mean, var, w, b, False, 0.0, self.eps)
        elif self.process_group is not None:
            y, mean, var = global_batch_norm(flat, w, b, self.eps, self.process_group)
            self._observe(mean.view(1, T, d), var.view(1, T, d), T)
        else:
            y, mean, var = grouped_batch_norm(flat, self.groups(B), w, b, self.eps)
            self._observe(mean.view(-1, T, d), var.view(-1, T, d), T)
        return y.reshape(x.shape).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, positions={self.positions}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.weight is not None}, stat_rows={self.stat_rows}"
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
        return cls(dim, slot_alpha(cfg, role), cfg.weight, cfg.bias)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return affine(torch.tanh(self.alpha.float() * x.float()), self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, weight={self.weight is not None}, bias={self.bias is not None}"


class Derf(Norm):
    """Dynamic erf, y = γ ⊙ erf(α x + s) + β with α and s learnable scalars (Chen et al. 2025,
    "Stronger Normalization-Free Transformers"; α and s are scalars there and in x-transformers' Derf)."""

    def __init__(self, dim: int, alpha: float = 0.5, shift: float = 0.0, weight: bool = True, bias: bool = True):
        super().__init__()
        self.dim = dim
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))
        self.shift = nn.Parameter(torch.tensor(float(shift)))
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    @classmethod
    def from_config(cls, cfg: NormConfig, dim: int, role: str, positions: int | None) -> Norm:
        """Derf with the initial α of its slot's role (DyT's knobs) and the initial shift norm.shift."""
        return cls(dim, slot_alpha(cfg, role), cfg.shift, cfg.weight, cfg.bias)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.erf(self.alpha.float() * x.float() + self.shift.float())
        return affine(y, self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, weight={self.weight is not None}, bias={self.bias is not None}"


def slot_alpha(cfg: NormConfig, role: str) -> float:
    """The initial α of a DyT or Derf in a slot of `role`: norm.alpha_attn, alpha_mlp or alpha_final."""
    return {"attn": cfg.alpha_attn, "mlp": cfg.alpha_mlp, "final": cfg.alpha_final}[role]


def per_head(*params: torch.Tensor | None) -> bool:
    """True when a parameter has a row per head (QK-norm with qk_norm_gains=head: normlab.nn.sublayers)."""
    return any(p is not None and p.dim() > 1 for p in params)


def affine(y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """y ⊙ γ + β in float32, either parameter None for none."""
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


class ScaleNorm(Norm):
    """ScaleNorm, y = g · x / max(‖x‖₂, ε) with g one learnable scalar, g₀ = sqrt(d) (Nguyen & Salazar 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (self.g.float() * F.normalize(x.float(), dim=-1, eps=self.eps)).to(x.dtype)

    def eps_rms(self) -> float:
        """ε bounds ‖x‖ = √d · RMS from below: ε/√d. Below it the output is exactly g·x/ε (L2: x/ε): the
        gain is g/ε, not the 1/√ε of a norm that adds ε to a mean square."""
        return self.eps / math.sqrt(self.dim)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class L2Norm(Norm):
    """Unit length, y = x / max(‖x‖₂, ε); no parameters."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x.float(), dim=-1, eps=self.eps).to(x.dtype)

    eps_rms = ScaleNorm.eps_rms

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


NORM_ROLES = ("attn", "mlp", "final")


def build_norm(cfg: NormConfig, dim: int, role: str = "attn", positions: int | None = None) -> nn.Module:
    """The norm module that `cfg` names, for feature size `dim`.

    `role` is the slot the norm serves: 'attn' (the attention sublayer's norms and
    QK-norm), 'mlp' or 'final'; only DyT's and Derf's initial α depend on it. `positions`
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
