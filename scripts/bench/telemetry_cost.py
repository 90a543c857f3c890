"""Telemetry's cost: step time with it off, at the default interval and at every step; the Probe's own cost; the
aten ops a telemetry step adds.

The windowed figures: the default model (conf model=small: 4 blocks, width 128; batch 32, seq 128 unless told)
on the CPU, fp32. Each variant is a real `normlab.train` run that logs every `interval` steps; a window is the
`interval` steps between two logged steps, so at the default interval each window holds exactly one telemetry
step. Windows are timed by wall clock and by this process's CPU time (the latter is far less sensitive to other
processes when torch runs one thread: `--threads 1`). The machine may be shared: the three variants run
interleaved, round after round, and every figure is a median over all windows of all rounds (`--rounds 0`:
none of them).

`--isolated N` times the Probe alone, which a loaded machine cannot hide: a real training run of the same model
(`--model`, a preset: the default model unless told) and batch with telemetry every 3 steps, each step timed by
process CPU time (from the end of the step before). A telemetry step's row may be read and written during the
step after it (normlab.train.rows), so what one telemetry step adds is taken over it and the step after it: the
median over N triples of (telemetry step + the step after it − 2 × the plain step before it); printed beside it,
the minimum plain step and the minimum of (telemetry step + the step after it − the plain step).

`--ops` counts the aten ops (a TorchDispatchMode: independent of the machine and its load) that one step of a
real training run dispatches, plain and with telemetry (the telemetry step with the step after it, less a plain
step, as for `--isolated`), for the medium preset (8 blocks, width 256, batch
32 × 128) and GPT-2 small's shape (12 blocks, width 768, 12 heads, at batch 8 × 128 so that the CPU runs it;
`--ops-shapes` picks them, `--ops-batch`, `--ops-seq` set their size): on a GPU each op is at least one kernel
launch. `--ops-stack-elements N` counts them with the Probe's stacks capped at N elements (16777216: the cap
CUDA had in docs/benchmarks/h100-2026-11-26-folded-attention.md; normlab.telemetry.sites.STACK_ELEMENTS is every
device's now).

`--isolated` and `--ops` run in fresh processes (`--processes` of them for `--isolated`, 2 by default); `--base
REF` measures them also for the package at git REF (a `git archive` of it, imported instead of this tree's),
the two alternated process after process, and prints both.

    python scripts/bench/telemetry_cost.py [--rounds 8] [--windows 2] [--threads N] [--batch 32] [--seq 128]
                                      [--isolated 0] [--model small] [--processes 2] [--ops] [--ops-shapes medium,gpt2]
                                      [--ops-batch B] [--ops-seq T] [--ops-stack-elements N] [--base REF] [--device cpu] [--precision fp32]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from normlab.config import RunConfig, TelemetryConfig  # noqa: E402
from normlab.train.callbacks import Callback  # noqa: E402
from normlab.train.run import train  # noqa: E402

import step_speed  # noqa: E402  (scripts/bench/ is on sys.path when a script of it runs)

ROOT = Path(__file__).resolve().parents[2]
# --ops: each shape's overrides and its batch × sequence (the medium preset's own; GPT-2 small's, which would be
# 32 × 1024, at a size the CPU runs in a minute).
OPS_SHAPES = {"medium": ("medium preset", ["model=medium"], (32, 128)),
              "gpt2": ("GPT-2 small's shape", ["depth=12", "model.d_model=768", "model.n_head=12", "model.context=1024"],
                       (8, 128))}


class WindowClock(step_speed.WindowClock):
    """step_speed.py's clock sink, with the per-step times of each window between logged steps."""

    def windows(self, interval: int) -> list[tuple[float, float]]:
        """(wall, cpu) seconds per step of each window (s - interval, s], for s a positive multiple of interval."""
        out = []
        for end in sorted(s for s in self.marks if s > 0 and s % interval == 0):
            (w0, c0, _), (w1, c1, _) = self.marks[end - interval], self.marks[end]
            out.append(((w1 - w0) / interval, (c1 - c0) / interval))
        return out


def run_variant(every: int, interval: int, windows: int, workdir: str, batch: int, seq: int) -> list[tuple[float, float]]:
    cfg = RunConfig(batch_size=batch, seq_len=seq, max_steps=interval * windows + 1, eval_every=0, eval_batches=1,
                    log_every=interval, device="cpu", precision="fp32", progress=False,
                    telemetry=TelemetryConfig(every=every))
    cfg.wandb.mode = "disabled"
    cfg.validate()
    clock = WindowClock()
    train(cfg, tempfile.mkdtemp(dir=workdir), sinks=[clock])
    return clock.windows(interval)


# ----------------------------------------------------------------------------- one step at a time, any version


