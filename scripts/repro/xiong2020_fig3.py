"""Xiong et al. 2020's Figure 3 trend, measured: the FFN's gradient norm in the last layer against the first,
at initialization, for Pre-LN and Post-LN at several widths, over seeds.

For each width it runs the xiong2020 preset (12 blocks, LayerNorm, Xavier init, token embeddings × sqrt(d),
no clipping) for one step at every seed, Pre-LN and Post-LN (`normlab train -m`, telemetry at step 0),
then reads step 0's `grad/norm/LXX/mlp` from each run's metrics.jsonl and prints, per width and
placement, the ratio last layer / first layer of the seed-mean, and the per-seed ratios' min and max.

usage: python scripts/repro/xiong2020_fig3.py [--widths 64 128 256] [--seeds 8] [--out DIR] [--reuse] [overrides...]
       (--reuse: read the sweeps already under --out instead of running them)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MLP_GRAD = re.compile(r"^grad/norm/L(\d+)/mlp$")
NAMES = {"post": "Post-LN", "pre": "Pre-LN"}


def sweep_command(width: int, seeds: int, sweep_dir: Path, overrides: list[str]) -> list[str]:
    """The init-only sweep at one width: both placements, one step per seed, step 0 telemetered."""
    return [
        sys.executable, "-m", "normlab", "train", "-m", "experiment=xiong2020", f"model.d_model={width}", f"hydra.sweep.dir={sweep_dir}",
        "max_steps=1", "optim.warmup_steps=0", "eval_every=0", "eval_batches=1", "progress=false", "sinks=[jsonl]",
        "seed=" + ",".join(str(s) for s in range(seeds)), *overrides,
    ]


def step0_mlp_grads(sweep_dir: Path) -> dict[str, np.ndarray]:
    """Per placement, an array (seeds × layers) of step 0's grad/norm/LXX/mlp, seeds in order."""
    found: dict[str, list[tuple[int, list[float]]]] = {}
    for summary in sorted(sweep_dir.rglob("summary.json")):
        run = summary.parent
        cfg = json.loads((run / "config.json").read_text())
        step0 = next(
            r for line in (run / "metrics.jsonl").read_text().splitlines() if (r := json.loads(line)).get("step") == 0
        )
        layers = sorted((int(m.group(1)), v) for k, v in step0.items() if (m := MLP_GRAD.match(k)))
        found.setdefault(cfg["placement"], []).append((cfg["seed"], [v for _, v in layers]))
    return {p: np.array([g for _, g in sorted(rows)]) for p, rows in found.items()}


def table(results: dict[int, dict[str, np.ndarray]]) -> str:
    """The markdown table: per width and placement, last/first of the seed-mean and the per-seed range."""
    lines = [
        "| width | placement | seeds | first layer (mean) | last layer (mean) | last / first of the means | per-seed last / first, min – max |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for width, grads in results.items():
        for placement in ("post", "pre"):
            g = grads[placement]
            mean = g.mean(axis=0)
            per_seed = g[:, -1] / g[:, 0]
            lines.append(
                f"| {width} | {NAMES[placement]} | {len(g)} | {mean[0]:.3f} | {mean[-1]:.3f} | "
                f"{mean[-1] / mean[0]:.2f} | {per_seed.min():.2f} – {per_seed.max():.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("outputs/sweeps/xiong2020_fig3"))
    parser.add_argument("--reuse", action="store_true", help="read the sweeps under --out; run nothing")
    args, overrides = parser.parse_known_args()
    started = time.time()
    results = {}
    for width in args.widths:
        sweep_dir = args.out / f"width{width}"
        if not args.reuse:
            subprocess.run(sweep_command(width, args.seeds, sweep_dir, overrides), check=True, stdout=subprocess.DEVNULL)
        results[width] = step0_mlp_grads(sweep_dir)
    print(table(results))
    print(f"\n{sum(len(g) for r in results.values() for g in r.values())} runs, {time.time() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
