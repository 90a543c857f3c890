# FROZEN REFERENCE: a verbatim copy of normlab/train/probe_stats.py at commit 9034483a19e1d273422b5896e68008abef312981,
# its imports of the other probe modules pointed at this package. tests/test_telemetry_golden.py compares
# the live Probe's statistics against it. Do not edit it (not even to follow a rename or a fix): it is what
# the statistics meant before issue 36 changed the Probe. A key whose definition changes on purpose keeps
# its old definition here; the golden test compares the live key against the new one, computed in the test.
"""The reductions the telemetry Probe applies to the tensors it hooks: each takes activations (or parameters) and
returns a few device scalars, so that a step's statistics reach the host in one transfer.

They are plain functions of tensors, so each can be checked against a hand computation, and every one works
unchanged under torch.func.vmap (a packed model's hooks see one member's tensors at a time).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention_stats(q: torch.Tensor, k: torch.Tensor, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest attention logit q·k/sqrt(head_dim) over causal (query, key) pairs, and per head the entropy
    (nats) of the attention distribution averaged over queries and summed over the B sequences.

    The largest logit is taken before any cap: under `softcap` c (Gemma 2) the softmax sees
    c·tanh(logit/c), whose maximum is c·tanh(max/c) (tanh is increasing), bounded by c whatever the logits'
    growth; the entropy is that of the distribution the softmax gives, after the cap. `q`, `k`:
    (B, n_head, T, head_dim), as `CausalSelfAttention.heads` returns them. Returns a scalar and an (n_head,)
    vector: sums over sequences, so that calls on consecutive chunks of a batch add up.
    """
    q, k = q.float(), k.float()
    T = q.size(-2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    scores = ((q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))).masked_fill(future, -math.inf)
    largest = scores.amax()
    if softcap:
        scores = (softcap * torch.tanh(scores / softcap)).masked_fill(future, -math.inf)  # tanh(-inf) is -1
    p = torch.softmax(scores, dim=-1)
    entropy = -torch.special.xlogy(p, p).sum(-1)  # xlogy(0, 0) = 0 for the masked keys
    return largest, entropy.mean(-1).sum(0)


def head_entropy_stats(head_sums: list[float], sequences: int) -> tuple[float, float]:
    """The mean over heads and the smallest over heads of each head's entropy, from `attention_stats`'s
    sums over `sequences` sequences."""
    per_head = [s / sequences for s in head_sums]
    return sum(per_head) / len(per_head), min(per_head)


def block_angle_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The sum over tokens of the angle, in degrees, between a token's vector in `x` and in `y` (..., d):
    arccos(x·y / (|x| |y|)), computed as 2·atan2(|x̂ − ŷ|, |x̂ + ŷ|) (x̂ = x/|x|), which stays accurate
    for the small angles of blocks near the identity, where arccos of a rounded cosine does not."""
    u = F.normalize(x.detach().float(), dim=-1)
    v = F.normalize(y.detach().float(), dim=-1)
    angle = 2 * torch.atan2(torch.linalg.vector_norm(u - v, dim=-1), torch.linalg.vector_norm(u + v, dim=-1))
    return torch.rad2deg(angle).sum()


def token_cos_sum(y: torch.Tensor) -> torch.Tensor:
    """The sum over sequences of the mean cosine similarity between the vectors of two different tokens of
    the sequence: for `y` (B, T, d), Σ_b 1/(T(T−1)) Σ_{i≠j} ŷ_bi·ŷ_bj, with Σ_{i≠j} ŷ_i·ŷ_j = |Σ_i ŷ_i|² − Σ_i |ŷ_i|²."""
    u = F.normalize(y.detach().float(), dim=-1)
    T = u.size(-2)
    pairs = u.sum(-2).square().sum(-1) - u.square().sum((-2, -1))
    return (pairs / (T * (T - 1))).sum()


def feature_square_sums(y: torch.Tensor) -> torch.Tensor:
    """The sum over tokens of each feature's square, (d,), for `y` (..., d): `feature_kurtosis`'s input."""
    y = y.detach().float()
    return y.square().reshape(-1, y.size(-1)).sum(0)


def feature_kurtosis(square_sums: list[float]) -> float:
    """He et al. (2024)'s kurtosis of the features' RMS: with s_j the RMS of feature j over the tokens,
    mean_j(s_j⁴) / mean_j(s_j²)². It is 1 when every feature has the same RMS and grows with outlier features
    (a few features far larger than the rest); it is not centred and not an excess kurtosis (a Gaussian
    stream gives about 1, not 3). `square_sums`: Σ_t y_tj² per feature (the token count cancels)."""
    m2 = sum(square_sums) / len(square_sums)
    m4 = sum(v * v for v in square_sums) / len(square_sums)
    return m4 / (m2 * m2) if m2 > 0 else math.nan


def lower_median(a: torch.Tensor) -> torch.Tensor:
    """The median over the last dimension as torch.median takes it (for an even count the lower of the two middle
    values). On CUDA it is read off a sort: torch.median's CUDA kernel also returns indices and has no
    deterministic implementation, so under deterministic=true it raises. On the CPU torch.median, faster there
    (one thread: 0.035 s against 0.27 s for 4 rows of 786k, 0.039 s against 0.14 s for 4096 rows of 768).
    Where a row holds a NaN the caller's amax is NaN, so the ratio is NaN either way."""
    return sorted_lower_median(a) if a.is_cuda else a.median(-1).values


def sorted_lower_median(a: torch.Tensor) -> torch.Tensor:
    """lower_median read off a sort, as on CUDA."""
    return a.sort(-1).values[..., (a.size(-1) - 1) // 2]


def max_median_ratios(y: torch.Tensor) -> torch.Tensor:
    """Each token's max_j |y_tj| / median_j |y_tj|, for `y` (..., d): a vector with one entry per token. The
    median is torch's: for an even d the lower of the two middle values (as in He et al.'s code)."""
    a = y.detach().float().abs().reshape(-1, y.size(-1))
    return a.amax(-1) / lower_median(a)


def max_median_sum(y: torch.Tensor) -> torch.Tensor:
    """The sum over tokens of `max_median_ratios`."""
    return max_median_ratios(y).sum()


def top_median_sum(y: torch.Tensor) -> torch.Tensor:
    """Massive activations as Sun et al. (2024) measure them, summed over the sequences of `y` (B, T, d): for
    each sequence, the largest |y| over its tokens and features / the median |y| over the same T·d values
    (torch's lower median)."""
    a = y.detach().float().abs().reshape(y.size(0), -1)
    return (a.amax(-1) / lower_median(a)).sum()


# Logits are reduced in chunks of at most this many elements, so that log Z adds little to a telemetry
# step's peak memory whatever the vocabulary (the float32 copy of a chunk, not of the whole batch's logits).
LOGZ_CHUNK = 1 << 22


def logz_sum(logits: torch.Tensor) -> torch.Tensor:
    """The sum over tokens of log Z = logsumexp_v(logit_v), the log of the softmax's partition function,
    for `logits` (..., vocab), in float32."""
    rows = logits.detach().reshape(-1, logits.size(-1))
    step = max(1, LOGZ_CHUNK // rows.size(-1))
    return sum(torch.logsumexp(chunk.float(), dim=-1).sum() for chunk in rows.split(step))


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
