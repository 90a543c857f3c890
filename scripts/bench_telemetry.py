"""Step time of the training loop with telemetry off, at the default interval, and at every step.

The default model (conf model=small: 4 blocks, width 128; batch 32, seq 128 unless told) on the CPU, fp32.
Each variant is a real `normlab.train` run that logs every `interval` steps; a window is the
`interval` steps between two logged steps, so at the default interval each window holds exactly
one telemetry step. Windows are timed by wall clock and by this process's CPU time (the latter
is far less sensitive to other processes when torch runs one thread: `--threads 1`). The machine
may be shared: the three variants run interleaved, round after round, and every figure is a
median over all windows of all rounds.

`--isolated N` also times the Probe alone, which a loaded machine cannot hide: N training steps of
the same model and batch without the Probe and N with it watching (forward, backward, its gradient,
weight and update statistics, collect), interleaved, by process CPU time; printed are the minimum of
each and the median of the paired differences, i.e. what one telemetry step adds.

    python scripts/bench_telemetry.py [--rounds 8] [--windows 2] [--threads N] [--batch 32] [--seq 128]
                                      [--isolated 0]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from normlab.config import RunConfig, TelemetryConfig  # noqa: E402
from normlab.train.run import train  # noqa: E402

import bench  # noqa: E402  (scripts/ is on sys.path when a script of it runs)


class WindowClock(bench.WindowClock):
    """bench.py's clock sink, with the per-step times of each window between logged steps."""

    def windows(self, interval: int) -> list[tuple[float, float]]:
        """(wall, cpu) seconds per step of each window (s - interval, s], for s a positive multiple of interval."""
        out = []
        for end in sorted(s for s in self.marks if s > 0 and s % interval == 0):
            (w0, c0, _), (w1, c1, _) = self.marks[end - interval], self.marks[end]
            out.append(((w1 - w0) / interval, (c1 - c0) / interval))
        return out


def run_variant(every: int, interval: int, windows: int, workdir: str, batch: int, seq: int) -> list[tuple[float, float]]:
    cfg = RunConfig(
        batch_size=batch,
        seq_len=seq,
        max_steps=interval * windows + 1,
        eval_every=0,
        eval_batches=1,
        log_every=interval,
        device="cpu",
        precision="fp32",
        progress=False,
        telemetry=TelemetryConfig(every=every),
    )
    cfg.wandb.mode = "disabled"
    cfg.validate()
    clock = WindowClock()
    train(cfg, tempfile.mkdtemp(dir=workdir), sinks=[clock])
    return clock.windows(interval)


def probe_cost(steps: int, batch: int, seq: int) -> tuple[float, float, float]:
    """(plain, watched, added) seconds of process CPU time: the minimum plain and watched step over `steps`
    interleaved pairs, and the median of their differences."""
    from normlab.nn.model import GPT
    from normlab.train.loop import loss_fn
    from normlab.train.probe import Probe

    cfg = RunConfig(batch_size=batch, seq_len=seq, device="cpu", precision="fp32")
    cfg.validate()
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model.tok_emb.num_embeddings, (batch, seq))  # model.vocab_size null: the tokenizer's
    probe, scaler = Probe(model, every=1, max_steps=steps), torch.amp.GradScaler("cpu", enabled=False)

    def step(watched: bool) -> float:
        started = time.process_time()
        with probe.watch() if watched else contextlib.nullcontext():
            loss_fn(model(x), x).backward()
        if watched:
            probe.measure_gradients(scaler)
            probe.before_update()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if watched:
            probe.collect()
        return time.process_time() - started

    for _ in range(2):  # warm-up
        step(False), step(True)
    pairs = [(step(False), step(True)) for _ in range(steps)]
    plain, watched = [p for p, _ in pairs], [w for _, w in pairs]
    return min(plain), min(watched), statistics.median(w - p for p, w in pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds of the three interleaved variants")
    parser.add_argument("--windows", type=int, default=2, help="timed windows of `interval` steps per run")
    parser.add_argument("--every", type=int, default=TelemetryConfig().every, help="the default interval")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--isolated", type=int, default=0, help="steps of the Probe timed alone (0: none)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = {"off": 0, f"every {args.every} (default)": args.every, "every step": 1}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}

    def medians(name: str) -> tuple[float, float]:
        return statistics.median(w for w, _ in times[name]), statistics.median(c for _, c in times[name])

    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for name, every in variants.items():
                times[name] += run_variant(every, args.every, args.windows, workdir, args.batch, args.seq)
            so_far = ", ".join(f"{n} {1e3 * medians(n)[0]:.0f}/{1e3 * medians(n)[1]:.0f} ms" for n in variants)
            print(f"round {r + 1}/{args.rounds} (wall/cpu medians so far): {so_far}", file=sys.stderr, flush=True)
    base_wall, base_cpu = medians("off")
    print(
        f"default model (4 blocks, width 128, batch {args.batch} x seq {args.seq}), CPU fp32, "
        f"torch threads {torch.get_num_threads()}, "
        f"{args.rounds} rounds x {args.windows} windows of {args.every} steps"
    )
    print(f"{'telemetry':<22}{'wall/step':>12}{'overhead':>10}{'cpu/step':>12}{'overhead':>10}")
    for name in variants:
        wall, cpu = medians(name)
        print(
            f"{name:<22}{1e3 * wall:>9.1f} ms{100 * (wall / base_wall - 1):>+9.1f}%"
            f"{1e3 * cpu:>9.1f} ms{100 * (cpu / base_cpu - 1):>+9.1f}%"
        )
    if args.isolated:
        plain, watched, added = probe_cost(args.isolated, args.batch, args.seq)
        print(f"probe alone, {args.isolated} interleaved pairs, process CPU time: step min {1e3 * plain:.1f} ms, "
              f"watched step min {1e3 * watched:.1f} ms, added per telemetry step (median) {1e3 * added:.1f} ms "
              f"= {100 * added / plain:+.1f}% of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
