"""Batch normalization's training-mode arithmetic as functions: statistics over groups of rows
("ghost batches") and over every rank of a process group. BatchNorm and CausalBatchNorm
(normlab.nn.norms) call them; they hold no state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_batch_norm(
    flat: torch.Tensor, groups: int, w: torch.Tensor | None, b: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-mode batch norm of (rows, channels) with statistics per channel over each of `groups`
    equal blocks of consecutive rows; returns the output and each group's mean and unbiased variance,
    (groups, channels), detached.

    One fused F.batch_norm over groups × channels columns: with one group, exactly F.batch_norm.
    """
    rows, channels = flat.shape
    columns = flat.view(groups, rows // groups, channels).transpose(0, 1).reshape(rows // groups, groups * channels)
    w = None if w is None else w.repeat(groups)
    b = None if b is None else b.repeat(groups)
    y = F.batch_norm(columns, None, None, w, b, True, 0.0, eps)
    y = y.view(rows // groups, groups, channels).transpose(0, 1).reshape(rows, channels)
    with torch.no_grad():
        var, mean = torch.var_mean(columns.detach(), dim=0)  # unbiased, as torch's running update uses
    return y, mean.view(groups, channels), var.view(groups, channels)


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
    flat: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """F.batch_norm's training-mode arithmetic on (rows, channels) with the sums taken over every
    rank of `group`: the result one process holding all ranks' rows would get. Returns the output
    and the global mean and unbiased variance per channel (detached), for the running statistics.

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
    unbiased = var.detach() * (n / (n - 1).clamp(min=1))
    return y, mean.detach(), unbiased
