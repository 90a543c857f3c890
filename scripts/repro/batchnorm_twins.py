"""BatchNorm's "the same model" claims, measured: twin runs that should agree up to fp32 rounding.

For norm=batch under the default config (linear biases on, AdamW eps 1e-8) in each placement, two pairs
of twins on a tiny model (2 blocks of width 32, batch 16 × 16 bytes, telemetry every 4 steps, one thread):
a packed member against its unpacked run (lrs 1e-3 and 1e-2), and grad_accum 1 against 4 with
norm.stat_rows=4. Prints the largest relative difference of val_loss, of the sublayer-output telemetry
(act/out_rms/*) and of every act/* and grad/* key, over the twins' rows:

    python scripts/repro/batchnorm_twins.py [--steps 12] [--placements pre post sandwich] [--text FILE]

The corpus is the standard library's (the default), or --text's file.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from normlab.config import DataConfig, ModelConfig, NormConfig, RunConfig, TelemetryConfig
from normlab.train.pack import train_pack
from normlab.train.run import train


def config(placement: str, steps: int, text: str | None, **keys) -> RunConfig:
    data = DataConfig(source="text", files=[text]) if text else DataConfig()
    cfg = RunConfig(norm=NormConfig(name="batch"), placement=placement, depth=2, data=data,
                    model=ModelConfig(d_model=32, n_head=2, context=32), batch_size=16, seq_len=16, max_steps=steps,
                    eval_every=4, eval_batches=2, log_every=1, progress=False, device="cpu", sinks=["jsonl"],
                    telemetry=TelemetryConfig(every=4))
    for key, value in keys.items():
        setattr(cfg, key, value)
    cfg.validate()
    return cfg


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def worst(pairs: list[tuple[Path, Path]], prefixes: tuple[str, ...]) -> float:
    """The largest relative difference of the keys starting with `prefixes` between each pair's rows."""
    largest = 0.0
    for a_dir, b_dir in pairs:
        for a, b in zip(rows(a_dir), rows(b_dir)):
            for key, value in a.items():
                if key.startswith(prefixes) and isinstance(value, float) and isinstance(b.get(key), float):
                    largest = max(largest, abs(value - b[key]) / max(abs(value), 1e-12))
    return largest


def twins(placement: str, steps: int, text: str | None, out: Path) -> dict[str, list[tuple[Path, Path]]]:
    """Train both pairs of twins of one placement under `out`; return {pair name: [(run dir, twin dir)]}."""
    cfgs = [config(placement, steps, text, lr=lr) for lr in (1e-3, 1e-2)]
    for i, cfg in enumerate(cfgs):
        train(cfg, out / f"{placement}-run{i}")
    train_pack([(cfg, out / f"{placement}-member{i}") for i, cfg in enumerate(cfgs)])
    for accum in (1, 4):
        cfg = config(placement, steps, text, grad_accum=accum)
        cfg.norm.stat_rows = 4
        train(cfg, out / f"{placement}-accum{accum}")
    return {
        "packed vs unpacked": [(out / f"{placement}-run{i}", out / f"{placement}-member{i}") for i in range(2)],
        "grad_accum 1 vs 4": [(out / f"{placement}-accum1", out / f"{placement}-accum4")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--placements", nargs="+", default=["pre", "post", "sandwich"])
    parser.add_argument("--text", help="a text file to train on instead of the standard library's sources")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"norm=batch, default config, {args.steps} steps: largest relative difference between twins")
    print(f"{'placement':<10} {'twins':<20} {'val_loss':>9} {'act/out_rms':>12} {'act/*, grad/*':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for placement in args.placements:
            for name, pairs in twins(placement, args.steps, args.text, Path(tmp)).items():
                figures = (worst(pairs, ("val_loss",)), worst(pairs, ("act/out_rms/",)), worst(pairs, ("act/", "grad/")))
                print(f"{placement:<10} {name:<20} {figures[0]:>9.1e} {figures[1]:>12.1e} {figures[2]:>14.1e}")


if __name__ == "__main__":
    main()
