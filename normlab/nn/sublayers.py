"""The sublayers a block wraps: causal self-attention (with its QK-norm) and the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from normlab.config import NormConfig
from normlab.nn.norms import build_norm


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, bias: bool, qk_norm: NormConfig | None = None):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        # Per-head query/key norms over head_dim, one module shared by all heads (QK-norm);
        # identities unless enabled, so the module tree never changes.
        head_dim = d_model // n_head
        self.q_norm: nn.Module = build_norm(qk_norm, head_dim, "attn") if qk_norm else nn.Identity()
        self.k_norm: nn.Module = build_norm(qk_norm, head_dim, "attn") if qk_norm else nn.Identity()

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of shape (B, n_head, T, head_dim), after any QK-norm."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        return self.q_norm(q), self.k_norm(k), v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(d_model, ratio * d_model, bias=bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(ratio * d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))
