"""Time outside training: `normlab --help`, `normlab train --help`, and the per-job overhead of a sweep.

    python scripts/bench/startup.py [--jobs 4] [--steps 20] [--repeats 3] [OVERRIDE ...]

A sweep of `--jobs` short jobs (`normlab train -m seed=0,1,...`, wandb offline as by default, the
tiny model unless overridden) runs as a real command; its overhead is the command's wall time
minus the training-step and evaluation time each job records (tokens / tokens_per_s and
eval_time_s in summary.json). It splits into what happens inside `train()` around them (data
cache hit, wandb init and finish, checkpoints, end-of-run telemetry plots, summary:
summary.json's wall_time_s minus steps and evaluations) and the rest
(interpreter and imports, Hydra, the sweep's up-front check of every job). A single run
(`normlab train`, same config) gives the one-off start-up cost; the marginal cost of one more job
in a sweep is (sweep − single run − the extra jobs' step time) / (jobs − 1). Measured without the single
run: the time from one job's end (its summary.json written) to the next job's, less that next job's
steps and evaluations; its median and maximum over the sweep's jobs after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def script_env() -> dict[str, str]:
    """The environment of the commands a script starts: this process's as it is now (read at each call, so a
    caller that changed it since the import is heard), offline, wandb silent."""
    return {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "WANDB_SILENT": "true",
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def normlab_command() -> list[str]:
    """The `normlab` console script beside this interpreter (a venv's), else `python -m normlab`."""
    script = Path(sys.executable).with_name("normlab")
    return [str(script)] if script.exists() else [sys.executable, "-m", "normlab"]


def timed(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(args, env=script_env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def summaries(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob("summary.json"))]


def step_time(summary: dict) -> float:
    """Seconds of training steps and evaluations: the training itself."""
    return summary["train_time_s"] + summary["eval_time_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="normlab overrides for the jobs (default: model=tiny)")
    parser.add_argument("--jobs", type=int, default=4, help="jobs in the sweep")
    parser.add_argument("--steps", type=int, default=20, help="max_steps of each job")
    parser.add_argument("--repeats", type=int, default=3, help="timings of each --help (median)")
    args = parser.parse_args()
    normlab = normlab_command()
    load_start = os.getloadavg()[0]

    help_s = {
        "normlab --help": statistics.median(timed([*normlab, "--help"]) for _ in range(args.repeats)),
        "normlab train --help": statistics.median(timed([*normlab, "train", "--help"]) for _ in range(args.repeats)),
    }

    job = ["model=tiny", f"max_steps={args.steps}", "progress=false", *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # Warm the token cache, so every timed job is a cache hit as in a sweep's later jobs.
        timed([*normlab, "train", *job, f"hydra.run.dir={root / 'warm'}"])
        single_wall = timed([*normlab, "train", *job, f"hydra.run.dir={root / 'single'}"])
        (single,) = summaries(root / "single")
        seeds = ",".join(str(s) for s in range(args.jobs))
        sweep_wall = timed([*normlab, "train", "-m", *job, f"seed={seeds}", f"hydra.sweep.dir={root / 'sweep'}"])
        # Each job's summary with the time it was written, in that order: read once.
        ended = sorted(((p.stat().st_mtime, json.loads(p.read_text())) for p in (root / "sweep").rglob("summary.json")),
                       key=lambda pair: pair[0])
        jobs = [summary for _, summary in ended]
    if len(jobs) != args.jobs or any(s["status"] != "completed" for s in [single, *jobs]):
        print(f"startup.py: error: expected {args.jobs} completed jobs, found {len(jobs)}", file=sys.stderr)
        return 1

    steps = sum(step_time(s) for s in jobs)
    in_train = sum(s["wall_time_s"] - step_time(s) for s in jobs)
    overhead = sweep_wall - steps
    marginal = (sweep_wall - single_wall - (steps - step_time(single))) / (args.jobs - 1) if args.jobs > 1 else float("nan")
    # From one job's end (its summary.json written) to the next's, less the next job's training: what a job
    # costs the sweep beyond its training, with no single run to subtract (whose start-up varies by seconds).
    between = [(t1 - t0) - step_time(s1) for (t0, _), (t1, s1) in zip(ended, ended[1:])]

    print(f"normlab start-up and sweep overhead; `{' '.join(normlab)}`; load average (1 min) {load_start:.2f} at the "
          f"start, {' '.join(f'{v:.2f}' for v in os.getloadavg())} at the end")
    for what, seconds in help_s.items():
        print(f"{what:<26}{seconds:>7.2f} s  (median of {args.repeats}; target <= 2 s)")
    print(f"jobs: {' '.join(job)}, wandb {script_env()['WANDB_MODE']}")
    print(f"single run: {single_wall:.2f} s wall, {step_time(single):.2f} s of training steps and evaluations, "
          f"overhead {single_wall - step_time(single):.2f} s (of which inside train(): "
          f"{single['wall_time_s'] - step_time(single):.2f} s)")
    print(f"sweep of {args.jobs} jobs: {sweep_wall:.2f} s wall, {steps:.2f} s of training steps and evaluations")
    print(f"  overhead per job:               {overhead / args.jobs:>6.2f} s  (target <= 2 s)")
    print(f"    inside train(), per job:      {in_train / args.jobs:>6.2f} s  (cache hit, wandb init/finish, checkpoints, plots)")
    print(f"    outside train(), per job:     {(overhead - in_train) / args.jobs:>6.2f} s  (start-up, Hydra, the sweep's check of every job)")
    print(f"  marginal cost of one more job:  {marginal:>6.2f} s  (the sweep less the single run)")
    if between:
        print(f"  per job, end to end, beyond its training: median {statistics.median(between):.2f} s, "
              f"max {max(between):.2f} s over jobs 2..{args.jobs}  (target <= 1 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
