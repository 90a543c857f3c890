"""The stages that run other commands and count what they report: the test suite and torchrun."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

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


def suite(ctx: Context) -> None:
    """tests/test_cuda.py first (`-n 0`), then the rest of `python -m pytest -q`; the figures count both. Each
    part reports as it ends; a stage cut off while the rest runs reports what the rest reached (its progress
    line), marked not met. With smoke the rest is tests/test_schedule.py alone."""
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    first = subprocess.run([*run, "-n", "0", "tests/test_cuda.py"], cwd=ROOT, capture_output=True, text=True)
    print(first.stdout[-20000:], first.stderr[-5000:], sep="\n", flush=True)
    lines = first.stdout.strip().splitlines()
    cuda = pytest_counts(lines)
    if not cuda:
        raise RuntimeError(f"pytest tests/test_cuda.py exited {first.returncode} without its summary line: "
                           f"{' '.join(lines[-3:])[-300:]}")
    names = [line.split(" ")[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    rest = ["-n", "0", "tests/test_schedule.py"] if ctx.smoke else ["--ignore", "tests/test_cuda.py"]
    command = f"python -m pytest -q -n 0 tests/test_cuda.py; python -m pytest -q {' '.join(rest)}"
    scope = "smoke: the rest is tests/test_schedule.py alone; " if ctx.smoke else ""
    cuda_text = f"tests/test_cuda.py: {lines[-1].strip('= ')}"
    report_suite(ctx, cuda, names, f"{scope}{cuda_text}; the rest not reached", command, done=False)
    log_path = ctx.workdir / "rest.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*run, *rest], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

        def cut_off(signum, frame):  # the driver's stop: pytest (same process group) got the signal too
            proc.wait()
            counts, percent = pytest_progress(log_path.read_text().splitlines())
            report_suite(ctx, add(cuda, counts), names, f"{scope}{cuda_text}; the rest cut off by "
                         f"{signal.Signals(signum).name} at {percent}% of its tests: {counts}", command, done=False)
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, cut_off)
        proc.wait()
    lines = log_path.read_text().strip().splitlines()
    print("\n".join(lines[-200:]), flush=True)
    counts = pytest_counts(lines)
    if not counts:
        raise RuntimeError(f"pytest exited {proc.returncode} without its summary line: {' '.join(lines[-3:])[-300:]}")
    names += [line.split(" ")[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    report_suite(ctx, add(cuda, counts), names, f"{scope}{cuda_text}; the rest: {lines[-1].strip('= ')}", command)


def add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in {*a, *b}}


def report_suite(ctx: Context, counts: dict[str, int], names: list[str], detail: str, command: str,
                 done: bool = True) -> None:
    failed = counts.get("failed", 0) + counts.get("error", 0)
    detail += f"; first failures: {', '.join(names[:5])}" if names else ""
    ctx.report("suite_failed", failed, detail, None, command, ok=done)
    ctx.report("suite_passed", counts.get("passed", 0), detail, None, command, ok=done)


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


