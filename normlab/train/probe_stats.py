"""The reductions the telemetry Probe applies to the tensors it hooks: each takes activations (or parameters) and
returns a few device scalars, so that a step's statistics reach the host in one transfer.

They are plain functions of tensors, so each can be checked against a hand computation, and every one works
unchanged under torch.func.vmap (a packed model's hooks see one member's tensors at a time).
"""

from __future__ import annotations

import math

import torch


def attention_stats(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The maximum pre-softmax logit q·k/sqrt(head_dim) over causal (query, key) pairs, and per head the
    entropy (nats) of the attention distribution averaged over queries and summed over the B sequences.

    `q`, `k`: (B, n_head, T, head_dim), as `CausalSelfAttention.heads` returns them. Returns a scalar
    and an (n_head,) vector: sums over sequences, so that calls on consecutive chunks of a batch add up.
    """
    q, k = q.float(), k.float()
    T = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, -math.inf)
    p = torch.softmax(scores, dim=-1)
    entropy = -torch.special.xlogy(p, p).sum(-1)  # xlogy(0, 0) = 0 for the masked keys
    return scores.amax(), entropy.mean(-1).sum(0)


def l2(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of all of `x`, in float32."""
    return torch.linalg.vector_norm(x.detach(), dtype=torch.float32)


def l2_norms(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """The L2 norm of each tensor (None: 0) as one float32 vector, computed by fused multi-tensor
    reductions (torch._foreach_norm): a few kernels for all the parameters instead of one or more each."""
    present = [t.detach() for t in tensors if t is not None]
    if not present:
        return torch.zeros(len(tensors))
    norms = iter(torch._foreach_norm(present))
    zero = torch.zeros((), dtype=present[0].dtype, device=present[0].device)
    return torch.stack([zero if t is None else next(norms) for t in tensors]).float()


def max_abs(x: torch.Tensor) -> torch.Tensor:
    """max |x| over all of `x`, in float32."""
    # Not vector_norm(ord=inf): on the CPU it is ~20x slower than a max and a min.
    x = x.detach()
    return torch.maximum(x.amax(), -x.amin()).float()
