"""The stages that run other commands and count what they report: tests/test_cuda.py, the rest of the test suite,
and torchrun."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

from gpu_stage import ROOT, Context, normlab_env

PROGRESS = re.compile(r"^([.sFExX]+)\s*(?:\[\s*(\d+)%\])?$")


def pytest_counts(lines: list[str]) -> dict[str, int]:
    """passed, failed, error(s), skipped of pytest's summary line (the last), {} without one."""
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
            for n, kind in re.findall(r"(\d+) (failed|passed|errors?|skipped)", lines[-1] if lines else "")}


def pytest_progress(lines: list[str]) -> tuple[dict[str, int], int | None]:
    """What pytest -q's progress lines show so far (a run cut off before its summary): counts by outcome, and
    the last percentage printed."""
    chars, percent = "", None
    for line in lines:
        match = PROGRESS.match(line.strip())
        if match:
            chars += match.group(1)
            percent = int(match.group(2)) if match.group(2) else percent
    return {"passed": chars.count("."), "failed": chars.count("F"), "error": chars.count("E"),
            "skipped": chars.count("s")}, percent


def pytest_stage(ctx: Context, prefix: str, args: list[str], scope: str = "") -> float | None:
    """`python -m pytest -q ARGS`, its output in the stage's log: the failed (with errors) and passed tests reported
    as `prefix`_failed and `prefix`_passed; its wall time returned. Stopped by the driver (SIGTERM: pytest, in the
    same process group, got it too), it reports what the progress lines reached, marked not met, and exits."""
    command = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    text = " ".join(command)
    log_path = ctx.workdir / f"{prefix}.log"
    started = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

        def cut_off(signum, frame):
            proc.wait()
            counts, percent = pytest_progress(log_path.read_text().splitlines())
            report_counts(ctx, prefix, counts, [], f"{scope}cut off by {signal.Signals(signum).name} at {percent}% of "
                          f"its tests: {counts}", text, done=False)
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, cut_off)
        proc.wait()
    wall = time.perf_counter() - started
    lines = log_path.read_text().strip().splitlines()
    print("\n".join(lines[-300:]), flush=True)
    counts = pytest_counts(lines)
    if not counts:
        raise RuntimeError(f"pytest exited {proc.returncode} without its summary line: {' '.join(lines[-3:])[-300:]}")
    names = [line.split(" ")[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    report_counts(ctx, prefix, counts, names, f"{scope}{lines[-1].strip('= ')}", text)
    return wall


def report_counts(ctx: Context, prefix: str, counts: dict[str, int], names: list[str], detail: str, command: str,
                  done: bool = True) -> None:
    failed = counts.get("failed", 0) + counts.get("error", 0)
    detail += f"; first failures: {', '.join(names[:5])}" if names else ""
    ctx.report(f"{prefix}_failed", failed, detail, None, command, ok=done)
    ctx.report(f"{prefix}_passed", counts.get("passed", 0), detail, None, command, ok=done)


DURATION = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+tests/test_cuda\.py::(\S+)")


def cuda_tests(ctx: Context) -> None:
    """tests/test_cuda.py alone, in one process (`-n 0`): its failed and passed tests, and its wall time, the
    command's start to its end (target <= 60 s on a GPU), with its slowest tests (pytest's --durations)."""
    wall = pytest_stage(ctx, "cuda_tests", ["-n", "0", "--durations=0", "tests/test_cuda.py"])
    lines = (ctx.workdir / "cuda_tests.log").read_text().splitlines()
    slowest = sorted(((float(m.group(1)), m.group(2)) for line in lines if (m := DURATION.match(line))), reverse=True)
    ctx.report("cuda_tests_wall_s", round(wall, 1), "the pytest command, start to end (its interpreter and imports "
               "included); slowest: " + (", ".join(f"{name} {seconds:.1f} s" for seconds, name in slowest[:4]) or "none"),
               None, "python -m pytest -q -n 0 --durations=0 tests/test_cuda.py")


def suite(ctx: Context) -> None:
    """The rest of `python -m pytest -q` (tests/test_cuda.py is stage cuda_tests'). With smoke,
    tests/test_schedule.py alone."""
    if ctx.smoke:
        pytest_stage(ctx, "suite", ["-n", "0", "tests/test_schedule.py"], "smoke: tests/test_schedule.py alone; ")
    else:
        pytest_stage(ctx, "suite", ["--ignore", "tests/test_cuda.py"])


def torchrun(ctx: Context) -> None:
    """`torchrun --nproc_per_node=2 -m normlab train device=cpu model=tiny` (gloo) on this host."""
    run = ctx.run_overrides({"device": "cpu", "model": "tiny"}, smoke={"max_steps": 20})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "normlab",
               "train", *run, "progress=false", f"hydra.run.dir={ctx.workdir / 'run'}"]
    proc = subprocess.run(command, env=normlab_env(ctx))
    summary_path = ctx.workdir / "run" / "summary.json"
    status = json.loads(summary_path.read_text())["status"] if summary_path.exists() else "no summary.json"
    ctx.report("torchrun_cpu2_ok", proc.returncode == 0 and status == "completed",
               f"exit code {proc.returncode}, status {status}", None,
               f"torchrun --standalone --nproc_per_node=2 -m normlab train {' '.join(run)}")


