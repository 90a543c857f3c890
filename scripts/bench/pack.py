"""Packed arms against one run after another, in one process: wall time of whole runs, and step time of the
two ways to batch members (torch.func.vmap over stacked weights, which normlab uses, and hand-written grouped
weights with batched matmuls).

    python scripts/bench/pack.py                 # on the CPU: 3 lrs x 2 seeds of model=tiny, 100 steps
    python scripts/bench/pack.py --gpu           # on CUDA: the 7-lr x 3-seed grid of model=medium, 300 steps
    python scripts/bench/pack.py --lrs 1e-3,1e-2 --seeds 0 --steps 50 --model tiny [--overrides k=v ...]

1. `runs`: the grid trained as `normlab.train.run.train` runs one after another (--sequential of them: all
   on the CPU; on the GPU a sample, scaled to the grid, since 21 medium runs take minutes), then as one
   `normlab.train.pack.train_pack` pack. Both in this process with the same configs, corpus cache warm, wandb
   disabled: the figures are training and evaluation alone, without a sweep's per-job start-up, which a
   packed sweep also saves. Printed: seconds per run, the pack's seconds, and the ratio.
2. `kernels`: one training step (forward, backward) of all members, batched by vmap over
   functional_call (normlab's way) and by a hand-written grouped GPT (pre-LN LayerNorm, batched
   matmuls: torch.baddbmm/bmm, members folded into attention's batch), and unbatched (each member's
   GPT in turn), same shapes, interleaved rounds, median ms per step: which way of batching members
   is faster.
3. `attention` (--attention, alone): one forward+backward of one pack (normlab.train.pack.build_pack)
   with attention under vmap (the path before FoldedAttention: on CUDA torch's math kernel alone), folded with
   the math kernel forced, and folded with torch's choice of kernel (normlab's path): median ms per step over
   interleaved rounds, aten ops dispatched in one step, the attention kernels they include, and the largest
   relative difference of the members' losses and gradients from the vmap path's, per precision.

    python scripts/bench/pack.py --gpu --attention --lrs 1e-3,3e-3,1e-2 --seeds 0,1,2 --precisions bf16,fp32
    python scripts/bench/pack.py --attention --precisions fp32,bf16   # the same at model=tiny on the CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def grid_configs(args) -> list:
    import step_speed

    base = [f"model={args.model}", f"max_steps={args.steps}", "progress=false", "sinks=[jsonl]",
            f"device={'cuda' if args.gpu else 'cpu'}", *args.overrides]
    return [step_speed.compose([*base, f"lr={lr}", f"seed={seed}"]) for lr in args.lrs for seed in args.seeds]


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
    alternative to vmap that this script measures. Same shapes as normlab's model; not used for training."""

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


class OpCount(TorchDispatchMode):
    """The aten ops dispatched inside, and the attention kernels among them, by the dtype of their first input."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.attention: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if "attention" in func.name():
            self.attention[f"{func.name().removeprefix('aten::')} {str(args[0].dtype).removeprefix('torch.')}"] += 1
        return func(*args, **(kwargs or {}))


# (fold_attention, the kernels allowed): attention under vmap as before (math alone on CUDA, packed.attention_kernels),
# folded with the math kernel forced, folded with torch's choice
ATTENTION_PATHS = {"vmap (before)": (False, None), "folded, math forced": (True, [SDPBackend.MATH]),
                   "folded (normlab)": (True, None)}


def compare_attention(cfgs, device: torch.device, precision: str, rounds: int, steps: int) -> None:
    """Part 3 of the module's docstring, in one precision: printed, one line per path."""
    from normlab.nn.packed import attention_kernels
    from normlab.train.loop import loss_fn
    from normlab.train.pack.trainer import build_pack
    from normlab.train.runtime import autocast

    pack, _ = build_pack(cfgs, device)
    cfg = cfgs[0]
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size or 256, (len(cfgs), cfg.batch_size, cfg.seq_len + 1), device=device)
    x, y = idx[..., :-1], idx[..., 1:]

    def step(path: str) -> torch.Tensor:
        pack.fold_attention, kernels = ATTENTION_PATHS[path]
        allowed = attention_kernels(device) if not pack.fold_attention else sdpa_kernel(kernels) if kernels else nullcontext()
        for p in pack.params.values():
            p.grad = None
        with allowed, autocast(device, precision):
            losses = pack.losses(loss_fn, x, y)
        losses.sum().backward()
        return losses.detach().float()

    results = {}
    for path in ATTENTION_PATHS:
        with OpCount() as count:
            losses = step(path)
        results[path] = (losses, {n: p.grad.float() for n, p in pack.params.items()}, count)
    times = _interleaved(step, rounds, steps)
    reference_losses, reference_grads, _ = results["vmap (before)"]
    for path, (losses, grads, count) in results.items():
        loss_diff = ((losses - reference_losses).abs() / reference_losses.abs()).max().item()
        grad_diff, where = max((_relative(grads[n], g), n) for n, g in reference_grads.items())
        kernels = ", ".join(f"{name} x{n}" for name, n in sorted(count.attention.items())) or "matmuls and softmax"
        wall, cpu = (statistics.median(values) for values in zip(*times[path]))
        print(f"attention {precision}: {path:18s} {wall:8.2f} ms per forward+backward"
              + (f" ({cpu:.2f} ms process CPU time)" if device.type == "cpu" else "")
              + f", {count.ops} aten ops; largest relative difference from vmap's: loss {loss_diff:.1e}, "
              f"gradient {grad_diff:.1e} ({where}); attention: {kernels}")


def _interleaved(step, rounds: int, steps: int) -> dict[str, list[tuple[float, float]]]:
    """Per path, each round's ms per step in wall time and in process CPU time; the paths interleaved."""
    times = {path: [] for path in ATTENTION_PATHS}
    for _ in range(rounds):
        for path in ATTENTION_PATHS:
            step(path)  # warm-up of this round
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(path)
            sync()
            times[path].append(((time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3))
    return times


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in any member's slice, relative to that slice's largest value."""
    diff = (got - want).abs().reshape(got.shape[0], -1).amax(dim=1)
    return (diff / want.abs().reshape(want.shape[0], -1).amax(dim=1).clamp_min(1e-30)).max().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU acceptance's pack21 grid: model=medium, 7 lrs x 3 seeds, 300 steps")
    parser.add_argument("--model", default=None)
    parser.add_argument("--lrs", default=None, help="comma-separated")
    parser.add_argument("--seeds", default=None, help="comma-separated")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--sequential", type=int, default=None, help="unpacked runs to time (default: all on the CPU, 2 on the GPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernel-steps", type=int, default=5)
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--attention", action="store_true", help="part 3 alone: the packed attention paths compared")
    parser.add_argument("--precisions", default=None, help="comma-separated, of fp32, bf16, fp16 (--attention; "
                        "default: the config's)")
    args = parser.parse_args()
    precisions = (args.precisions or "").split(",") if args.precisions else []
    if any(p not in ("fp32", "bf16", "fp16") for p in precisions):
        print(f"pack.py: --precisions {args.precisions!r}: each must be fp32, bf16 or fp16", file=sys.stderr)
        return 2
    if args.gpu and not torch.cuda.is_available():
        print("pack.py: --gpu needs a CUDA device; none is visible")
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
    print(f"pack.py: {len(cfgs)} runs of model={args.model} ({cfgs[0].label}), lr {args.lrs}, seeds {args.seeds}, "
          f"{args.steps} steps, {device}, {precision}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.attention:
        for name in precisions or [precision]:
            compare_attention(cfgs, device, name, args.rounds, args.kernel_steps)
        return 0
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
