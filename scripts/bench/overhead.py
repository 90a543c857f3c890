"""Time outside training, this checkout against a base commit: a one-step run and a small CPU sweep, interleaved.

    python scripts/bench/overhead.py [--base COMMIT] [--repeats 3] [--jobs 8] [--cpu-jobs 2] [--steps 100]
                                     [--threads N] [--single | --ablation | --pack21] [OVERRIDE ...]

Two commands whose time is mostly start-up, run as real processes (`python -m normlab`, wandb offline as by
default), alternately with this checkout's normlab and with a `git archive` of `--base` (default: the
merge base of HEAD and main) extracted to a temporary dir, first on PYTHONPATH:
  single  `normlab train model=tiny max_steps=1 eval_every=1`: its wall time (target <= 3.5 s);
  sweep   `normlab train -m seed=0,...,7 model=tiny max_steps=100 eval_every=50 hydra.launcher.cpu_jobs=2`:
          its wall time, and the share of its slot-seconds (wall x cpu_jobs) outside the jobs' training loops
          (target <= 40%). A job's training loop is its steps and evaluations: summary.json's phases
          compile + train + eval where it has them, and train_time_s + eval_time_s (the base's measure, also
          printed for this checkout) otherwise.
With `--ablation` it times instead the shape of the GPU acceptance's 72-run ablation on the CPU:
  ablation `normlab train -m norm=none,layer,rms,batch placement=pre,post lr=1e-3,3e-3,1e-2 seed=0,1,2 model=tiny
          max_steps=2 pack=true device=cpu hydra.launcher.cpu_jobs=2`: 72 runs in 8 packs, two workers; the seconds
          from the command's start to the first run's first step (its head, where the GPU sat idle), from the last
          step logged to the last run's end (its ends: final checkpoints, heatmaps, reports) and from the last run's
          end to the command's exit (its tail), read from the runs' normlab.log lines.
With `--pack21`, the same figures of the GPU acceptance's pack21 stage's shape on the CPU:
  pack21  `normlab train -m norm=layer placement=pre model=medium max_steps=2 lr=<7 values> seed=0,1,2 pack=true
          device=cpu batch_size=2 seq_len=32 eval_every=1 eval_batches=1`: one pack of 21 medium members (their
          checkpoints 1.6 GB in all, as on the GPU), run in the launching process.
Each command's process CPU time (user + sys of it and all its descendants, from getrusage(RUSAGE_CHILDREN), the
script being their reaper: see adopt_orphans) is printed beside its wall time: far less sensitive than wall time
to other work on the machine. Medians over
`--repeats` rounds; the load average is printed before each round and at the end. OVERRIDEs are added to
both commands (for a quick check: smaller batches, wandb.mode=disabled). `--threads N` sets OMP_NUM_THREADS
for both commands (the sweep's workers take their share of the cores whatever it is): on a loaded machine
torch's waiting threads spin, and one thread makes the single run's CPU time far steadier.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SINGLE = ["model=tiny", "max_steps=1", "eval_every=1"]
ABLATION = ["norm=none,layer,rms,batch", "placement=pre,post", "lr=1e-3,3e-3,1e-2", "seed=0,1,2", "model=tiny",
            "max_steps=2", "pack=true", "device=cpu"]
# A run's first line (normlab.train.callbacks.report, a pack's in normlab.train.pack.trainer), logged as its first step
# begins, and its last, logged as its training loop ends; each stamped to the millisecond by the job log.
STAMP = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[normlab\]\[INFO\] - "
FIRST_LINE = re.compile(STAMP + r".*: \S+, \w+, [\d,]+ parameters( each|.*, run dir )")
LAST_LINE = re.compile(STAMP + r"\S+ \w+: final val loss ")
STEP_LINE = re.compile(STAMP + r".*: step \d+/\d+ ")  # a logged step's line, a pack's once for all its members
# The GPU acceptance's pack21 stage (scripts/gpu/sweep_stages.py) on the CPU: the medium preset's 21 members, so their
# checkpoints are the GPU run's size (1.6 GB in all), at a batch and length that make its two steps quick.
PACK21 = ["norm=layer", "placement=pre", "model=medium", "max_steps=2", "lr=3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1",
          "seed=0,1,2", "pack=true", "device=cpu", "batch_size=2", "seq_len=32", "eval_every=1", "eval_batches=1"]


def extract(commit: str, into: Path) -> Path:
    """`git archive` of `commit` extracted under `into`, its conf/ reachable as the package normlab.conf."""
    archive = into / "base.tar"
    subprocess.run(["git", "archive", "-o", str(archive), commit], cwd=ROOT, check=True)
    base = into / "base"
    with tarfile.open(archive) as tar:
        tar.extractall(base, filter="data")
    (base / "normlab" / "conf").symlink_to(Path("..") / "conf")
    return base


def environment(tree: Path, threads: int | None) -> dict[str, str]:
    """The commands' environment: `tree` first on PYTHONPATH, offline, wandb silent, `threads` torch threads."""
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
           "WANDB_SILENT": "true", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def where_normlab(env: dict[str, str]) -> str:
    code = "import normlab, normlab.conf; print(normlab.__file__, list(normlab.conf.__path__)[0])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          cwd="/").stdout.strip()


