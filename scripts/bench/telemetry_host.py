"""The host time a telemetry step adds, by phase: a CPU proxy of its cost on a GPU, where a small model's step is
bound by the host (dispatching ops, Python), not by the device's arithmetic.

    python scripts/bench/telemetry_host.py [--width 16] [--batch 8] [--seq 16] [--pairs 40] [--sinks jsonl,wandb]
                                     [--processes 2] [--base REF]

A real normlab run (`normlab.train.run.train`) of the medium preset's structure (8 blocks, 8 heads, its norms and
MLP) at a width (`--width`) and batch (`--batch` × `--seq`) where the arithmetic is negligible, so that every op
costs what its dispatch costs, on the CPU in bf16 (autocast, as on a GPU; `--precision`), eager or compiled (`--compile`), with one torch thread, every step logged and telemetry every 3
steps. A telemetry step's row may be completed and written during the step after it (normlab.train.rows), so
what telemetry adds is taken over the telemetry step and the step after it, against two plain steps: per triple
(the plain step before a telemetry step, the telemetry step, the step after it), (telemetry + after − 2 × plain).
The figures are medians over `--pairs` such triples, wall clock (the critical path; a writer thread's work off it
does not count) and this process's CPU time. The sinks are `--sinks` (the config's default: jsonl and wandb,
offline). The added time is cut at the loop's hooks into:

    (a) statistics   the steps' work up to the Telemetry callback's after_optimizer_step (the tapped forward and
                     its statistics, the gradient collectors, the gradient, weight and norm statistics)
    (b) row          Telemetry.after_optimizer_step (the update norms, the one copy to the host) and the
                     Python that turns the transferred values into the row of named floats, wherever it runs
                     (then, or where the row is read: Telemetry._read)
    (c) sinks        writing rows to the sinks (the loop's `emit`, or Rows' `write` and `flush` less the reads)
                     and the callbacks after it (on_step_end)
    other            the rest (the other callbacks' after_optimizer_step)

On a GPU (`--device cuda`, e.g. `--width 256 --batch 32 --seq 128`: the medium preset itself) the same split is
of the real cost, without a profiler's overhead: the host waits for the device where the step reads a value (the
loss on every logged step, the row's one transfer), so a phase's wall time is its host work or that wait.

With `--ops`, also the aten ops (a TorchDispatchMode: independent of the machine) of each phase; with `--calls`, the
Python and C function calls the host makes in each (a sys.setprofile hook on the training thread: the interpreter's
work, independent of the machine and its load, which the hook itself slows, so times taken with it are not the
figures).
`--base REF` measures the package at git REF too (a `git archive` of it, as scripts/bench/telemetry_cost.py does), the
two alternated process after process, `--processes` each.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("statistics", "row", "other", "sinks")


class Marks:
    """Clock readings at the boundaries of the phases of each step: (label, wall, cpu, aten ops so far, calls so far)."""

    def __init__(self, ops: bool, calls: bool = False):
        self.events: list[tuple[str, float, float, int, int]] = []
        self.ops, self.calls = ops, calls
        self.counted = self.called = 0
        self.current = "statistics"

    def mark(self, label: str) -> None:
        self.events.append((label, time.perf_counter(), time.process_time(), self.counted, self.called))
        self.current = label

    def count_call(self, frame, event: str, arg) -> None:
        if event in ("call", "c_call"):
            self.called += 1

    def around(self, label: str, fn):
        """`fn` with its time counted as `label`, the phase it interrupts going on after it."""

        def timed(*args, **kwargs):
            before = self.current
            self.mark(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(before)

        return timed


def instrument(marks: Marks):
    """Wrap the hooks the phases are cut at, in this process (the loop's `emit`, or its Rows where it has them)."""
    import normlab.train.loop as loop
    from normlab.train.callbacks import Telemetry

    collect, emit = Telemetry.after_optimizer_step, loop.emit

    def timed_collect(self, state, record):
        marks.mark("row")
        collect(self, state, record)
        marks.mark("other")

    def timed_emit(sinks, record):
        marks.mark("sinks")
        emit(sinks, record)

    Telemetry.after_optimizer_step, loop.emit = timed_collect, timed_emit
    try:
        from normlab.train.rows import Rows
    except ImportError:  # a package whose rows go straight to the sinks
        return
    Rows.write, Rows.flush = marks.around("sinks", Rows.write), marks.around("sinks", Rows.flush)
    Telemetry._read = marks.around("row", Telemetry._read)


def meter(marks: Marks):
    """The callback that marks each step's end (the start of the next one's statistics)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from normlab.train.callbacks import Callback

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            marks.counted += 1
            return func(*args, **(kwargs or {}))

    class StepEnd(Callback):
        name = "step_end_marks"

        def on_train_start(self, state) -> None:
            if marks.ops:
                self.mode = Count()
                self.mode.__enter__()
            if marks.calls:
                sys.setprofile(marks.count_call)
            marks.mark("statistics")

        def on_step_end(self, state, record) -> None:
            marks.mark("end")
            marks.mark("statistics")

        def on_train_end(self, state, summary) -> None:
            sys.setprofile(None)
            if marks.ops:
                self.mode.__exit__(None, None, None)

    torch.set_num_threads(1)
    return StepEnd()


def phases_of(events: list) -> list[dict[str, tuple]]:
    """Each step's (wall, cpu, ops, calls) per phase, from the marks; a phase not marked in a step is 0."""
    steps, current, last = [], collections.defaultdict(lambda: (0,) * 4), None
    for label, *reading in events:
        if last is not None and last[0] != "end":
            current[last[0]] = tuple(total + now - then for total, now, then in zip(current[last[0]], reading, last[1:]))
        if label == "end":
            steps.append(dict(current))
            current = collections.defaultdict(lambda: (0,) * 4)
        last = (label, *reading)
    return steps


def measure(args) -> dict:
    """This process's figures: per pair, the telemetry step's phases minus the plain step's."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import step_speed
    import normlab
    from normlab.train.run import train

    marks = Marks(args.ops, args.calls)
    instrument(marks)
    steps = 3 * args.pairs + 4
    cfg = step_speed.compose(["model=medium", f"model.d_model={args.width}", f"batch_size={args.batch}", f"seq_len={args.seq}",
                         f"device={args.device}", f"precision={args.precision}",
                         f"compile={str(args.compile).lower()}", "telemetry.every=3", f"max_steps={steps}", "log_every=1",
                         "eval_every=0", "eval_batches=1", "progress=false", "ckpt.every=0", "wandb.mode=offline",
                         f"sinks=[{args.sinks}]"])
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, run_dir, callbacks=[meter(marks)], echo=False)
        with open(Path(run_dir) / "metrics.jsonl") as lines:
            keys = len(json.loads(lines.readline()))  # step 0's row: a telemetry step's
    per_step = phases_of(marks.events)
    # (plain step before, telemetry step, the step after it): telemetry at 0, 3, 6, ...
    triples = [(per_step[3 * k - 1], per_step[3 * k], per_step[3 * k + 1]) for k in range(1, args.pairs + 1)]

    def added_in(phase: str, i: int) -> list[float]:
        return [t.get(phase, (0,) * 4)[i] + a.get(phase, (0,) * 4)[i] - 2 * p.get(phase, (0,) * 4)[i]
                for p, t, a in triples]

    added = {phase: [added_in(phase, i) for i in range(4)] for phase in PHASES}
    plain = [sum(v[0] for v in p.values()) for p, _, _ in triples]
    return {"normlab": str(Path(normlab.__file__).parents[1]), "added": added, "plain_wall": plain, "row_keys": keys}


def archived(ref: str, into: str) -> str:
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import telemetry_cost

    return telemetry_cost.archived(ref, into)


def measured_in(tree: str, args) -> dict:
    flags = ["--measure", "--width", str(args.width), "--batch", str(args.batch), "--seq", str(args.seq), "--pairs",
             str(args.pairs), "--sinks", args.sinks, "--precision", args.precision, "--device", args.device, *(["--ops"] if args.ops else []), *(["--calls"] if args.calls else []),
             *(["--compile"] if args.compile else [])]
    # The tree first, then whatever the path held (on the GPU machine the carried wheels: hydra, wandb)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (tree, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, __file__, *flags], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"telemetry_host: the measuring process for {tree} exited {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["normlab"]).resolve() != Path(tree).resolve():
        raise RuntimeError(f"the process for {tree} imported normlab from {result['normlab']}")
    return result


def report(results: dict[str, list[dict]], args) -> None:
    print(f"host time a telemetry step adds (with the step after it, against two plain logged steps), medium preset's structure (8 blocks, "
          f"8 heads) at width {args.width}, batch {args.batch} x seq {args.seq}, {args.device} {args.precision}, "
          f"{'compiled' if args.compile else 'eager'}, 1 torch thread, sinks "
          f"{args.sinks}; medians over {args.pairs} triples per process, ms (wall / process CPU"
          f"{' / aten ops' if args.ops else ''}{' / calls' if args.calls else ''})")
    width = 20 + 8 * args.calls
    print(f"{'package':<26}{'proc':>5}{'plain step':>12}" + "".join(f"{p:>{width}}" for p in (*PHASES, "total")))
    for name, runs in results.items():
        for i, run in enumerate(runs):
            added = run["added"]
            cells = []
            for phase in (*PHASES, "total"):
                series = ([[sum(added[p][k][j] for p in PHASES) for j in range(args.pairs)] for k in range(4)]
                          if phase == "total" else added[phase])
                wall, cpu, ops, calls = (statistics.median(s) for s in series)
                cells.append(f"{1e3 * wall:.2f}/{1e3 * cpu:.2f}" + (f"/{ops:.0f}" if args.ops else "")
                             + (f"/{calls:.0f}" if args.calls else ""))
            print(f"{name:<26}{i + 1:>5}{1e3 * statistics.median(run['plain_wall']):>9.2f} ms"
                  + "".join(f"{c:>{width}}" for c in cells) + f"   ({run['row_keys']} keys a row)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=16, help="model.d_model (8 heads: a multiple of 8)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--pairs", type=int, default=40, help="telemetry steps measured (each with a plain step before and the step after it)")
    parser.add_argument("--sinks", default="jsonl,wandb", help="the run's sinks (comma-separated)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="bf16: autocast, as on a GPU")
    parser.add_argument("--compile", action="store_true", help="compile=true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the same split on a GPU")
    parser.add_argument("--ops", action="store_true", help="also count each phase's aten ops")
    parser.add_argument("--calls", action="store_true", help="also count each phase's Python and C function calls")
    parser.add_argument("--processes", type=int, default=2, help="fresh processes per package, alternated")
    parser.add_argument("--base", default=None, help="git ref of the package to measure beside this tree")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one process of main
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
        return 0
    with tempfile.TemporaryDirectory() as base_dir:
        trees = {"this tree": str(ROOT)}
        if args.base:
            trees = {f"base ({args.base}, {archived(args.base, base_dir)})": base_dir, **trees}
        results: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.processes):
            for name, tree in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
                results[name].append(measured_in(tree, args))
                print(f"measured {name}, process {r + 1}", file=sys.stderr, flush=True)
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
