"""Batches: random training windows, fixed held-out batches, and loss per UTF-8 byte (bits per byte)."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch

from normlab.data.shards import TokenShards


def target_bytes(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], token_bytes: torch.Tensor) -> tuple[int, int]:
    """(tokens, UTF-8 bytes) of all the targets `y` of `batches`: the denominators of a loss per token and per byte."""
    n_tokens = n_bytes = 0
    for _, y in batches:
        n_tokens += y.numel()
        n_bytes += int(token_bytes[y.reshape(-1).long()].sum())
    return n_tokens, n_bytes


def bits_per_byte(mean_nats_per_token: float, n_tokens: int, n_bytes: int) -> float:
    """A mean loss in nats per token as bits per UTF-8 byte of the same text: total nats / (bytes · ln 2).

    Under the byte tokenizer n_tokens == n_bytes, so it is the loss divided by ln 2.
    """
    return mean_nats_per_token * n_tokens / (n_bytes * math.log(2))


def sample_batch(
    tokens: TokenShards | torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw `batch_size` random windows: x = tokens[s : s+seq_len], y = tokens[s+1 : s+seq_len+1].

    `tokens` is a split's stream of ids (its shards, or one tensor); a window may run across shards. Starts are
    `torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)`, so the same generator
    state gives the same batch, however the stream is sharded. Returns contiguous int64 CPU tensors of shape
    (batch_size, seq_len). Raises DataError if `tokens` is not longer than `seq_len`.
    """
    return TokenShards.of(tokens).sample(batch_size, seq_len, generator)


def eval_batches(
    val: TokenShards | torch.Tensor, n_batches: int, batch_size: int, seq_len: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of `n_batches` held-out (x, y) batches, drawn from a private generator seeded with `seed`.

    The same arguments give the same batches in every run and every arm of a
    sweep, and the global torch RNG is left untouched.
    """
    generator = torch.Generator().manual_seed(seed)
    return [sample_batch(val, batch_size, seq_len, generator) for _ in range(n_batches)]


def replaced_bytes(corrections: np.ndarray, n_val: int, n_batches: int, batch_size: int, seq_len: int,
                   seed: int = 1234) -> int:
    """The bytes to add to `target_bytes` of `eval_batches(val, n_batches, batch_size, seq_len, seed)` (val of
    `n_val` ids) so that it counts the text's own bytes: `corrections` holds [position in val, bytes to add] of
    each token that holds a U+FFFD read for bytes that are not UTF-8 (normlab.data.prepare), sorted by position."""
    if not len(corrections):
        return 0
    positions, cumulative = corrections[:, 0], np.concatenate([[0], np.cumsum(corrections[:, 1])])
    generator, total = torch.Generator().manual_seed(seed), 0
    for _ in range(n_batches):
        starts = TokenShards.draw(n_val, batch_size, seq_len, generator)
        # a window starting at s has the targets s + 1 ... s + seq_len
        low = np.searchsorted(positions, starts + 1, side="left")
        high = np.searchsorted(positions, starts + seq_len, side="right")
        total += int((cumulative[high] - cumulative[low]).sum())
    return total
