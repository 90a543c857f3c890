"""Sweep throughput of hydra/launcher=normlab: one sweep at several jobs per GPU, timed, results compared.

    python scripts/bench/sweep_throughput.py [--per-gpu 1,2,4,8] [--mps false,true] [OVERRIDE ...]

Default sweep: the GPU acceptance's 8-arm `norm=none,layer,rms,batch placement=pre,post model=medium max_steps=300`
(on one H100: 106 s one job at a time; the target is <= 20 s). Each setting runs as the real command
with `hydra.launcher.jobs_per_gpu=K`; the script prints its wall time, the jobs' own time in train()
(summary.json's wall_time_s) and the overhead around it per job, and checks that every setting's final
validation losses equal the first setting's (same jobs, seeds and batches). `--mps false,true` times each
setting without and with NVIDIA MPS (hydra.launcher.mps; a setting of one job per GPU never uses it). Set CUDA_VISIBLE_DEVICES to
choose the GPUs (e.g. 0 then 0,1 for the scaling over GPUs). Without a GPU the launcher runs the
jobs one after another whatever K, so use `hydra.launcher.cpu_jobs=K` overrides there instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from startup import normlab_command, script_env

from normlab.launch.sweep_log import phase_totals

SWEEP = ["norm=none,layer,rms,batch", "placement=pre,post", "model=medium", "max_steps=300"]


def run_sweep(normlab: list[str], overrides: list[str], sweep_dir: Path, timeout: float | None = None,
              log: Path | None = None) -> tuple[float, dict[str, dict]]:
    """Wall seconds of the sweep command, and each job's summary.json by run name. Its output goes to `log` (appended;
    else stdout is dropped and stderr passed on). A command still running after `timeout` seconds is stopped as a
    scheduler stops one (SIGTERM, which its running jobs take as a preemption; SIGKILL 30 s later): its jobs that did
    not finish then show in their summaries (or their absence). A command that exits non-zero of itself (a refused
    config) raises CalledProcessError; failed jobs do not make a sweep exit non-zero."""
    import signal
    import subprocess

    start = time.perf_counter()
    with open(log, "ab") if log else open(os.devnull, "wb") as out:
        proc = subprocess.Popen([*normlab, "train", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"], env=script_env(),
                                stdout=out, stderr=subprocess.STDOUT if log else None)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = 0
    if code:
        raise subprocess.CalledProcessError(code, proc.args)
    wall = time.perf_counter() - start
    jobs = {}
    for path in sweep_dir.rglob("summary.json"):
        if "wandb" not in path.parts:
            summary = json.loads(path.read_text())
            jobs[summary["name"]] = summary
    return wall, jobs


def runs_by_name(sweep_dir: Path) -> dict[str, list[dict]]:
    """Each job's metrics.jsonl rows, by its run name (summary.json's), under a sweep dir."""
    out = {}
    for summary in sweep_dir.rglob("summary.json"):
        if "wandb" not in summary.parts:
            name = json.loads(summary.read_text())["name"]
            out[name] = [json.loads(line) for line in (summary.parent / "metrics.jsonl").open()]
    return out


def unfinished(jobs: dict[str, dict], expected: int, what: str) -> str | None:
    """How many of a sweep's `expected` runs did not finish (diverged is an outcome, not a failure), with the
    first one's error (by run name); None when every one finished."""
    bad = [summary for _, summary in sorted(jobs.items()) if summary.get("status") not in ("completed", "diverged")]
    missing = max(0, expected - len(jobs))
    if not bad and not missing:
        return None
    how = sorted({str(s.get("status")) for s in bad} | ({"wrote no summary.json"} if missing else set()))
    first = next((s["error"] for s in bad if s.get("error")), None)
    return f"{len(bad) + missing} of {len(jobs) + missing} {what} {'/'.join(how)}" + (f": {first}" if first else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="normlab overrides (default: the 8-arm medium sweep)")
    parser.add_argument("--per-gpu", default="1,2,4,8", help="jobs_per_gpu settings to time, comma-separated")
    parser.add_argument("--mps", default="auto", help="hydra.launcher.mps settings to time, comma-separated "
                                                      "(auto, true, false)")
    args = parser.parse_args()
    normlab = normlab_command()
    overrides = args.overrides or SWEEP
    reference = None
    print(f"sweep: {' '.join(overrides)}; CUDA_VISIBLE_DEVICES={script_env().get('CUDA_VISIBLE_DEVICES', '(all)')}")
    with tempfile.TemporaryDirectory() as tmp:
        # Warm the token cache and the kernels' first-use costs out of the timings.
        run_sweep(normlab, [o.split(",")[0] for o in overrides] + ["max_steps=2"], Path(tmp) / "warm")
        settings = [(int(k), mps) for mps in args.mps.split(",") for k in args.per_gpu.split(",")]
        for k, mps in settings:
            if k == 1 and mps == "true" and (1, "false") in settings:
                continue  # one job per GPU: MPS changes nothing
            wall, jobs = run_sweep(normlab, [*overrides, f"hydra.launcher.jobs_per_gpu={k}", f"hydra.launcher.mps={mps}"],
                                   Path(tmp) / f"k{k}-{mps}")
            losses = {name: s["final_val_loss"] for name, s in jobs.items()}
            reference = reference or losses
            in_train = sum(s["wall_time_s"] for s in jobs.values())
            same = "equal" if losses == reference else f"DIFFER from {settings[0]}"
            statuses = sorted({s["status"] for s in jobs.values()})
            print(f"jobs_per_gpu={k} mps={mps}: {wall:6.1f} s wall for {len(jobs)} jobs ({', '.join(statuses)}); "
                  f"{in_train:6.1f} s of job time in train(); final val losses {same}", flush=True)
            if totals := phase_totals(list(jobs.values())):  # the sweep's own closing line (a pack counted once)
                print(f"  {totals}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
