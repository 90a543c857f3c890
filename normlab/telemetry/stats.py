"""The reductions the telemetry Probe applies to the tensors it sees: per token, per sequence or per head, over
the trailing dimensions, so that one call covers a stack of many blocks' tensors (a leading dimension), and the
Probe sums them over the step's batch.

They are plain functions of tensors, so each can be checked against a hand computation, and every one works
unchanged under torch.func.vmap (a packed model's forward sees one member's tensors at a time). They run under
torch.no_grad() (the Probe's forward statistics): none detaches.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F


def units(x: torch.Tensor) -> torch.Tensor:
    """Each token's vector over its norm, x/|x| along the last dimension, in float32."""
    return F.normalize(x.float(), dim=-1)


def token_angles(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The angle in degrees between a token's unit vector in `u` and in `v` (..., d), one per token (...):
    arccos(u·v), computed as 2·atan2(|u − v|, |u + v|), which stays accurate for the small angles of blocks
    near the identity, where arccos of a rounded cosine does not."""
    angle = 2 * torch.atan2(torch.linalg.vector_norm(u - v, dim=-1), torch.linalg.vector_norm(u + v, dim=-1))
    return torch.rad2deg(angle)


def token_cos(u: torch.Tensor) -> torch.Tensor:
    """Per sequence of unit vectors `u` (..., T, d), T > 1, the mean cosine similarity between the vectors of two
    different tokens: 1/(T(T−1)) Σ_{i≠j} u_i·u_j, with Σ_{i≠j} u_i·u_j = |Σ_i u_i|² − Σ_i |u_i|². Shape (...)."""
    T = u.size(-2)
    # Σ_i |u_i|² as a norm: no tensor of u's size is made (T up to rounding, 0 for a token of norm 0).
    pairs = u.sum(-2).square().sum(-1) - torch.linalg.vector_norm(u, dim=(-2, -1)).square()
    return pairs / (T * (T - 1))


def feature_kurtosis(square_sums: list[float]) -> float:
    """He et al. (2024)'s kurtosis of the features' RMS: with s_j the RMS of feature j over the tokens,
    mean_j(s_j⁴) / mean_j(s_j²)². It is 1 when every feature has the same RMS and grows with outlier features
    (a few features far larger than the rest); it is not centred and not an excess kurtosis (a Gaussian
    stream gives about 1, not 3). Their code logs d/(d−1)·(K−1) of the stream centred per token instead
    (docs/telemetry.md). `square_sums`: Σ_t y_tj² per feature (the token count cancels)."""
    m2 = sum(square_sums) / len(square_sums)
    m4 = sum(map(operator.mul, square_sums, square_sums)) / len(square_sums)  # the products summed in C, in order
    return m4 / (m2 * m2) if m2 > 0 else math.nan


def lower_median(a: torch.Tensor, short_rows: bool = False) -> torch.Tensor:
    """The median over the last dimension as torch.median takes it (for an even count the lower of the two middle
    values). On the CPU torch.median, the fastest there (one thread: 0.035 s against 0.27 s for a sort of 4 rows of
    786k, 0.039 s against 0.14 s for 4096 rows of 768). Not torch.median on CUDA: its kernel also returns indices and
    has no deterministic implementation, so under deterministic=true it raises. There, rows `short_rows` (a token's
    features: thousands of rows of at most a few thousand values) are reduced by torch.kthvalue, a selection per row,
    one kernel where a sort takes two; long rows (a sequence's T·d values, few of them) by a sort, which spreads each
    row over the whole device where a selection runs each on one multiprocessor. Under deterministic=true a sort
    throughout: torch's CUDA kthvalue refuses deterministic mode in some of the versions normlab supports. Every way
    takes the same element, so the values are equal. Where a row holds a NaN the caller's amax is NaN, so the ratio is NaN either way."""
    if not a.is_cuda:
        return a.median(-1).values
    if short_rows and not torch.are_deterministic_algorithms_enabled():
        return selected_lower_median(a)
    return sorted_lower_median(a)


def selected_lower_median(a: torch.Tensor) -> torch.Tensor:
    """lower_median by selection, as on CUDA for short rows: the ((n − 1) // 2 + 1)-th smallest of n."""
    return a.kthvalue((a.size(-1) - 1) // 2 + 1, -1).values


def sorted_lower_median(a: torch.Tensor) -> torch.Tensor:
    """lower_median read off a sort, as on CUDA for long rows."""
    return a.sort(-1).values[..., (a.size(-1) - 1) // 2]


def max_median_ratios(y: torch.Tensor) -> torch.Tensor:
    """Each token's max_j |c_j| / median_j |c_j|, c_j = y_j − mean_j y_j (the token centred over its d features),
    for `y` (..., d): one entry per token (...). As He et al.'s code takes it: centred, and torch's median (for
    an even d the lower of the two middle values)."""
    y = y.float()
    magnitudes = (y - y.mean(-1, keepdim=True)).abs_()  # in place: a fresh tensor
    return magnitudes.amax(-1) / lower_median(magnitudes, short_rows=True)


def top_median_ratios(y: torch.Tensor) -> torch.Tensor:
    """Massive activations as Sun et al. (2024) measure them, for `y` (..., T, d): per sequence, the
    largest |y| over its tokens and features / the median |y| over the same T·d values (torch's lower median).
    Shape (...): their mean over the sequences is act/top_median, their largest act/top_median_max."""
    flat = y.float().abs().flatten(-2)
    return flat.amax(-1) / lower_median(flat)


def attention_stats(q: torch.Tensor, k: torch.Tensor, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest attention logit q·k/sqrt(head_dim) over causal (query, key) pairs, and per head the entropy
    (nats) of the attention distribution averaged over queries and summed over the B sequences.

    The largest logit is taken before any cap: under `softcap` c (Gemma 2) the softmax sees
    c·tanh(logit/c), whose maximum is c·tanh(max/c) (tanh is increasing), bounded by c whatever the logits'
    growth; the entropy is that of the distribution the softmax gives, after the cap. `q`, `k`:
    (..., B, n_head, T, head_dim), as `CausalSelfAttention.heads` returns them (with any leading dimensions).
    Returns (...) and (..., n_head): sums over sequences, so that calls on consecutive chunks of a batch add up.
    """
    q, k = q.float(), k.float()
    T = q.size(-2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    with torch.autocast(q.device.type, enabled=False):  # float32 logits: a bf16 autocast would round the matmul's
        scores = ((q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))).masked_fill_(future, -math.inf)  # in place
    largest = scores.flatten(-4).amax(-1)
    if softcap:
        scores = (softcap * torch.tanh(scores / softcap)).masked_fill_(future, -math.inf)  # tanh(-inf) is -1
    p = torch.softmax(scores, dim=-1)
    entropy = -torch.special.xlogy(p, p).sum(-1)  # xlogy(0, 0) = 0 for the masked keys
    return largest, entropy.mean(-1).sum(-2)


def head_entropy_stats(head_sums: list[float], sequences: int) -> tuple[float, float]:
    """The mean over heads and the smallest over heads of each head's entropy, from `attention_stats`'s
    sums over `sequences` sequences."""
    per_head = [s / sequences for s in head_sums]
    return sum(per_head) / len(per_head), min(per_head)


# Logits are reduced in chunks of at most this many elements, so that log Z adds little to a telemetry
# step's peak memory whatever the vocabulary (the float32 copy of a chunk, not of the whole batch's logits).
LOGZ_CHUNK = 1 << 22


def logz_sum(logits: torch.Tensor) -> torch.Tensor:
    """The sum over tokens of log Z = logsumexp_v(logit_v), the log of the softmax's partition function,
    for `logits` (..., vocab), in float32."""
    rows = logits.reshape(-1, logits.size(-1))
    step = max(1, LOGZ_CHUNK // rows.size(-1))
    return sum(torch.logsumexp(chunk.float(), dim=-1).sum() for chunk in rows.split(step))


def max_abs(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max |x| over the trailing dimensions `dims` of `x`, in float32: max(max x, −min x), both from one pass over x
    (torch.aminmax). Not vector_norm(ord=inf): on the CPU it is ~20x slower than a max and a min."""
    if tuple(dims) != tuple(range(x.dim() - len(dims), x.dim())):
        raise ValueError(f"max_abs reduces trailing dimensions, not {dims} of a {x.dim()}-d tensor")
    low, high = torch.aminmax(x.flatten(x.dim() - len(dims)) if len(dims) > 1 else x, dim=-1)
    return torch.maximum(high, -low).float()


def l2_norms(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """The L2 norm of each tensor (None: 0) as one float32 vector, computed by fused multi-tensor
    reductions (torch._foreach_norm, one per dtype): a few kernels for all of them instead of one or more each.
    Under torch.no_grad(): nothing is detached."""
    present = [t for t in tensors if t is not None]
    if not present:
        return torch.zeros(len(tensors))
    norms: dict[int, torch.Tensor] = {}
    for dtype in dict.fromkeys(t.dtype for t in present):  # the fused kernels take one dtype at a time
        indices = [i for i, t in enumerate(tensors) if t is not None and t.dtype == dtype]
        norms.update(zip(indices, torch._foreach_norm([tensors[i] for i in indices], 2, dtype=torch.float32)))
    if len(norms) == len(tensors):
        return torch.stack([norms[i] for i in range(len(tensors))])
    zero = torch.zeros((), device=present[0].device)
    return torch.stack([norms.get(i, zero) for i in range(len(tensors))])
