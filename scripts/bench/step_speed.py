"""Training-step speed of normlab next to a minimal hand-written PyTorch GPT of the same shapes.

    python scripts/bench/step_speed.py [OVERRIDE ...] [--rounds 3] [--windows 3] [--threads N] [--only NAME,...]
                            [--peak-size 1024]

OVERRIDEs are normlab's Hydra overrides (`norm=rms depth=6 batch_size=16`); the config is composed
as `normlab train` composes it. Every variant runs in a fresh subprocess (so each has its own peak
RSS and a cold start), the variants run interleaved round after round, and each figure is a median
over all timed windows of all rounds. A normlab variant is a real `normlab.train.run.train` run (the
loop with its guard, schedule, telemetry check, checkpoint cadence, metrics.jsonl and progress
bar); a window is `log_every` steps between two logged steps, and the first window (warm-up,
compilation) is not timed. The reference is a minimal GPT and loop written here: same shapes,
pre-LN, tied head, SDPA, GELU MLP, AdamW with gradient clipping, the same data windows, and the
same optimizer settings and learning-rate schedule as the normlab run.
`ref fp32 + normlab malloc` is that reference after the host allocator setting normlab's train()
makes (normlab.train.runtime.configure_host_allocator), to separate the loops from the allocator.

Printed: tokens/s; model FLOP/s and MFU, with model FLOPs per token = 6·N + 12·L·d·T (N: the
weights of the matmuls, i.e. the blocks' linear layers and the head; L blocks, width d, sequence T;
PaLM's estimate, Chowdhery et al. 2022, appendix B) against the peak matmul FLOP/s measured here
for the dtype (--peak-size: the side of the square matmul timed); peak memory (CUDA:
max_memory_allocated; CPU: the process's peak RSS); normlab's step time over the reference's;
minor page faults per step; the compile time; the cost of the loop's per-step extras; the norm's
own cost beside the RMSNorm − LayerNorm step time difference; and the load average.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from normlab.nn.flops import model_flops_per_token  # noqa: E402


def minor_faults() -> int:
    """The process's minor page faults so far: pages the OS had to map (and zero) on first touch."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ----------------------------------------------------------------------------- the reference GPT


class RefAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class RefBlock(nn.Module):
    def __init__(self, d: int, n_head: int, norm: type[nn.Module]):
        super().__init__()
        self.ln1, self.attn, self.ln2 = norm(d), RefAttention(d, n_head), norm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, context: int, d: int, n_head: int, depth: int, norm: type[nn.Module]):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(RefBlock(d, n_head, norm) for _ in range(depth))
        self.ln_f = norm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def reference_gpt(cfg) -> nn.Module:
    """The hand-written GPT at the config's shapes, with torch's LayerNorm (RMSNorm for norm=rms)."""
    norm = nn.RMSNorm if cfg.norm.name == "rms" else nn.LayerNorm
    m = cfg.model
    return RefGPT(m.vocab_size, m.context, m.d_model, m.n_head, cfg.depth, norm)


def run_reference(cfg, steps_per_window: int, windows: int, device: torch.device,
                  build=reference_gpt) -> dict[str, Any]:
    """The hand-written loop. It trains as normlab's run does (AdamW's betas, eps and weight decay, the
    clipping threshold, normlab's warmup + cosine schedule over the same max_steps), so both loops
    follow comparable trajectories: step times depend a little on the values computed (bf16 steps
    on weights still in warmup ran a few percent slower than at full lr from step 0)."""
    from normlab.data import load_corpus, sample_batch
    from normlab.train.optim import lr_at

    torch.manual_seed(cfg.seed)
    model = build(cfg).to(device)  # `build`: the model the loop trains, from the config
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=cfg.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, fused=device.type == "cuda",
    )
    cfg.max_steps = normlab_max_steps(steps_per_window, windows)  # the schedule normlab's run follows
    tokens = load_corpus(cfg.data).train
    gen = torch.Generator().manual_seed(cfg.seed)  # the windows normlab draws
    amp = cfg.precision == "bf16"
    times, cpu_times, faults = [], [], []
    t0, c0, f0 = time.perf_counter(), time.process_time(), minor_faults()
    for step in range(steps_per_window * (windows + 1)):
        x, y = sample_batch(tokens, cfg.batch_size, cfg.seq_len, gen)
        x, y = x.to(device), y.to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % steps_per_window == 0:
            loss.item()  # a host sync per window, as a loop that logs
            t1, c1, f1 = time.perf_counter(), time.process_time(), minor_faults()
            times.append((t1 - t0) / steps_per_window)
            cpu_times.append((c1 - c0) / steps_per_window)
            faults.append((f1 - f0) / steps_per_window)
            t0, c0, f0 = t1, c1, f1
    return {"step_s": times[1:], "cpu_step_s": cpu_times[1:], "faults": faults[1:]}