class OpCount(TorchDispatchMode):
    """The aten ops dispatched while it is on, by op."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class StepMeter(Callback):
    """Measures each step of a run, from the end of the step before (so the callbacks' step start is in it) to
    its end: its process CPU time, or with `ops` the aten ops it dispatches, by op. It uses only what every
    version of normlab's loop has: train()'s callbacks."""

    name = "step_meter"

    def __init__(self, ops: bool):
        self.ops, self.by_step = ops, {}

    def on_train_start(self, state) -> None:
        self._start(state.step)

    def _start(self, step: int) -> None:
        self.step = step
        if self.ops:
            self.mode = OpCount()
            self.mode.__enter__()
        self.started = time.process_time()

    def on_step_end(self, state, record) -> None:
        if self.ops:
            self.mode.__exit__(None, None, None)
        self.by_step[self.step] = dict(self.mode.counts) if self.ops else time.process_time() - self.started
        self._start(state.step)

    def on_train_end(self, state, summary) -> None:
        if self.ops:
            self.mode.__exit__(None, None, None)


def metered_run(overrides: list[str], steps: int, ops: bool) -> dict:
    """A training run of `steps` steps with telemetry every 3 (steps 0, 3, 6, ...), each step measured."""
    cfg = step_speed.compose([*overrides, "telemetry.every=3", f"max_steps={steps}", "log_every=1", "eval_every=0",
                         "eval_batches=1", "progress=false", "wandb.mode=disabled", "ckpt.every=0"])
    meter = StepMeter(ops)
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, run_dir, sinks=[], callbacks=[meter])
    return meter.by_step


def measure(args) -> dict:
    """This process's figures (the package it imports: this tree's, or --base's archive)."""
    device = [f"device={args.device}", f"precision={args.precision}"]
    import normlab
    import normlab.conf

    out: dict = {"normlab": str(Path(normlab.__file__).parents[1]), "conf": normlab.conf.__file__}
    if args.isolated:
        times = metered_run([f"model={args.model}", *device, f"batch_size={args.batch}", f"seq_len={args.seq}"],
                            3 * args.isolated + 4, False)
        # (the plain step before a telemetry step, the telemetry step, the step after it)
        out["isolated"] = [(times[3 * k - 1], times[3 * k], times[3 * k + 1]) for k in range(1, args.isolated + 1)]
    if args.ops:
        if args.ops_stack_elements:  # another cap, on the CPU
            import normlab.telemetry.sites

            normlab.telemetry.sites.STACK_ELEMENTS = args.ops_stack_elements
        out["ops"] = {}
        for shape in args.ops_shapes.split(","):
            overrides, (batch, seq) = OPS_SHAPES[shape][1], ops_size(shape, args)
            counts = metered_run([*overrides, *device, f"batch_size={batch}", f"seq_len={seq}"], 6, True)
            out["ops"][shape] = {"plain": counts[2], "telemetry": counts[3], "after": counts[4]}
    return out


def ops_size(shape: str, args) -> tuple[int, int]:
    """The batch and sequence length --ops runs `shape` at: --ops-batch and --ops-seq where given."""
    batch, seq = OPS_SHAPES[shape][2]
    return args.ops_batch or batch, args.ops_seq or seq


# ----------------------------------------------------------------------------- this tree against --base


def archived(ref: str, into: str) -> str:
    """`git archive` of `ref` unpacked under `into`, its packaged config (conf/, installed as normlab.conf) placed
    where an import from `into` finds it; its commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    shutil.copytree(Path(into) / "conf", Path(into) / "normlab" / "conf")
    return commit


def measured_in(tree: str, args, ops: bool) -> dict:
    """`measure` run in a fresh process that imports normlab from `tree` (the op counts only with `ops`)."""
    flags = ["--measure", "--isolated", str(args.isolated), "--model", args.model, "--batch", str(args.batch),
             "--seq", str(args.seq),
             "--device", args.device, "--precision", args.precision, "--ops-batch", str(args.ops_batch or 0),
             "--ops-seq", str(args.ops_seq or 0), "--ops-stack-elements", str(args.ops_stack_elements), "--ops-shapes", args.ops_shapes, *(["--ops"] if ops else []),
             *(["--threads", str(args.threads)] if args.threads else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (tree, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, __file__, *flags], env=env, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["normlab"]).resolve() != Path(tree).resolve() or Path(tree).resolve() not in Path(result["conf"]).resolve().parents:
        raise RuntimeError(f"the process for {tree} imported normlab from {result['normlab']}, its config from {result['conf']}")
    return result


def print_ops(results: dict[str, dict], args) -> None:
    for shape in args.ops_shapes.split(","):
        depth, width = ("8", "256") if shape == "medium" else ("12", "768")
        size = "batch {} x seq {}".format(*ops_size(shape, args))
        print(f"\naten ops per training step, {OPS_SHAPES[shape][0]} ({depth} blocks x {width}, {size}), {args.device} "
              f"{args.precision}, eager, a plain step and what a telemetry step adds (it and the step after it, less two plain steps)"
              + (f", the Probe's stacks capped at {args.ops_stack_elements} elements:" if args.ops_stack_elements else ":"))
        print(f"{'package':<28}{'plain':>8}{'telemetry':>11}{'added':>8}{'added/plain':>13}")
        for name, result in results.items():
            plain, added = added_ops(result["ops"][shape])
            total = sum(plain.values())
            print(f"{name:<28}{total:>8}{total + sum(added.values()):>11}{sum(added.values()):>8}"
                  f"{sum(added.values()) / total:>12.3f}x")
        _, added = added_ops(results["this tree"]["ops"][shape])
        kinds = sorted((item for item in added.items() if item[1] > 0), key=lambda item: -item[1])[:12]
        print("  this tree's added ops by kind: " + ", ".join(f"{op} {n}" for op, n in kinds))


def added_ops(counts: dict[str, dict[str, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """A plain step's ops by kind, and those a telemetry step adds: it and the step after it, less two plain steps."""
    plain, kinds = counts["plain"], {*counts["plain"], *counts["telemetry"], *counts["after"]}
    return plain, {op: counts["telemetry"].get(op, 0) + counts["after"].get(op, 0) - 2 * plain.get(op, 0) for op in kinds}


def print_isolated(rounds: dict[str, list[dict]], args) -> None:
    print(f"\nprobe alone, {args.isolated} triples per process, process CPU time, model={args.model}, batch "
          f"{args.batch} x seq {args.seq}, torch threads {args.threads or torch.get_num_threads()}:")
    for name, results in rounds.items():
        for i, result in enumerate(results):
            plain = [p for p, _, _ in result["isolated"]]
            watched = [t + a - p for p, t, a in result["isolated"]]
            added = statistics.median(t + a - 2 * p for p, t, a in result["isolated"])
            print(f"{name:<28} process {i + 1}: step min {1e3 * min(plain):.1f} ms, watched step min "
                  f"{1e3 * min(watched):.1f} ms, added per telemetry step (median) {1e3 * added:.1f} ms "
                  f"= {100 * added / min(plain):+.1f}% of a step")


def compare(args) -> None:
    """--isolated and --ops for --base and this tree, in fresh processes, interleaved round after round."""
    with tempfile.TemporaryDirectory() as base_dir:
        trees = {"this tree": str(ROOT)}
        if args.base:
            trees = {f"base ({args.base}, {archived(args.base, base_dir)})": base_dir, **trees}
        rounds: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.processes if args.isolated else 1):
            for name, tree in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
                rounds[name].append(measured_in(tree, args, args.ops and r == 0))  # op counts do not vary
                print(f"measured {name}, process {r + 1}", file=sys.stderr, flush=True)
    if args.ops:
        print_ops({name: results[0] for name, results in rounds.items()}, args)
    if args.isolated:
        print_isolated(rounds, args)


