"""Taps: the points where the model shows its intermediate tensors to an observer (telemetry's probe).

`GPT.forward(idx, tap)` calls `x = tap(site, x)` at each site below and goes on with the tensor the tap
returns: the tensor itself, or an identity of it that autograd sees (so that the tap observes its
gradient too). Given no tap (the default) the forward runs exactly as without this module: no call, no op.
A compiled forward with a tap traces the tap's code into its graph.

Sites of the whole model (`tap`), and of block i (`tap.block(i)`, the tap block i is given):

    embed                       token + position embedding, before the embedding norm
    norm_embed.in, .out         the embedding norm's input and output (embed_norm=true)
    norm_f.in, norm_f.out       the final norm's
    logits                      the head's output
    in, out                     (block) the residual stream entering and leaving the block
    norm1.in, norm1.out, ...    (block) a filled norm slot's input and output: norm1, norm2, norm1_out,
                                norm2_out, attn.q_norm, attn.k_norm (QK-norm)
    attn.q, attn.k              (block) queries and keys after any QK-norm, (B, n_head, T, head_dim)
    attn.out, mlp.out           (block) a sublayer's output, before any branch norm

A slot holding no norm (nn.Identity) shows nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Tap(Protocol):
    def __call__(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """Observe `x` at `site`; return what the forward goes on with (x, or an identity of it)."""

    def block(self, index: int) -> "Tap":
        """The tap that block `index` calls with its own sites."""


def tapped(module: nn.Module, name: str, x: torch.Tensor, tap: Tap | None) -> torch.Tensor:
    """module(x); with a tap, a filled norm slot `name` shows its input and output to it."""
    if tap is None or isinstance(module, nn.Identity):
        return module(x)
    return tap(f"{name}.out", module(tap(f"{name}.in", x)))
