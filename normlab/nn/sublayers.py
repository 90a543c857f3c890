"""The sublayers a block wraps: causal self-attention (with its QK-norm and logit softcap) and the MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from normlab.config import GAIN_PARAMS, RunConfig
from normlab.nn.norms import build_norm
from normlab.nn.tap import Tap, tapped


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    `shift_free` (a BatchNorm subtracts every constant the sublayer adds: normlab.nn.model.cancelled_shifts)
    builds no bias for the output projection, the values (attention passes their bias through as a
    constant) and the keys (softmax ignores theirs), whatever model.bias says; the queries keep theirs,
    as `q_bias`."""

    def __init__(self, cfg: RunConfig, shift_free: bool = False):
        super().__init__()
        d_model, bias = cfg.model.d_model, cfg.model.bias
        self.n_head = cfg.model.n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias and not shift_free)
        self.q_bias = nn.Parameter(torch.zeros(d_model)) if bias and shift_free else None
        self.proj = nn.Linear(d_model, d_model, bias=bias and not shift_free)
        # QK-norm's modules take q and k in the heads' layout; identities unless enabled, so the module
        # tree never changes.
        self.q_norm = build_qk_norm(cfg)
        self.k_norm = build_qk_norm(cfg)
        self.softcap = cfg.attn_softcap

    def heads(self, x: torch.Tensor, tap: Tap | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of shape (B, n_head, T, head_dim), after any QK-norm (shown to `tap`)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        if self.q_bias is not None:
            q = q + self.q_bias
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if tap is None:
            return self.q_norm(q), self.k_norm(k), v
        q = tap("attn.q", tapped(self.q_norm, "attn.q_norm", q, tap))
        return q, tap("attn.k", tapped(self.k_norm, "attn.k_norm", k, tap)), v

    def forward(self, x: torch.Tensor, tap: Tap | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x, tap)
        # Under autocast the projections come out in its dtype, but a query bias (shift_free) or a QK-norm can
        # promote q or k to float32. An ordinary forward's autocast casts attention's inputs back to its dtype;
        # under vmap (a pack) it does not, and attention refuses mixed dtypes. The same cast, written out.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if self.softcap is None:
            y = causal_attention(q, k, v)
        else:
            y = softcapped_attention(q, k, v, self.softcap)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention, q, k, v: (B, n_head, T, head_dim), in torch's fused kernels. Looked up by name at
    each call: a packed forward puts its own in for the duration (normlab.nn.packed.folded_attention)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cap: float) -> torch.Tensor:
    """Causal attention whose logits are capped, cap · tanh(q·k / sqrt(head_dim) / cap) (Gemma 2), written
    out: scaled_dot_product_attention takes no cap. q, k, v: (B, n_head, T, head_dim); softmax in float32."""
    T = q.size(-2)
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    logits = cap * torch.tanh(logits.float() / cap)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    weights = torch.softmax(logits.masked_fill(future, -math.inf), dim=-1)
    return weights.to(v.dtype) @ v


def build_qk_norm(cfg: RunConfig) -> nn.Module:
    """QK-norm's module for the queries (or the keys) of one attention layer; nn.Identity without QK-norm.

    It takes them in the heads' layout, (B, n_head, T, head_dim). qk_norm_axis=head normalizes each head
    over head_dim with one gain shared by the heads, or one per head with qk_norm_gains=head;
    qk_norm_axis=all normalizes each token's whole projection (n_head · head_dim features) at once.
    """
    norm_cfg = cfg.qk_norm_config()
    if norm_cfg is None:
        return nn.Identity()
    d_model, n_head = cfg.model.d_model, cfg.model.n_head
    if cfg.qk_norm_axis == "all":
        norm = build_norm(norm_cfg, d_model, "attn")
        norm.merged_heads = True
        return norm
    norm = build_norm(norm_cfg, d_model // n_head, "attn")
    if cfg.qk_norm_gains == "head":
        gains_per_head(norm, n_head)
    return norm


def gains_per_head(norm: nn.Module, n_head: int) -> None:
    """Give each head its own copy of the norm's gains and shift: a per-feature parameter (head_dim,)
    becomes (n_head, 1, head_dim), a scalar gain (n_head, 1, 1); both broadcast over (B, n_head, T, head_dim)."""
    for name in (*GAIN_PARAMS, "bias"):
        param = getattr(norm, name, None)
        if isinstance(param, nn.Parameter):
            size = param.shape[-1] if param.dim() else 1
            per_head = param.detach().reshape(1, 1, size).expand(n_head, 1, size).clone()
            setattr(norm, name, nn.Parameter(per_head))


class MLP(nn.Module):
    """fc, GELU, proj; `shift_free` as CausalSelfAttention's: no bias for proj."""

    def __init__(self, d_model: int, ratio: int, bias: bool, shift_free: bool = False):
        super().__init__()
        self.fc = nn.Linear(d_model, ratio * d_model, bias=bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(ratio * d_model, d_model, bias=bias and not shift_free)

    def forward(self, x: torch.Tensor, tap: Tap | None = None) -> torch.Tensor:
        """`tap`: shown nothing inside the MLP (its output is the block's site mlp.out)."""
        return self.proj(self.act(self.fc(x)))