# ----------------------------------------------------------------------------- normlab's loop


class WindowClock:
    """A sink that notes the wall and process CPU clocks whenever the loop logs a training step."""

    def __init__(self):
        self.marks: dict[int, tuple[float, float]] = {}

    def log(self, record: dict[str, Any]) -> None:
        if "loss" in record:
            self.marks[record["step"]] = (time.perf_counter(), time.process_time(), minor_faults())

    def log_table(self, name, columns, rows) -> None:
        pass

    def log_image(self, name, png) -> None:
        pass

    def finish(self, summary, exit_code) -> None:
        pass


def normlab_max_steps(steps_per_window: int, windows: int) -> int:
    """A warm-up window, the timed windows, and two steps more: the last step (always logged, a telemetry
    step) falls outside the windows."""
    return steps_per_window * (windows + 1) + 2


def run_normlab(cfg, windows: int) -> dict[str, Any]:
    from normlab.train.sinks import MetricsFile, RunDir
    from normlab.train.run import train

    k = cfg.log_every
    cfg.max_steps = normlab_max_steps(k, windows)
    cfg.eval_every = 0  # evaluation only at the end, outside the windows
    with tempfile.TemporaryDirectory() as run_dir:
        clock = WindowClock()
        summary = train(cfg, run_dir, sinks=[MetricsFile(RunDir(run_dir)), clock])
    ends = [k * (i + 2) for i in range(windows)]  # windows (k, 2k], (2k, 3k], ...
    return {
        "step_s": [(clock.marks[e][0] - clock.marks[e - k][0]) / k for e in ends],
        "cpu_step_s": [(clock.marks[e][1] - clock.marks[e - k][1]) / k for e in ends],
        "faults": [(clock.marks[e][2] - clock.marks[e - k][2]) / k for e in ends],
        "compile_time_s": summary.get("compile_time_s"),
    }


# ----------------------------------------------------------------------------- measurements


