"""Time `normlab compare` on a sweep of synthetic run dirs written as `normlab train` writes them.

    python scripts/bench/compare.py [--grid "norm=none,layer,rms,batch,dyt placement=pre,post ..."]
                                    [--steps 500] [--log-every 10] [--depth 4] [--repeats 3] [--keep DIR] [--profile]

The default grid is 5 norms × 2 placements × 5 learning rates × 3 seeds = 150 runs of the default
config's shape: 500 steps logged every 10 with per-layer telemetry on every logged row (about 110
keys a row at depth 4, 240 kB of metrics.jsonl a run), config.json, summary.json with its
environment block; the high learning rates of `norm=none` and Post-LN diverge, and a few runs have
a loss spike. It prints the command's wall time and CPU time (`normlab compare DIR --out ...` as a
subprocess: interpreter, imports, reading, report and plots; medians of --repeats; on a loaded
machine the wall time grows with the load, the CPU time is the wall time on an idle core), where the
time goes in one in-process call, and this machine's load. --keep DIR writes the run dirs there and
keeps them (to look at the report); --profile prints cProfile's top functions of one in-process call.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import math
import os
import pstats
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from startup import normlab_command, script_env

from normlab import keys
from normlab.config import RunConfig, nest_config

GRID = "norm=none,layer,rms,batch,dyt placement=pre,post lr=1e-3,3e-3,1e-2,3e-2,1e-1 seed=0,1,2"
BASE_LOSS = {"none": 2.2, "layer": 1.9, "rms": 1.88, "batch": 2.05, "dyt": 1.95}
# Per-layer telemetry as the Probe writes it: (STAT, parts); None is the whole block.
LAYER_STATS = (
    ("act/norm_in_rms", ("norm1", "norm2")), ("act/norm_out_rms", ("norm1", "norm2")), ("act/out_rms", ("attn", "mlp")),
    ("act/resid_max", (None,)), ("act/resid_rms", (None,)), ("attn/entropy", (None,)), ("attn/logit_max", (None,)),
    ("grad/norm", (None, "attn", "mlp", "norms")), ("grad/resid_rms", (None,)), ("norm/gain_mean", ("norm1", "norm2")),
    ("norm/gain_std", ("norm1", "norm2")), ("update_ratio", (None, "attn", "mlp", "norms")),
)  # fmt: skip
RUN_STATS = ("act/embed_max", "act/embed_rms", "grad/embed_norm", "grad/embed_rms", "grad/norm_f_norm",
             "act/norm_in_rms/norm_f", "act/norm_out_rms/norm_f", "norm/gain_mean/norm_f", "norm/gain_std/norm_f",
             "update_ratio/embed", "update_ratio/norm_f")  # fmt: skip


def parse_grid(text: str) -> list[dict[str, object]]:
    """'norm=a,b lr=1e-3,1e-2' -> one dict of config values per combination."""
    axes = []
    for item in text.split():
        key, values = item.split("=", 1)
        axes.append([(key, _value(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def _value(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


def final_loss(job: dict, rng: random.Random) -> float | None:
    """The run's final val loss; None when it diverges (high lr without a norm, or Post-LN)."""
    lr = float(job.get("lr", 3e-3))
    limit = 1e-2 if job.get("norm") == "none" else 3e-2 if job.get("placement") == "post" else 1.0
    if lr > limit:
        return None
    return BASE_LOSS.get(str(job.get("norm")), 2.0) + 0.08 * math.log10(lr / 5e-3) ** 2 + rng.gauss(0, 0.01)


