"""Training throughput of each norm in the default 4-block, 128-wide GPT (fp32, CPU or GPU).

Times forward + backward + AdamW steps on random tokens (batch 32 × 128 unless told) after a
few warm-up steps, and prints tokens per second per norm. On a shared machine
run it more than once: the spread between runs is the noise.

    python scripts/bench/norm_throughput.py [--placement pre] [--steps 10] [--qk-norm] [--batch 32] [--seq 128]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from normlab.config import NORMS, ConfigError, NormConfig, RunConfig
from normlab.nn.model import GPT


def tokens_per_s(cfg: RunConfig, steps: int, warmup: int = 3) -> float:
    torch.manual_seed(0)
    model = GPT(cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
    elapsed = 0.0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            elapsed += time.perf_counter() - t0
    return steps * cfg.batch_size * cfg.seq_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placement", default="pre")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--qk-norm", action="store_true")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    args = parser.parse_args()
    print(f"placement={args.placement} qk_norm={args.qk_norm}, batch {args.batch} × {args.seq}, fp32, "
          f"{torch.get_num_threads()} threads")
    for name, causal in [(n, False) for n in NORMS] + [("batch", True)]:
        cfg = RunConfig(norm=NormConfig(name=name, causal=causal), placement=args.placement, qk_norm=args.qk_norm,
                        batch_size=args.batch, seq_len=args.seq)
        try:
            cfg.validate()
        except ConfigError as err:
            print(f"{cfg.norm.label:<14} skipped: {err}")
            continue
        print(f"{cfg.norm.label:<14} {tokens_per_s(cfg, args.steps):>9.0f} tokens/s")


if __name__ == "__main__":
    main()
