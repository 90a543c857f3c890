"""Packed arms against one run after another, in one process: wall time of whole runs, and step time of the
two ways to batch members (torch.func.vmap over stacked weights, which normlab uses, and hand-written grouped
weights with batched matmuls).

    python scripts/pack_bench.py                 # on the CPU: 3 lrs x 2 seeds of model=tiny, 100 steps
    python scripts/pack_bench.py --gpu           # on CUDA: the 7-lr x 3-seed grid of model=medium, 300 steps
    python scripts/pack_bench.py --lrs 1e-3,1e-2 --seeds 0 --steps 50 --model tiny [--overrides k=v ...]

1. `runs`: the grid trained as `normlab.train.run.train` runs one after another (--sequential of them: all
   on the CPU; on the GPU a sample, scaled to the grid, since 21 medium runs take minutes), then as one
   `normlab.train.pack.train_pack` pack. Both in this process with the same configs, corpus cache warm, wandb
   disabled: the figures are training and evaluation alone, without a sweep's per-job start-up, which a
   packed sweep also saves. Printed: seconds per run, the pack's seconds, and the ratio.
2. `kernels`: one training step (forward, backward) of all members, batched by vmap over
   functional_call (normlab's way) and by a hand-written grouped GPT (pre-LN LayerNorm, batched
   matmuls: torch.baddbmm/bmm, members folded into attention's batch), and unbatched (each member's
   GPT in turn), same shapes, interleaved rounds, median ms per step. The "measure both, and pick" of
   issue 14.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def grid_configs(args) -> list:
    import bench

    base = [f"model={args.model}", f"max_steps={args.steps}", "progress=false", "sinks=[jsonl]",
            f"device={'cuda' if args.gpu else 'cpu'}", *args.overrides]
    return [bench.compose([*base, f"lr={lr}", f"seed={seed}"]) for lr in args.lrs for seed in args.seeds]


def time_runs(cfgs, sequential: int, root: Path) -> tuple[float, float]:
    """Seconds per unpacked run (mean of the first `sequential` configs) and the pack's seconds."""
    from normlab.train.pack import train_pack
    from normlab.train.run import train

    started = time.perf_counter()
    for i, cfg in enumerate(cfgs[:sequential]):
        train(cfg, root / f"run{i}")
    sync()
    per_run = (time.perf_counter() - started) / sequential
    started = time.perf_counter()
    train_pack([(cfg, root / f"member{i}") for i, cfg in enumerate(cfgs)])
    sync()
    return per_run, time.perf_counter() - started


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class GroupedGPT:
    """A pre-LN LayerNorm GPT of M members written with grouped weights (M, in, out) and batched matmuls: the
    alternative to vmap that issue 14 asks to measure. Same shapes as normlab's model; not used for training."""

    def __init__(self, members: int, cfg, device: torch.device):
        m, d, v, depth = members, cfg.model.d_model, cfg.model.vocab_size or 256, cfg.depth  # null: the byte tokenizer's
        self.m, self.d, self.heads = m, d, cfg.model.n_head

        def weight(*shape, std=0.02):
            return (torch.randn(m, *shape, device=device) * std).requires_grad_()

        def zeros(*shape):
            return torch.zeros(m, *shape, device=device, requires_grad=True)

        def ones(*shape):
            return torch.ones(m, *shape, device=device, requires_grad=True)

        self.tok, self.pos = weight(v, d), weight(cfg.model.context, d)
        self.blocks = [dict(g1=ones(d), b1=zeros(d), qkv=weight(d, 3 * d), bqkv=zeros(1, 3 * d), proj=weight(d, d),
                            bproj=zeros(1, d), g2=ones(d), b2=zeros(d), fc=weight(d, 4 * d), bfc=zeros(1, 4 * d),
                            out=weight(4 * d, d), bout=zeros(1, d)) for _ in range(depth)]
        self.gf, self.bf = ones(d), zeros(d)

    def parameters(self):
        yield from (self.tok, self.pos, self.gf, self.bf)
        for block in self.blocks:
            yield from block.values()

    def _norm(self, x, g, b):
        return F.layer_norm(x, (self.d,)) * g[:, None, :] + b[:, None, :]

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        m, batch, t = idx.shape
        members = torch.arange(m, device=idx.device)[:, None, None]
        x = (self.tok[members, idx] + self.pos[:, :t][:, None]).reshape(m, batch * t, self.d)
        for p in self.blocks:
            h = torch.baddbmm(p["bqkv"], self._norm(x, p["g1"], p["b1"]), p["qkv"])
            q, k, v = (z.reshape(m * batch, t, self.heads, -1).transpose(1, 2) for z in h.split(self.d, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(m, batch * t, self.d)
            x = x + torch.baddbmm(p["bproj"], y, p["proj"])
            h = F.gelu(torch.baddbmm(p["bfc"], self._norm(x, p["g2"], p["b2"]), p["fc"]))
            x = x + torch.baddbmm(p["bout"], h, p["out"])
        logits = torch.bmm(self._norm(x, self.gf, self.bf), self.tok.transpose(1, 2))
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum") / (batch * t)


def time_kernels(cfgs, rounds: int, steps: int, device: torch.device, precision: str) -> dict[str, float]:
    """Median ms per forward+backward step of the vmap pack and the grouped GPT, interleaved rounds."""
    from normlab.train.loop import loss_fn
    from normlab.train.pack.trainer import build_pack
    from normlab.train.runtime import autocast

    pack, _ = build_pack(cfgs, device)
    grouped = GroupedGPT(len(cfgs), cfgs[0], device)
    m, cfg = len(cfgs), cfgs[0]
    idx = torch.randint(0, cfg.model.vocab_size or 256, (m, cfg.batch_size, cfg.seq_len), device=device)

    def vmap_step():
        with autocast(device, precision):
            loss = pack.losses(loss_fn, idx, idx)
        loss.sum().backward()

    def grouped_step():
        with autocast(device, precision):
            loss = grouped.loss(idx, idx)
        loss.backward()

    from normlab.nn.model import GPT

    singles = [GPT(cfg).to(device) for cfg in cfgs]

    def sequential_step():
        for i, model in enumerate(singles):
            with autocast(device, precision):
                loss = loss_fn(model(idx[i]), idx[i])
            loss.backward()

    variants = (("one after another", sequential_step), ("vmap (normlab)", vmap_step), ("grouped bmm", grouped_step))
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(rounds):
        for name, step in variants:
            step()  # warm-up of this round
            sync()
            started = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            times[name].append((time.perf_counter() - started) / steps * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="the issue's GPU grid: model=medium, 7 lrs x 3 seeds, 300 steps")
    parser.add_argument("--model", default=None)
    parser.add_argument("--lrs", default=None, help="comma-separated")
    parser.add_argument("--seeds", default=None, help="comma-separated")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--sequential", type=int, default=None, help="unpacked runs to time (default: all on the CPU, 2 on the GPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernel-steps", type=int, default=5)
    parser.add_argument("--overrides", nargs="*", default=[])
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        print("pack_bench: --gpu needs a CUDA device; none is visible")
        return 0
    args.model = args.model or ("medium" if args.gpu else "tiny")
    args.lrs = [float(v) for v in (args.lrs or ("3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1" if args.gpu else "1e-3,3e-3,1e-2")).split(",")]
    args.seeds = [int(v) for v in (args.seeds or ("0,1,2" if args.gpu else "0,1")).split(",")]
    args.steps = args.steps or (300 if args.gpu else 100)
    cfgs = grid_configs(args)
    sequential = min(len(cfgs), args.sequential or (2 if args.gpu else len(cfgs)))
    device = torch.device("cuda" if args.gpu else "cpu")
    from normlab.train.runtime import resolve_precision

    precision = resolve_precision(cfgs[0].precision, device)
    print(f"pack_bench: {len(cfgs)} runs of model={args.model} ({cfgs[0].label}), lr {args.lrs}, seeds {args.seeds}, "
          f"{args.steps} steps, {device}, {precision}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as root:
        per_run, packed = time_runs(cfgs, sequential, Path(root))
    sequential_total = per_run * len(cfgs)
    measured = "measured" if sequential == len(cfgs) else f"{sequential} measured, x{len(cfgs) / sequential:g}"
    print(f"runs: one after another {sequential_total:.2f} s ({per_run:.3f} s per run, {measured}); "
          f"packed {packed:.2f} s; packed is {sequential_total / packed:.2f}x faster")
    kernels = time_kernels(cfgs, args.rounds, args.kernel_steps, device, precision)
    for name, ms in kernels.items():
        print(f"kernels: {name:17s} {ms:8.1f} ms per forward+backward of all {len(cfgs)} members")
    ratio = kernels["grouped bmm"] / kernels["vmap (normlab)"]
    print(f"kernels: grouped bmm takes {ratio:.2f}x the time of vmap; one after another "
          f"{kernels['one after another'] / kernels['vmap (normlab)']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
