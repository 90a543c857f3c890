"""The 72-run ablation end to end: `normlab train -m` over norm × placement × lr × seed on the medium preset as packs,
then `normlab compare` on its sweep dir, and the dated record of its answer.

The stage reports as it goes: the sweep's wall time, command to closing table (target <= 150 s at 500 steps); its
head, the command's start to the first run's first step, where the GPU has nothing to do yet (<= 15 s); the runs that
did not finish (0: a failed run is no outcome); compare's time; and the wall time of the same grid at 2,000 steps
(590M tokens; <= 600 s), projected from this one's measured parts (stage `ablation72_2000` measures it). Beside the
JSON it writes ablation72-<gpu>.md, the record (machine, date, commit, commands, the figures and compare's answer:
ranked arms with gaps and 95% intervals, factor effects, lr-edge notes), ablation72-report.tar.gz (compare's report
dir) and ablation72-sweep.log (the sweep's and compare's output). Last, while its budget lasts, two of its runs train
one at a time, unpacked, and their final val losses are compared with the sweep's. Each part runs under a timeout
taken from the stage's budget, so a slow part leaves the later ones their time.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from gpu_stage import SCRIPT, Context, device_slug

# 4 norms x 2 placements x 3 lrs x 3 seeds of the medium preset, 500 steps: 72 x 500 x 4,096 tokens = 147M.
ABLATION = {"norm": "none,layer,rms,batch", "placement": "pre,post", "lr": "1e-3,3e-3,1e-2", "seed": "0,1,2",
            "model": "medium", "max_steps": 500}
# How it runs, from the H100's measurements (docs/speed.md): each norm x placement arm's 9 lr x seed runs as one
# pack (one model's kernel launches for 9 runs' work), 4 packs at once on the GPU; eager, as packs are.
ABLATION_RUN = {"pack": "true", "hydra.launcher.jobs_per_gpu": 4}
# The smoke's grid: 2 packs of 4 tiny runs on the CPU (the whole grid would take minutes there).
ABLATION_SMOKE = {"norm": "layer,rms", "placement": "pre", "lr": "1e-3,3e-3", "seed": "0,1", "max_steps": 4}
# Final val losses of sampled runs, packed against one at a time: bf16 on a GPU is not bit-exact, and 500 steps
# let rounding differences grow (a bound set ahead of the first GPU run, which reports the difference itself);
# within 1e-5 on the CPU in fp32, as docs/sweeps.md says of packs.
ABLATION_TOLERANCE = 1e-2
LONG_STEPS = 2000  # the grid's long version: 72 x 2,000 x 4,096 tokens = 590M
COMPARE_S = 60  # seconds kept for compare after the sweep (7 s for 150 runs on a loaded 2-core CPU: docs/sweeps.md)


def ablation72(ctx: Context) -> None:
    """The 500-step grid timed, compare on it, the record, the 2,000-step projection; then two runs unpacked."""
    from startup import normlab_command

    normlab, sweep_dir = normlab_command(), ctx.workdir / "ablation"
    overrides = ctx.run_overrides({**ABLATION, **ABLATION_RUN}, smoke=ABLATION_SMOKE)
    command = f"normlab train -m {' '.join(overrides)}"
    parts = timed_grid(ctx, normlab, overrides, sweep_dir, ctx.timeout(COMPARE_S), "ablation72")
    compare_s, answer = compare(ctx, normlab, sweep_dir, min(2 * COMPARE_S, ctx.timeout(5) or 2 * COMPARE_S))
    if compare_s is not None:
        ctx.report("ablation72_compare_s", round(compare_s, 2), f"normlab compare on the sweep dir; command to "
                   f"compare's table {parts['wall'] + compare_s:.1f} s", None, "normlab compare <sweep dir>")
    steps = int(dict(o.split("=", 1) for o in overrides)["max_steps"])
    project(ctx, parts, steps, LONG_STEPS * steps // ABLATION["max_steps"])
    write_record(ctx, command, answer)
    if (ctx.timeout() or 60) >= 60 and parts["jobs"]:  # two runs of 500 steps, one at a time: about 40 s on a GPU
        alone_check(ctx, normlab, parts["jobs"], steps)
        write_record(ctx, command, answer)


def timed_grid(ctx: Context, normlab: list[str], overrides: list[str], sweep_dir: Path, timeout: float | None,
               name: str) -> dict[str, Any]:
    """The sweep command under `timeout`: its wall time, head and runs not finished, reported as `name`_wall_s,
    `name`_head_s and `name`_failed; returns its parts (start, first step, last run's end, wall) and jobs."""
    from overhead import FIRST_LINE, LAST_LINE, log_times

    from normlab.launch.sweep_log import phase_totals
    from sweep_stages import sweep_wall
    from sweep_throughput import run_sweep

    expected = 8 if ctx.smoke else 72
    started = time.time()
    wall, jobs = run_sweep(normlab, overrides, sweep_dir, timeout=timeout, log=ctx.out / "ablation72-sweep.log")
    firsts, lasts = log_times(sweep_dir, FIRST_LINE), log_times(sweep_dir, LAST_LINE)
    parts = {"started": started, "first": min(firsts, default=None), "last": max(lasts, default=None), "wall": wall,
             "jobs": jobs}
    value, detail = sweep_wall(wall, jobs, expected, "runs")
    tokens = sum(s.get("tokens") or 0 for s in jobs.values())
    detail += (f"; {tokens / 1e6:.1f}M tokens, {tokens / wall:,.0f} tokens/s over the whole command; "
               f"{phase_totals(list(jobs.values())) or 'no phases recorded'}")
    command = f"normlab train -m {' '.join(overrides)}"
    ctx.report(f"{name}_wall_s", value, detail, None, command)
    if parts["first"] is not None:
        ctx.report(f"{name}_head_s", round(parts["first"] - started, 2), "the command's start to the first run's first "
                   "step (its first line in normlab.log, stamped to the millisecond)", None, command)
    bad = [s for s in jobs.values() if s.get("status") not in ("completed", "diverged")]
    failed = len(bad) + max(0, expected - len(jobs))
    first_error = next((s["error"] for s in bad if s.get("error")), None)
    ctx.report(f"{name}_failed", failed, f"{failed} of {expected} runs did not finish (diverged is an outcome)"
               + (f"; the first error: {first_error}" if first_error else ""), None, command)
    return parts


def compare(ctx: Context, normlab: list[str], sweep_dir: Path, timeout: float) -> tuple[float | None, str]:
    """`normlab compare` on the sweep dir under `timeout`: its seconds (None where it failed or ran out of time) and
    what it printed (or why not); its report dir goes beside the JSON as ablation72-report.tar.gz."""
    from startup import script_env

    started = time.perf_counter()
    try:
        done = subprocess.run([*normlab, "compare", str(sweep_dir)], env=script_env(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"normlab compare ran past its {timeout:.0f} s"
    seconds = time.perf_counter() - started
    with (ctx.out / "ablation72-sweep.log").open("a") as log:
        log.write(f"\n$ normlab compare {sweep_dir}\n{done.stdout}{done.stderr}")
    if (sweep_dir / "report").is_dir():
        with tarfile.open(ctx.out / "ablation72-report.tar.gz", "w:gz") as tar:
            tar.add(sweep_dir / "report", arcname="report")
    if done.returncode:
        return None, f"normlab compare exited {done.returncode}: {done.stderr.strip()[-500:]}"
    return seconds, done.stdout.rstrip()


def project(ctx: Context, parts: dict[str, Any], steps: int, long_steps: int) -> None:
    """The grid's wall time at `long_steps`: its head and its tail as measured, and the span from the first run's
    first step to the last run's end times long_steps / steps (the packs' steps, evaluations and waves scale with
    the steps)."""
    if parts["first"] is None or parts["last"] is None:
        return
    head = parts["first"] - parts["started"]
    span = parts["last"] - parts["first"]
    tail = parts["started"] + parts["wall"] - parts["last"]
    value = head + span * long_steps / steps + tail
    ctx.report("ablation72_2000_projected_s", round(value, 1),
               f"projected, not measured: head {head:.1f} s + {span:.1f} s from the first step to the last run's end at "
               f"{steps} steps x {long_steps / steps:g} + tail {tail:.1f} s (stage ablation72_2000 measures it)", None,
               f"{SCRIPT} --stage ablation72")


def ablation72_2000(ctx: Context) -> None:
    """The same grid at 2,000 steps (590M tokens), timed: the measurement the ablation72 stage projects."""
    from startup import normlab_command

    long = {**ABLATION, **ABLATION_RUN, "max_steps": LONG_STEPS}
    overrides = ctx.run_overrides(long, smoke={**ABLATION_SMOKE, "max_steps": 4 * int(ABLATION_SMOKE["max_steps"])})
    timed_grid(ctx, normlab_command(), overrides, ctx.workdir / "ablation", ctx.timeout(5), "ablation72_2000")


def alone_check(ctx: Context, normlab: list[str], jobs: dict[str, dict], steps: int) -> None:
    """Two of the grid's runs trained one at a time, unpacked: their final val losses against the sweep's."""
    from sweep_throughput import run_sweep, unfinished

    sample = ctx.run_overrides({**ABLATION, **ABLATION_RUN, "norm": "layer,rms", "placement": "pre", "lr": "3e-3",
                                "seed": "1", "pack": "false", "hydra.launcher.jobs_per_gpu": 2},
                               smoke={"norm": "layer,rms", "placement": "pre", "lr": "3e-3", "seed": "1", "max_steps": 4})
    _, alone = run_sweep(normlab, sample, ctx.workdir / "alone", timeout=ctx.timeout(5))
    tolerance, diff = (1e-5 if ctx.smoke else ABLATION_TOLERANCE), float("inf")
    if why := unfinished(alone, 2, "runs"):
        detail = f"not compared: {why}"
    elif missing := [n for n in alone if n not in jobs]:
        detail = f"not compared: {', '.join(missing)} not in the sweep"
    else:
        diff = max(abs(jobs[n]["final_val_loss"] - s["final_val_loss"]) / abs(s["final_val_loss"]) for n, s in alone.items())
        detail = (f"{', '.join(sorted(alone))} one at a time (pack=false, {steps} steps): largest relative difference "
                  f"of final val loss {diff:.2e} (tolerance {tolerance:g})")
    ctx.report("ablation72_packed_vs_alone", None if diff == float("inf") else float(f"{diff:.3g}"), detail,
               "two of its runs one at a time: their final val losses", f"normlab train -m {' '.join(sample)}",
               ok=diff <= tolerance)


def write_record(ctx: Context, command: str, answer: str) -> Path:
    """ablation72-<gpu>.md beside the JSON: the machine, date, commit and commands, the figures so far, and compare's
    answer as it printed it."""
    try:
        header = json.loads((ctx.out / "gpu-acceptance.json").read_text())
    except (OSError, ValueError):  # the stage run on its own, without acceptance.py's JSON
        header = {"device": str(ctx.device), "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    path = ctx.out / f"ablation72-{'smoke' if ctx.smoke else device_slug(header.get('device', 'gpu'))}.md"
    rows = [f"| `{name}` | {json.dumps(got['value'])} | {got['detail']} |" for name, got in ctx.results.items()]
    text = "\n".join([
        f"# The 72-run ablation on {header.get('device')}{' (smoke: tiny runs on the CPU)' if ctx.smoke else ''}", "",
        f"{header.get('device')}; torch {header.get('torch')}, CUDA {header.get('cuda')}; commit {header.get('commit')}"
        f"{' (with uncommitted changes)' if header.get('uncommitted_changes') else ''}; {header.get('started')}.", "",
        f"Command: `{header.get('command', SCRIPT + ' --stage ablation72')}`, which runs `{command}` and then "
        "`normlab compare` on its sweep dir.", "",
        "| figure | value | detail |", "| --- | --- | --- |", *rows, "",
        "## The answer (`normlab compare`)", "", "```text", answer, "```", "",
        "compare's report dir (report.md, arms.csv, runs.csv, the plots) is ablation72-report.tar.gz beside this record.",
        ""])
    path.write_text(text)
    return path