def windowed(args) -> None:
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
    print(f"default model (4 blocks, width 128, batch {args.batch} x seq {args.seq}), CPU fp32, "
          f"torch threads {torch.get_num_threads()}, {args.rounds} rounds x {args.windows} windows of {args.every} steps")
    print(f"{'telemetry':<22}{'wall/step':>12}{'overhead':>10}{'cpu/step':>12}{'overhead':>10}")
    for name in variants:
        wall, cpu = medians(name)
        print(f"{name:<22}{1e3 * wall:>9.1f} ms{100 * (wall / base_wall - 1):>+9.1f}%"
              f"{1e3 * cpu:>9.1f} ms{100 * (cpu / base_cpu - 1):>+9.1f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds of the interleaved variants (0: no windows)")
    parser.add_argument("--windows", type=int, default=2, help="timed windows of `interval` steps per run")
    parser.add_argument("--every", type=int, default=TelemetryConfig().every, help="the default interval")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--isolated", type=int, default=0, help="pairs of plain and telemetry steps timed (0: none)")
    parser.add_argument("--model", default="small", help="--isolated: the model preset (default: the default model)")
    parser.add_argument("--ops", action="store_true", help="count the aten ops of a plain and a telemetry step")
    parser.add_argument("--ops-shapes", default="medium,gpt2", help=f"--ops: comma-separated, of {', '.join(OPS_SHAPES)}")
    parser.add_argument("--ops-batch", type=int, default=0, help="--ops: this batch for both shapes (0: their own)")
    parser.add_argument("--ops-seq", type=int, default=0, help="--ops: this sequence length (0: their own)")
    parser.add_argument("--ops-stack-elements", type=int, default=0,
                        help="--ops: the Probe's stack cap on the CPU (0: the CPU's own)")
    parser.add_argument("--base", default=None, help="git ref of the package to measure beside this tree")
    parser.add_argument("--processes", type=int, default=2, help="--isolated: fresh processes per package, alternated")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="--isolated and --ops: the device")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="--isolated and --ops")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one process of `compare`
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure(args)))
        return 0
    if args.rounds:
        windowed(args)
    if args.isolated or args.ops:
        compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