def rows_of(job: dict, final: float | None, steps: int, log_every: int, depth: int, rng: random.Random) -> list[dict]:
    """metrics.jsonl rows: step 0 .. steps every log_every, val every steps/5, telemetry on every row."""
    init, lr = 5.55 + rng.gauss(0, 0.01), float(job.get("lr", 3e-3))
    diverge_at = None if final is not None else rng.randrange(steps // 5, steps // 2) // log_every * log_every
    spike_at = rng.randrange(steps // 2, steps) // log_every * log_every if rng.random() < 0.2 else None
    target = final if final is not None else 3.0
    rows = []
    for step in range(0, steps + 1, log_every):
        loss = target + (init - target) * math.exp(-step / (steps / 8)) + rng.gauss(0, 0.01)
        row: dict = {"step": step, "tokens": step * 4096}
        if step == diverge_at:
            rows.append({**row, "status": "diverged"})
            break
        if step % (steps // 5) == 0:
            row.update(val_loss=loss + 0.02, val_bpb=(loss + 0.02) / math.log(2))
        if step == steps:
            rows.append(row)
            break
        row.update(loss=loss * (1.3 if step == spike_at else 1.0), lr=lr, grad_norm=abs(rng.gauss(1, 0.2)) * (1 + 30 * lr))
        row.update({key: abs(rng.gauss(1, 0.3)) for key in RUN_STATS})
        for layer, (stat, parts) in itertools.product(range(depth), LAYER_STATS):
            label = keys.layer_label(layer, depth)
            scale = 10 * lr * math.sqrt(step + 1) if stat == "attn/logit_max" else 1.0
            row.update({keys.layer_key(stat, label, part): abs(rng.gauss(1, 0.3)) * scale for part in parts})
        row["tokens_per_s"] = 2000 + rng.gauss(0, 50)
        rows.append(row)
    return rows



def write_run(path: Path, job: dict, steps: int, log_every: int, depth: int, rng: random.Random) -> None:
    """One run dir: config.json (the whole RunConfig tree), metrics.jsonl and summary.json."""
    settings = {("norm.name" if k == "norm" else k): v for k, v in job.items()}
    settings = {"depth": depth, "max_steps": steps, "log_every": log_every, "eval_every": steps // 5, **settings}
    config = nest_config(settings, into=RunConfig().to_dict())
    final = final_loss(job, rng)
    rows = rows_of(job, final, steps, log_every, int(config["depth"]), rng)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    vals = [row["val_loss"] for row in rows if "val_loss" in row]
    diverged = rows[-1].get("status") == "diverged"
    summary = {
        "name": path.name, "norm": config["norm"]["name"], "placement": config["placement"], "qk_norm": False,
        "depth": config["depth"], "lr": config["lr"], "seed": config["seed"], "group": None,
        "status": "diverged" if diverged else "completed", "tokenizer": "bytes-v1",
        "final_val_loss": None if diverged else vals[-1], "best_val_loss": min(vals),
        "final_val_bpb": None if diverged else vals[-1] / math.log(2), "best_val_bpb": min(vals) / math.log(2),
        "steps": rows[-1]["step"], "tokens": rows[-1]["tokens"], "n_params": 842496, "device": "cpu",
        "precision": "fp32", "tokens_per_s": 2000.0, "wall_time_s": 120.0,
        "environment": {"python": "3.11.7", "torch": "2.13.0", "cuda": None, "device": "cpu", "torch_threads": 2,
                        "world_size": 1, "normlab": "0.1.0", "git_commit": None},
    }  # fmt: skip
    if diverged:
        summary["diverged_step"] = rows[-1]["step"]
    (path / "summary.json").write_text(json.dumps(summary, indent=2))


def write_sweep(root: Path, grid: str, steps: int, log_every: int, depth: int) -> int:
    jobs = parse_grid(grid)
    rng = random.Random(0)
    for number, job in enumerate(jobs):
        name = "-".join(str(v) for v in job.values()).replace(".", "p")
        write_run(root / f"{number}_{name}", job, steps, log_every, depth, rng)
    return len(jobs)


def timed_command(sweep: Path, out: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of `normlab compare` as a command. On a loaded machine the wall
    time grows with the load; the CPU time is what the command would take on an idle core."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([*normlab_command(), "compare", str(sweep), "--out", str(out)], env=script_env(), check=True,
                   stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - start, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def in_process(sweep: Path, out: Path) -> dict[str, float]:
    """Seconds of each part of one compare() call in this process (imports already done)."""
    from normlab.analysis.stats.comparison import build_comparison
    from normlab.analysis.render.plots import write_plots
    from normlab.analysis.render.report import write_report
    from normlab.analysis.read.runs import find_run_dirs

    out.mkdir(parents=True, exist_ok=True)
    times, start = {}, time.perf_counter()
    comparison = build_comparison(find_run_dirs([sweep]))
    times["read and group the runs"] = time.perf_counter() - start
    start = time.perf_counter()
    plots = write_plots(comparison, out)
    times["plots"] = time.perf_counter() - start
    start = time.perf_counter()
    write_report(comparison, out, plots, sources=[str(sweep)])
    times["report.md"] = time.perf_counter() - start
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default=GRID, help="config values to cross, Hydra-style (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timings of the command (median)")
    parser.add_argument("--keep", metavar="DIR", help="write the run dirs into DIR and keep them")
    parser.add_argument("--profile", action="store_true", help="cProfile one in-process call")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(args.keep) if args.keep else Path(tmp) / "sweep"
        n = write_sweep(sweep, args.grid, args.steps, args.log_every, args.depth)
        size = sum(p.stat().st_size for p in sweep.rglob("*") if p.is_file()) / 2**20
        print(f"{n} run dirs, {size:.0f} MiB, {args.steps} steps logged every {args.log_every}, depth {args.depth}: {args.grid}")
        load = os.getloadavg()[0]
        walls, cpus = zip(*(timed_command(sweep, Path(tmp) / f"report{i}") for i in range(args.repeats)))
        print(f"normlab compare: {statistics.median(walls):.2f} s wall (median of {len(walls)}: "
              + ", ".join(f"{w:.2f}" for w in walls) + f"), {statistics.median(cpus):.2f} s CPU (user + system)")
        for part, seconds in in_process(sweep, Path(tmp) / "report-in").items():
            print(f"  {part:<26}{seconds:6.2f} s  (in process)")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(in_process, sweep, Path(tmp) / "report-profile")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    print(f"load average: {load:.2f} before, {' '.join(f'{v:.2f}' for v in os.getloadavg())} after, on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