def peak_matmul_flops(dtype: torch.dtype, device: torch.device, n: int = 1024, repeats: int = 20) -> float:
    """The best FLOP/s of an n×n @ n×n matmul in `dtype` over `repeats` timed runs."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = math.inf
    for _ in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def norm_cost(cfg, norm: str, device: torch.device, repeats: int = 50) -> float:
    """Seconds for the forward and backward of all the model's norms (2 per block and the final one),
    as normlab builds them, at the step's activation shape."""
    from normlab.config import NormConfig
    from normlab.nn.norms import build_norm

    modules = [build_norm(NormConfig(name=norm), cfg.model.d_model).to(device) for _ in range(2 * cfg.depth + 1)]
    x = torch.randn(cfg.batch_size, cfg.seq_len, cfg.model.d_model, device=device, requires_grad=True)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = sum(m(x).sum() for m in modules)
        out.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def loop_extras(cfg, step_s: float) -> list[tuple[str, float]]:
    """Seconds per step of each thing normlab's loop does that a minimal loop does not, timed alone."""
    from normlab.train import distributed
    from normlab.train.callbacks import DivergenceGuard
    from normlab.train.checkpoint import Checkpointer
    from normlab.config import TelemetryConfig
    from normlab.train.sinks import MetricsFile, RunDir
    from normlab.telemetry.probe import Probe
    from normlab.train.optim import lr_at
    from normlab.train.run import build_state

    state = build_state(cfg, torch.device("cpu"), "fp32")
    model, optimizer = state.model, state.optimizer
    guard = DivergenceGuard(cfg.diverge_factor, torch.device("cpu"))
    probe = Probe(model, TelemetryConfig().every, cfg.max_steps)
    loss = torch.tensor(5.0)
    n = 2000

    def per_call(fn, calls: int = n) -> float:
        t = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - t) / calls

    def set_lr(i):
        lr = lr_at(i, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr

    def tqdm_update():
        from tqdm.auto import tqdm

        with open(os.devnull, "w") as sink:
            bar = tqdm(total=n, file=sink)
            cost = per_call(lambda i: bar.update(1))
            bar.close()
        return cost

    with tempfile.TemporaryDirectory() as d:
        checkpointer = Checkpointer(d, cfg, wandb_run_id="x", corpus_sha256="0", world_size=1, writes=True)
        state.step = cfg.ckpt.every or 1
        t = time.perf_counter()
        checkpointer.save(state, [guard])
        save_s = time.perf_counter() - t
        metrics = MetricsFile(RunDir(d))
        record = {"step": 0, "tokens": 0, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0}
        log_s = per_call(lambda i: metrics.log({**record, "step": i}), 200)
    every = cfg.ckpt.every or cfg.max_steps
    return [
        ("divergence guard (device ops)", per_call(lambda i: guard.observe(i, loss))),
        ("lr schedule + set on groups", per_call(set_lr)),
        ("telemetry check (probe.active)", per_call(probe.active)),
        ("checkpoint cadence check", per_call(lambda i: checkpointer.due(i + 1))),
        ("distributed.any_rank (1 process)", per_call(lambda i: distributed.any_rank(False))),
        ("time.perf_counter (x2)", per_call(lambda i: (time.perf_counter(), time.perf_counter()))),
        ("tqdm update", tqdm_update()),
        (f"metrics.jsonl row / log_every={cfg.log_every}", log_s / cfg.log_every),
        (f"checkpoint save / ckpt.every={every}", save_s / every),
    ]


# ----------------------------------------------------------------------------- driver


def compose(overrides: list[str]):
    """normlab's RunConfig for `overrides`, composed from the packaged conf/ as `normlab train` does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    from normlab.config import RunConfig
    from normlab.launch.resolvers import register_resolvers

    register_resolvers()  # the packaged config uses them
    with initialize_config_module(config_module="normlab.conf", version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides)  # without the hydra node
    cfg = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    if cfg.model.vocab_size is None:  # the presets follow the tokenizer; the benchmark trains on bytes
        cfg.model.vocab_size = 256
    return cfg


VARIANTS = {
    # name: (loop, precision, compile, telemetry, norm or None for the config's)
    "ref fp32": ("ref", "fp32", False, False, None),
    "ref fp32 + normlab malloc": ("ref-malloc", "fp32", False, False, None),
    "normlab fp32": ("normlab", "fp32", False, False, None),
    "normlab fp32 telemetry": ("normlab", "fp32", False, True, None),
    "normlab fp32 compile": ("normlab", "fp32", True, False, None),
    "normlab fp32 compile telemetry": ("normlab", "fp32", True, True, None),
    "ref bf16": ("ref", "bf16", False, False, None),
    "normlab bf16": ("normlab", "bf16", False, False, None),
    "normlab bf16 compile": ("normlab", "bf16", True, False, None),
    "normlab fp32 layer": ("normlab", "fp32", False, False, "layer"),
    "normlab fp32 rms": ("normlab", "fp32", False, False, "rms"),
}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant in this (fresh) process; returns its step times, compile time and peak memory."""
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    loop, precision, compiled, telemetry, norm = VARIANTS[spec["variant"]]
    overrides = list(spec["overrides"]) + [f"precision={precision}", f"compile={str(compiled).lower()}",
                                           "wandb.mode=disabled"]
    if not telemetry:
        overrides.append("telemetry.every=0")
    if norm:
        overrides.append(f"norm={norm}")
    cfg = compose(overrides)
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    # The peak is measured in every worker, beside the variant; the report takes the best.
    result_peak = {p: peak_matmul_flops(dt, device, spec["peak_size"])
                   for p, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    if loop == "ref-malloc":  # the reference with the host allocator setting normlab's train() makes
        from normlab.train.runtime import configure_host_allocator

        configure_host_allocator()
    if loop.startswith("ref"):
        result = run_reference(cfg, cfg.log_every, spec["windows"], device)
    else:
        result = run_normlab(cfg, spec["windows"])
    if device.type == "cuda":
        result["peak_mem_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        result["peak_mem_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    result["device"] = device.type
    result["peak_flops"] = result_peak
    return result


def parse_args() -> argparse.Namespace:
    """The command line: overrides and options (and --worker, which the driver passes to its subprocesses)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="normlab Hydra overrides, e.g. norm=rms depth=6")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the interleaved variants")
    parser.add_argument("--windows", type=int, default=3, help="timed windows of log_every steps per variant and round")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--peak-size", type=int, default=1024,
                        help="side n of the n×n @ n×n matmul timed for the peak FLOP/s (smaller: a quicker, lower peak)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = compose(args.overrides)
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"step_speed.py: error: unknown variant {unknown[0]!r}: choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    results: dict[str, dict[str, list]] = {
        n: {"step_s": [], "cpu_step_s": [], "faults": [], "compile_time_s": [], "peak_mem_mib": []} for n in names
    }
    peaks = {"fp32": 0.0, "bf16": 0.0}
    loads = [os.getloadavg()[0]]
    started = time.time()
    for r in range(args.rounds):
        for name in names:
            spec = {"variant": name, "overrides": args.overrides, "windows": args.windows, "threads": args.threads,
                    "peak_size": args.peak_size}
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"step_speed.py: variant {name!r} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name]["step_s"] += out["step_s"]
            results[name]["cpu_step_s"] += out["cpu_step_s"]
            results[name]["faults"] += out["faults"]
            peaks = {p: max(peaks[p], out["peak_flops"][p]) for p in peaks}
            results[name]["peak_mem_mib"].append(out["peak_mem_mib"])
            if out.get("compile_time_s") is not None:
                results[name]["compile_time_s"].append(out["compile_time_s"])
            device = out["device"]
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds} done, {time.time() - started:.0f} s, load {loads[-1]:.2f}",
              file=sys.stderr, flush=True)

    device_t = torch.device(device)
    flops_tok = model_flops_per_token(cfg)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    step = {n: statistics.median(results[n]["step_s"]) for n in names}
    cpu = {n: statistics.median(results[n]["cpu_step_s"]) for n in names}

    print(f"normlab bench: {' '.join(args.overrides) or '(defaults)'}; device {device}, "
          f"torch {torch.__version__}, threads {args.threads or torch.get_num_threads()}")
    print(f"model: {cfg.depth} blocks, width {cfg.model.d_model}, {cfg.model.n_head} heads, seq {cfg.seq_len}, "
          f"batch {cfg.batch_size}, vocab {cfg.model.vocab_size}, norm {cfg.norm.label}, placement {cfg.placement}")
    print(f"model FLOPs/token = 6N + 12·L·d·T = {flops_tok / 1e6:.2f} MFLOP (N = matmul weights incl. head)")
    print(f"peak matmul ({args.peak_size}² @ {args.peak_size}², best of 20 in each worker, best over workers): "
          f"fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s")
    print(f"{args.rounds} rounds x {args.windows} windows of {cfg.log_every} steps, medians; "
          f"load average (1 min) {min(loads):.2f}–{max(loads):.2f}, at the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print()
    print(f"{'variant':<32}{'ms/step':>9}{'tokens/s':>10}{'GFLOP/s':>9}{'MFU':>7}{'peak MiB':>10}{'vs ref':>8}"
          f"{'cpu ms/step':>13}{'cpu vs ref':>12}{'faults/step':>13}{'compile s':>11}")
    for n in names:
        precision = VARIANTS[n][1]
        tok_s = tokens_per_step / step[n]
        ref = f"ref {precision}"
        ratio = f"{step[ref] / step[n]:.3f}" if ref in step and n != ref else ""
        cpu_ratio = f"{cpu[ref] / cpu[n]:.3f}" if ref in cpu and n != ref else ""
        compile_s = f"{statistics.median(results[n]['compile_time_s']):.1f}" if results[n]["compile_time_s"] else ""
        print(f"{n:<32}{1e3 * step[n]:>9.1f}{tok_s:>10.0f}{tok_s * flops_tok / 1e9:>9.2f}"
              f"{100 * tok_s * flops_tok / peaks[precision]:>6.1f}%{max(results[n]['peak_mem_mib']):>10.0f}"
              f"{ratio:>8}{1e3 * cpu[n]:>13.1f}{cpu_ratio:>12}{statistics.median(results[n]['faults']):>13.0f}"
              f"{compile_s:>11}")
    print("vs ref = reference step time / normlab step time (>= 1: normlab at least as fast), by wall clock and by "
          "process CPU time (less sensitive to other load with --threads 1); "
          "faults/step = minor page faults per step (fresh pages the OS maps and zeroes); "
          "compile s = the first compiled step's wall time (median over rounds; the first round compiles cold)")
    for n in names:
        if results[n]["compile_time_s"]:
            print(f"  {n}: compile time per round {', '.join(f'{c:.1f} s' for c in results[n]['compile_time_s'])}")

    base = "normlab fp32" if "normlab fp32" in step else None
    if base:
        print()
        print("per-step extras of normlab's loop, timed alone (µs per step, % of the normlab fp32 step):")
        for what, cost in loop_extras(cfg, step[base]):
            print(f"  {what:<42}{1e6 * cost:>9.1f} µs{100 * cost / step[base]:>8.3f}%")
        print("  (under DDP, distributed.any_rank is an all-reduce, asked every 10 steps and at checkpoints)")
    if "normlab fp32 layer" in step and "normlab fp32 rms" in step:
        layer, rms = norm_cost(cfg, "layer", device_t), norm_cost(cfg, "rms", device_t)
        print()
        print(f"norms ({2 * cfg.depth + 1} per model), forward + backward at ({cfg.batch_size}, {cfg.seq_len}, "
              f"{cfg.model.d_model}), fp32: LayerNorm {1e3 * layer:.2f} ms, RMSNorm {1e3 * rms:.2f} ms, "
              f"difference {1e3 * (rms - layer):+.2f} ms")
        print(f"step time rms − layer: {1e3 * (step['normlab fp32 rms'] - step['normlab fp32 layer']):+.2f} ms "
              f"(of {1e3 * step['normlab fp32 layer']:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