def adopt_orphans() -> None:
    """Make this process the reaper of its descendants orphaned by their parent's exit (Linux's
    PR_SET_CHILD_SUBREAPER), so their CPU time is counted too: a CPU sweep's workers are the children of
    multiprocessing's forkserver, which outlives the command by a moment and is not waited for by it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def reap_orphans(patience: float = 30.0) -> None:
    """Wait (up to `patience` seconds) for every descendant left over from a command (adopt_orphans), adding its CPU
    to RUSAGE_CHILDREN."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.02)
        except ChildProcessError:
            return
    print(f"overhead.py: descendants still running {patience:.0f} s after the command: their CPU is not counted")


def timed(args: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall seconds (until the command exits) and CPU seconds (user + sys, of all its descendants, the ones it
    left behind included) of `python -m normlab ARGS`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "normlab", *args], env=env, cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    reap_orphans()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def summaries(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob("summary.json")) if "wandb" not in p.parts]


def loop_seconds(summary: dict) -> tuple[float | None, float]:
    """A job's training loop by its phases (compile + train + eval; None without phases), and by
    train_time_s + eval_time_s."""
    phases = summary.get("phases")
    by_phases = sum(phases.get(k, 0.0) for k in ("compile", "train", "eval")) if phases else None
    return by_phases, summary["train_time_s"] + summary["eval_time_s"]


def run_round(name: str, env: dict[str, str], work: Path, args, results: dict) -> None:
    single_dir, sweep_dir = work / f"{name}-single", work / f"{name}-sweep"
    wall, cpu = timed(["train", *SINGLE, *args.overrides, f"hydra.run.dir={single_dir}"], env, work)
    results[name]["single"].append((wall, cpu))
    subprocess.run(["rm", "-rf", str(single_dir)], check=True)
    if args.single:
        return
    seeds = ",".join(str(s) for s in range(args.jobs))
    wall, cpu = timed(["train", "-m", f"seed={seeds}", *sweep_job(args), *args.overrides,
                       f"hydra.launcher.cpu_jobs={args.cpu_jobs}", f"hydra.sweep.dir={sweep_dir}"], env, work)
    jobs = summaries(sweep_dir)
    if len(jobs) != args.jobs or any(s.get("status") != "completed" for s in jobs):
        raise SystemExit(f"overhead.py: {name}'s sweep: expected {args.jobs} completed jobs, found "
                         f"{[s.get('status') for s in jobs]}")
    loops = [loop_seconds(s) for s in jobs]
    by_phases = sum(p for p, _ in loops) if all(p is not None for p, _ in loops) else None
    results[name]["sweep"].append((wall, cpu, by_phases, sum(t for _, t in loops)))
    subprocess.run(["rm", "-rf", str(sweep_dir)], check=True)


def log_times(sweep_dir: Path, pattern: re.Pattern) -> list[float]:
    """The times (time.time()) of the lines matching `pattern` in the job logs (normlab.log) under `sweep_dir`, each
    line once (a pack's lines are in each of its members' logs)."""
    lines = {line for log in sweep_dir.rglob("normlab.log") for line in log.read_text(errors="replace").splitlines()}
    stamps = [match.group(1) for line in lines if (match := pattern.match(line))]
    return [datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() for stamp in stamps]


def grid_of(args) -> tuple[list[str], int]:
    """The packed grid timed instead of the two commands, and its number of runs."""
    return (PACK21, 21) if args.pack21 else (ABLATION, 72)


def run_ablation(name: str, env: dict[str, str], work: Path, args, results: dict) -> None:
    """A packed grid (the 72-run ablation, or pack21): its wall and CPU time, its head (start to the first run's first
    step), its ends (the last step logged to the last run's end: final checkpoints, heatmaps, reports) and its tail
    (the last run's end to the exit)."""
    grid, runs = grid_of(args)
    sweep_dir = work / f"{name}-grid"
    started = time.time()
    wall, cpu = timed(["train", "-m", *grid, *args.overrides, f"hydra.launcher.cpu_jobs={args.cpu_jobs}",
                       f"hydra.sweep.dir={sweep_dir}"], env, work)
    ended = started + wall
    firsts, lasts = log_times(sweep_dir, FIRST_LINE), log_times(sweep_dir, LAST_LINE)
    if len(lasts) != runs:
        raise SystemExit(f"overhead.py: {name}'s grid: expected {runs} runs' last lines, found {len(lasts)}")
    steps = log_times(sweep_dir, STEP_LINE)  # none where packs ran side by side: the launcher turns their progress off
    results[name]["ablation"].append((wall, cpu, min(firsts) - started, max(lasts) - max(steps) if steps else None,
                                      ended - max(lasts)))
    subprocess.run(["rm", "-rf", str(sweep_dir)], check=True)


