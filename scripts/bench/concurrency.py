"""Small models sharing one GPU: aggregate training throughput of K models at once, by the ways to run them.

    python scripts/bench/concurrency.py [--ks 1,4,8] [--steps 60] [--ways streams,procs,procs-mps,...] [OVERRIDE ...]

Each model is normlab's GPT of the given overrides (default the medium preset, 8×256, batch 32 × 128, bf16) with
AdamW, trained on one fixed batch (data loading is not what this measures). The ways:
    serial        one process, the K models' eager steps one after another (the baseline: a sweep at jobs_per_gpu=1)
    streams       one process, each model's whole step (forward, backward, AdamW) captured in a CUDA graph, the K
                  graphs replayed on K CUDA streams: their kernels may overlap, and one thread launches them all
    procs         K processes, eager steps, sharing the GPU time-sliced (the launcher's workers without MPS)
    procs-mps     the same under an NVIDIA MPS daemon started for the run (normlab.launch.mps)
    procs-graphs, procs-graphs-mps   K processes, each replaying its step's CUDA graph, without and with MPS
Processes start together after their models are built and warmed up (a start file), so their start-up is not
timed. Printed: each way's aggregate tokens/s over K models and its ratio to one eager model alone. It needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# CUDA, or the CPU for a smoke run of the eager ways (NORMLAB_BENCH_DEVICE=cpu; no graphs, streams or MPS there).
DEVICE = os.environ.get("NORMLAB_BENCH_DEVICE", "cuda")
WAYS = ("serial", "streams", "procs", "procs-mps", "procs-graphs", "procs-graphs-mps")


def build(overrides: list[str], seed: int):
    """A model, its optimizer (capturable, so a graph can hold its step) and one fixed batch, on CUDA."""
    import step_speed
    from normlab.nn.model import GPT

    cfg = step_speed.compose([*overrides, f"device={DEVICE}", "precision=bf16"])
    torch.manual_seed(seed)
    model = GPT(cfg).to(DEVICE)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=DEVICE == "cuda")
    except (RuntimeError, ValueError):  # a torch without the fused kernel here
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=DEVICE == "cuda")
    x = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len), device=DEVICE)
    return model, optimizer, x, torch.roll(x, -1, 1), cfg.batch_size * cfg.seq_len


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def step(model, optimizer, x, y) -> torch.Tensor:
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    return loss


def graphed(model, optimizer, x, y):
    """The model's whole training step as a CUDA graph (warmed up on a side stream first, as capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            step(model, optimizer, x, y)
    torch.cuda.current_stream().wait_stream(side)
    optimizer.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(model, optimizer, x, y)
    return graph


def eager_runner(model, optimizer, x, y):
    def run():
        optimizer.zero_grad(set_to_none=True)
        step(model, optimizer, x, y)
    for _ in range(3):
        run()
    return run


def in_process(way: str, k: int, steps: int, overrides: list[str]) -> float:
    """Seconds for `steps` steps of each of `k` models in this process ('serial' or 'streams')."""
    built = [build(overrides, seed) for seed in range(k)]
    if way == "serial":
        runs = [eager_runner(*b[:4]) for b in built]
    else:
        graphs, streams = [graphed(*b[:4]) for b in built], [torch.cuda.Stream() for _ in built]
        runs = []
        for graph, stream in zip(graphs, streams):
            def run(graph=graph, stream=stream):
                with torch.cuda.stream(stream):
                    graph.replay()
            runs.append(run)
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        for run in runs:
            run()
    synchronize()
    return time.perf_counter() - start


def worker(args) -> int:
    """One process of the 'procs' ways: build, warm up, wait for the start file, time its steps, write them."""
    model, optimizer, x, y, _ = build(args.overrides, args.seed)
    if args.graphs:
        graph = graphed(model, optimizer, x, y)
        run = graph.replay
    else:
        run = eager_runner(model, optimizer, x, y)
    synchronize()
    Path(args.ready).touch()
    while not Path(args.go).exists():
        time.sleep(0.001)
    start = time.time()
    for _ in range(args.steps):
        run()
    synchronize()
    Path(args.result).write_text(json.dumps({"start": start, "end": time.time()}))
    return 0


def in_processes(way: str, k: int, steps: int, overrides: list[str], tmp: Path) -> float:
    """Seconds from the common start to the last of `k` worker processes' end."""
    from normlab.launch.mps import sweep_mps

    with sweep_mps(tmp / f"{way}-{k}", wanted=way.endswith("-mps")) as mps:
        if mps.line:
            print(f"  {mps.line}", flush=True)
        if way.endswith("-mps") and not mps.active:
            return float("nan")
        go, procs = tmp / f"go-{way}-{k}", []
        for i in range(k):
            cmd = [sys.executable, __file__, "--worker", "--seed", str(i), "--steps", str(steps),
                   "--ready", str(tmp / f"ready-{way}-{k}-{i}"), "--go", str(go),
                   "--result", str(tmp / f"result-{way}-{k}-{i}.json"), *(["--graphs"] if "graphs" in way else []),
                   *args_overrides(overrides)]
            procs.append(subprocess.Popen(cmd, env={**os.environ, **mps.env}))
        while not all((tmp / f"ready-{way}-{k}-{i}").exists() for i in range(k)):
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"{way} K={k}: a worker failed")
            time.sleep(0.01)
        go.touch()
        for p in procs:
            p.wait()
        results = [json.loads((tmp / f"result-{way}-{k}-{i}.json").read_text()) for i in range(k)]
    return max(r["end"] for r in results) - min(r["start"] for r in results)


def args_overrides(overrides: list[str]) -> list[str]:
    return ["--", *overrides] if overrides else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="normlab overrides (default: model=medium)")
    parser.add_argument("--ks", default="1,4,8")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--graphs", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    for name in ("ready", "go", "result"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.overrides = args.overrides or ["model=medium"]
    if args.worker:
        return worker(args)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("concurrency.py: error: needs a CUDA GPU (NORMLAB_BENCH_DEVICE=cpu: a smoke run of the eager ways)",
              file=sys.stderr)
        return 2
    tokens = build(args.overrides, 0)[4]
    one = in_process("serial", 1, args.steps, args.overrides)
    base = tokens * args.steps / one
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{' '.join(args.overrides)}, {device}: one eager model alone {base:,.0f} tokens/s "
          f"({1e3 * one / args.steps:.2f} ms/step)", flush=True)
    with tempfile.TemporaryDirectory(prefix="concurrency-") as tmp:
        for way in args.ways.split(","):
            for k in (int(v) for v in args.ks.split(",")):
                try:
                    seconds = (in_process(way, k, args.steps, args.overrides) if way in ("serial", "streams")
                               else in_processes(way, k, args.steps, args.overrides, Path(tmp)))
                except Exception as err:  # one way failing (a capture, a daemon) leaves the others' figures
                    print(f"{way:17s} K={k}: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
                    continue
                rate = k * tokens * args.steps / seconds
                print(f"{way:17s} K={k}: {rate:12,.0f} tokens/s in all, {rate / base:5.2f}x one eager model "
                      f"({1e3 * seconds / args.steps:.2f} ms per round of {k} steps)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
