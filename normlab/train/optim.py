"""The optimizer's settings: the learning-rate schedule (warmup, then cosine decay) and AdamW's
weight-decay groups."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from normlab.config import RunConfig


def lr_at(step: int, cfg: RunConfig) -> float:
    """The learning rate of the update taken at step `step` (0-based; the run takes steps 0 … max_steps − 1).

    Warmup: lr·(step + 1)/W for step < W = optim.warmup_steps, so step W − 1 already takes the peak lr.
    Then cosine decay over the N − W steps from W to N = max_steps: with progress p = (step − W)/(N − W),
    floor + (lr − floor)·(1 + cos(πp))/2, floor = optim.min_lr_ratio·lr. Convention: p = 1, the floor
    itself, falls on step N, where no update is taken; the last update (step N − 1) is taken at
    floor + (lr − floor)·(1 − cos(π/(N − W)))/2 ≈ floor + (lr − floor)·π²/(4(N − W)²), just above it.
    """
    warmup = cfg.optim.warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    floor = cfg.lr * cfg.optim.min_lr_ratio
    progress = min(1.0, (step - warmup) / max(1, cfg.max_steps - warmup))
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrix weights of linear layers only; never on norm gains, biases or embeddings."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue  # the tied head shares the embedding's weight
            seen.add(id(p))
            (decay if isinstance(module, nn.Linear) and p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
