"""Which part of a step-time gap is the model and which the loop: three loops interleaved in one process.

    python scripts/bench/step_speed_inprocess.py [OVERRIDE ...] [--rounds 6] [--windows 3] [--threads 1]

step_speed.py runs every variant in its own subprocess, which leaves a few percent of noise between
processes. Here one process, with normlab's host allocator setting applied once for all, runs in turn:

- `ref`: step_speed.py's hand-written loop with its hand-written GPT;
- `ref loop, normlab GPT`: the same loop with normlab's `GPT` in place of the reference GPT;
- `normlab`: normlab's real `train()` loop (telemetry off, wandb disabled, no progress bar).

The order alternates from round to round; each figure is the median over all timed windows. The
first two differ only by the model, the last two only by the loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import step_speed  # scripts/bench/ is on sys.path when a script of it runs

VARIANTS = ["ref", "ref loop, normlab GPT", "normlab"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="normlab Hydra overrides, e.g. precision=bf16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--windows", type=int, default=3, help="timed windows of log_every steps per loop and round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from normlab.nn.model import GPT
    from normlab.train.runtime import configure_host_allocator

    configure_host_allocator()
    overrides = [*args.overrides, "wandb.mode=disabled", "telemetry.every=0", "progress=false"]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            cfg = step_speed.compose(overrides)
            if name == "normlab":
                out = step_speed.run_normlab(cfg, args.windows)
            else:
                build = GPT if name == "ref loop, normlab GPT" else step_speed.reference_gpt
                out = step_speed.run_reference(cfg, cfg.log_every, args.windows, torch.device("cpu"), build)
            times[name] += out["step_s"]
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    print(f"in one process, {args.threads} thread(s), {args.rounds} rounds x {args.windows} windows, medians; "
          f"overrides: {' '.join(args.overrides) or '(defaults)'}")
    base = statistics.median(times["ref"])
    for name in VARIANTS:
        step = statistics.median(times[name])
        print(f"  {name:<24}{1e3 * step:>8.1f} ms/step   ref / this {base / step:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