def report_ablation(results: dict, args) -> None:
    med = statistics.median
    print(f"\nmedians over {args.repeats} rounds; load average (1, 5, 15 min) at the end: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    grid, runs = grid_of(args)
    print(f"{'pack21' if args.pack21 else 'ablation'} grid ({' '.join(grid + args.overrides)} hydra.launcher.cpu_jobs="
          f"{args.cpu_jobs}): {runs} runs; head: the command's start to the first run's first step; ends: the last step "
          "logged to the last run's end; tail: the last run's end to the exit")
    for name, rows in results.items():
        walls, cpus, heads, ends, tails = zip(*rows["ablation"])
        end = "  n/a" if None in ends else f"{med(ends):5.2f}"
        print(f"  {name:<5} {med(walls):6.2f} s wall  {med(cpus):6.2f} s CPU  head {med(heads):6.2f} s  ends "
              f"{end} s  tail {med(tails):5.2f} s   (walls {', '.join(f'{w:.1f}' for w in walls)}; ends "
              f"{', '.join('n/a' if e is None else f'{e:.1f}' for e in ends)})")


def sweep_job(args) -> list[str]:
    return ["model=tiny", f"max_steps={args.steps}", f"eval_every={max(1, args.steps // 2)}"]


def outside(loop: float | None, wall: float, slots: int) -> str:
    return "   n/a" if loop is None else f"{100 * (1 - loop / (wall * slots)):5.1f}%"


def report(results: dict, args) -> None:
    med = statistics.median
    print(f"\nmedians over {args.repeats} rounds; load average (1, 5, 15 min) at the end: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"single run ({' '.join(SINGLE + args.overrides)}): target <= 3.5 s wall")
    for name, rows in results.items():
        walls, cpus = zip(*rows["single"])
        print(f"  {name:<5} {med(walls):6.2f} s wall  {med(cpus):6.2f} s CPU   (walls {', '.join(f'{w:.2f}' for w in walls)})")
    if args.single:
        return
    print(f"sweep of {args.jobs} ({' '.join(sweep_job(args))}, cpu_jobs={args.cpu_jobs}): target <= 40% of the "
          f"slot-seconds outside the training loops")
    for name, rows in results.items():
        walls, cpus, phased, timed_ = zip(*rows["sweep"])
        loop_p = med(phased) if all(p is not None for p in phased) else None
        loop_t = med(timed_)
        wall = med(walls)
        phase_text = "n/a" if loop_p is None else f"{loop_p:6.2f} s"
        print(f"  {name:<5} {wall:6.2f} s wall  {med(cpus):6.2f} s CPU; training loops {phase_text} by phases "
              f"(outside {outside(loop_p, wall, args.cpu_jobs)}), {loop_t:6.2f} s by train_time_s + eval_time_s "
              f"(outside {outside(loop_t, wall, args.cpu_jobs)})   (walls {', '.join(f'{w:.1f}' for w in walls)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, help="the commit to compare with (default: git merge-base HEAD main)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of base and new, interleaved")
    parser.add_argument("--jobs", type=int, default=8, help="jobs in the sweep")
    parser.add_argument("--cpu-jobs", type=int, default=2, help="hydra.launcher.cpu_jobs of the sweep")
    parser.add_argument("--steps", type=int, default=100, help="max_steps of the sweep's jobs (eval_every: half)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of both commands (default: unset)")
    parser.add_argument("--single", action="store_true",
                        help="time the one-step run alone: no sweep between its runs, whose files and processes leave "
                             "work behind them (the page cache's writes, wandb's services ending) that the next run meets")
    parser.add_argument("--ablation", action="store_true", help="time the 72-run ablation grid's head and tail instead")
    parser.add_argument("--pack21", action="store_true",
                        help="time the GPU acceptance's pack of 21 medium members (2 steps, small batches) instead")
    parser.add_argument("overrides", nargs="*", help="normlab overrides added to both commands")
    args = parser.parse_args()
    adopt_orphans()
    base_commit = args.base or subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True,
                                              text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        envs = {"base": environment(extract(base_commit, work), args.threads), "new": environment(ROOT, args.threads)}
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        print(f"base {base_commit[:10]}: {where_normlab(envs['base'])}")
        print(f"new  {head} (with uncommitted changes, if any): {where_normlab(envs['new'])}")
        print(f"OMP_NUM_THREADS={envs['new'].get('OMP_NUM_THREADS', '(unset)')}, WANDB_MODE={envs['new']['WANDB_MODE']}")
        for name, env in envs.items():  # the token cache, and the first-use costs of a fresh machine, out of the timings
            timed(["train", *SINGLE, *args.overrides, f"hydra.run.dir={work / ('warm-' + name)}"], env, work)
        results = {name: {"single": [], "sweep": [], "ablation": []} for name in envs}
        for round_ in range(args.repeats):
            print(f"round {round_ + 1}: load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
            for name, env in (envs.items() if round_ % 2 == 0 else reversed(envs.items())):
                (run_ablation if args.ablation or args.pack21 else run_round)(name, env, work, args, results)
        (report_ablation if args.ablation or args.pack21 else report)(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
