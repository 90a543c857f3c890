"""Measure how much each norm lets a causal LM see the future in training mode.

For every norm (and BatchNorm's causal option) in the default 4-block, 128-wide GPT
at initialization, change every token after position t in a batch of 32 × 128 and
print the largest change of the logits at positions ≤ t, in training and in eval
mode, next to the mean |logit| at those positions in training mode. A causal model
prints exactly 0.

    python scripts/repro/future_leak.py [--placement pre] [--t 63] [--batch 32]
"""

from __future__ import annotations

import argparse

import torch

from normlab.config import NORMS, ConfigError, NormConfig, RunConfig
from normlab.nn.model import GPT


def leak(model: GPT, idx: torch.Tensor, changed: torch.Tensor, t: int, training: bool) -> float:
    """Largest |Δ logit| at positions ≤ t between the two inputs."""
    model.train(training)
    with torch.no_grad():
        return (model(idx)[:, : t + 1] - model(changed)[:, : t + 1]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placement", default="pre")
    parser.add_argument("--t", type=int, default=63)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (args.batch, args.seq), generator=gen)
    changed = idx.clone()
    changed[:, args.t + 1 :] = torch.randint(0, 256, (args.batch, args.seq - args.t - 1), generator=gen)

    print(f"placement={args.placement}, batch {args.batch} × {args.seq}, tokens after t={args.t} changed")
    print(f"{'norm':<14} {'train max|Δ|':>13} {'eval max|Δ|':>12} {'train mean|logit|':>18}")
    for name, causal in [(n, False) for n in NORMS] + [("batch", True)]:
        cfg = RunConfig(norm=NormConfig(name=name, causal=causal), placement=args.placement, seq_len=args.seq)
        try:
            cfg.validate()
        except ConfigError as err:
            print(f"{cfg.norm.label:<14} skipped: {err}")
            continue
        torch.manual_seed(0)
        model = GPT(cfg).train()
        with torch.no_grad():
            scale = model(idx)[:, : args.t + 1].abs().mean().item()  # training mode, for comparison
        train_leak = leak(model, idx, changed, args.t, training=True)
        eval_leak = leak(model, idx, changed, args.t, training=False)
        print(f"{cfg.norm.label:<14} {train_leak:>13.3e} {eval_leak:>12.3e} {scale:>18.3e}")


if __name__ == "__main__":
    main()
