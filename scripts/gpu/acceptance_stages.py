"""The stages of scripts/gpu/acceptance.py: what each measures, its figures, targets and budgets.

Each stage runs in a process of its own (gpu_acceptance.py starts it) and reports its figures one by one
through `Context.report`, which rewrites the stage's result file at once, so a stage cut off at its budget
keeps the figures it reached. On one CUDA GPU a stage measures at the issue's sizes; with `smoke` it runs
the same code at a tiny size on the CPU (bf16 where the CPU has native bf16, else fp32; no CUDA graphs).
Ratios are measured beside their reference in the same process or the same stage.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # the benchmark scripts the stages run
SCRIPT = "python scripts/gpu/acceptance.py"
# Keys of metrics.jsonl rows and summary.json that are times, not results: they differ between any two runs.
TIMING = ("tokens_per_s", "train_time_s", "wall_time_s", "eval_time_s", "resumed_from_step", "phases")
# What --smoke changes in a `normlab train` command: a 2-block, 32-wide model, 4 × 16 tokens, a few steps, the CPU,
# no wandb (an offline wandb run costs a job a second or two, and the packed sweep has 21).
SMOKE_RUN = {"model": "tiny", "batch_size": "4", "seq_len": "16", "eval_batches": "1", "max_steps": "4",
             "device": "cpu", "wandb.mode": "disabled"}


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str
    target: str | None  # "<op> <number or true>" on one H100, e.g. ">= 1.0"; None: reported, no target


@dataclass(frozen=True)
class Stage:
    name: str
    figures: tuple[Figure, ...]
    budget_s: float  # wall-clock seconds on one H100 or H200 (STAGES says what they rest on)
    smoke_budget_s: float  # on the 2-core CPU, tiny sizes: a cap for a hang (a cold torch.compile takes minutes there under load)
    run: Callable[["Context"], None]
    what: str


class Context:
    """What a stage sees: smoke or not, its device and precision, a scratch dir, the directory of the run's JSON
    (`out`, for files kept beside it), and `report`."""

    def __init__(self, smoke: bool, result_path: Path, workdir: Path, out: Path | None = None):
        self.smoke, self.result_path, self.workdir = smoke, result_path, workdir
        self.out = workdir if out is None else out
        self.results: dict[str, dict[str, Any]] = {}

    @functools.cached_property
    def device(self):
        """torch's device (torch is imported here, on first use: the stages that only start commands skip it)."""
        import torch

        if self.smoke:  # tiny steps gain nothing from a second thread, and on a shared CPU extra threads oversubscribe it
            torch.set_num_threads(1)
        return torch.device("cpu" if self.smoke else "cuda")

    @functools.cached_property
    def precision(self) -> str:
        return "bf16" if not self.smoke or cpu_has_bf16() else "fp32"

    def report(self, name: str, value: Any, detail: str, reference: str | None = None, command: str | None = None,
               ok: bool = True) -> None:
        """One figure measured; `ok=False` marks it not met whatever its value (e.g. its losses differ)."""
        from normlab.util.files import write_json_atomic

        self.results[name] = {"value": value, "detail": detail, "reference": reference, "command": command, "ok": ok}
        write_json_atomic(self.result_path, self.results)
        print(f"gpu_acceptance: {name} = {value}  ({detail})", flush=True)

    def run_overrides(self, keys: dict[str, Any], smoke: dict[str, Any] | None = None) -> list[str]:
        """`normlab train` overrides: `keys` on a GPU; with smoke, SMOKE_RUN's tiny size on the CPU in place of
        `keys`' size, then `smoke`'s keys."""
        if self.smoke:
            keys = {**SMOKE_RUN, **{k: v for k, v in keys.items() if k not in SMOKE_RUN}, **(smoke or {})}
        return [f"{k}={v}" for k, v in keys.items()]


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (oneDNN's check: AVX-512 BF16 or AMX)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# ----------------------------------------------------------------------------- timing normlab beside the reference


def step_medians(ctx: Context, shape: str, names: list[str], every: int, windows: int, rounds: int) -> tuple[dict, Any]:
    """Median seconds per step of each step_speed_gpu.py variant (`ref eager`, `normlab compile telemetry/10`, ...),
    interleaved round after round in this process, and the config of the last."""
    import step_speed_gpu

    args = SimpleNamespace(precision=ctx.precision, every=every, windows=windows)
    overrides = [*step_speed_gpu.SHAPES["tiny" if ctx.smoke else shape], *(["batch_size=8"] if ctx.smoke else [])]
    steps: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            out = step_speed_gpu.run_variant(name, overrides, args, ctx.device)
            steps[name] += out["step_s"]
    return {name: statistics.median(s) for name, s in steps.items()}, out["cfg"]


def shape_text(ctx: Context, cfg) -> str:
    return (f"{'smoke, CPU: ' if ctx.smoke else ''}{cfg.depth}×{cfg.model.d_model}, T {cfg.seq_len}, B {cfg.batch_size}, "
            f"{cfg.precision}")


def gpt2(ctx: Context) -> None:
    """GPT-2 small's shape: normlab's tokens/s over the hand-written reference's, eager and compiled; MFU."""
    import torch

    import step_speed
    from normlab.nn.flops import model_flops_per_token

    peak = step_speed.peak_matmul_flops(torch.bfloat16 if ctx.precision == "bf16" else torch.float32, ctx.device,
                                   256 if ctx.smoke else 8192)
    every, windows = (2, 2) if ctx.smoke else (10, 3)
    for capture in ("eager", "compile"):
        step, cfg = step_medians(ctx, "gpt2", [f"ref {capture}", f"normlab {capture}"], every, windows, 1)
        ref, ours = (cfg.batch_size * cfg.seq_len / step[f"{loop} {capture}"] for loop in ("ref", "normlab"))
        command = f"{SCRIPT} --stage gpt2  (python scripts/bench/step_speed_gpu.py --shapes gpt2 --only 'ref {capture},normlab {capture}')"
        ctx.report(f"gpt2_{capture}_vs_ref", round(ours / ref, 4),
                   f"{shape_text(ctx, cfg)}: normlab {ours:.0f} tokens/s, reference {ref:.0f}; {windows} windows "
                   f"of {every} steps after a warm-up window", f"hand-written GPT of scripts/bench/step_speed.py, {capture}: "
                   f"{ref:.0f} tokens/s", command)
    mfu = ours * model_flops_per_token(cfg) / peak
    ctx.report("gpt2_compile_mfu", round(100 * mfu, 2), f"normlab compiled, {ours:.0f} tokens/s × "
               f"{model_flops_per_token(cfg) / 1e6:.2f} MFLOP/token over the measured {ctx.precision} matmul peak",
               f"{ctx.precision} matmul peak measured here: {peak / 1e9:.1f} GFLOP/s", command)


def medium_graphs(ctx: Context) -> None:
    """The medium preset with compile=true compile_mode=reduce-overhead, beside a CUDA-graph reference loop."""
    capture = "compile" if ctx.smoke else "cudagraph"  # the CPU has no CUDA graphs: compile alone
    every, windows, rounds = (2, 2, 1) if ctx.smoke else (10, 5, 2)
    step, cfg = step_medians(ctx, "medium", [f"ref {capture}", f"normlab {capture}"], every, windows, rounds)
    ref, ours = (cfg.batch_size * cfg.seq_len / step[f"{loop} {capture}"] for loop in ("ref", "normlab"))
    command = (f"{SCRIPT} --stage medium_graphs  (normlab train model=medium compile=true "
               f"compile_mode={'default' if ctx.smoke else 'reduce-overhead'})")
    detail = f"{shape_text(ctx, cfg)}, {capture}" + ("; smoke: compile_mode=default, no CUDA graphs" if ctx.smoke else "")
    ctx.report("medium_graphs_tokens_per_s", round(ours), detail, None, command)
    ctx.report("medium_graphs_vs_ref", round(ours / ref, 4), f"{detail}: normlab {ours:.0f} tokens/s, reference {ref:.0f}",
               f"hand-written GPT of scripts/bench/step_speed.py, {capture}: {ref:.0f} tokens/s", command)


def telemetry(ctx: Context) -> None:
    """Step time with telemetry at its default interval over the step time without, minus 1: the medium preset eager
    and compiled, GPT-2 small's shape eager; then one telemetry step of the medium preset profiled beside the plain
    step before it, eager and compiled, each profile written beside the JSON."""
    from normlab.config import TelemetryConfig

    every = TelemetryConfig().every
    command = f"{SCRIPT} --stage telemetry  (python scripts/bench/step_speed_gpu.py --shapes {{shape}} --every {every})"
    for shape, capture, (windows, rounds) in (("medium", "eager", (4, 2)), ("medium", "compile", (4, 2)),
                                              ("gpt2", "eager", (2, 1))):
        windows, rounds = (1, 1) if ctx.smoke else (windows, rounds)
        names = [f"normlab {capture}", f"normlab {capture} telemetry/{every}"]
        step, cfg = step_medians(ctx, shape, names, every, windows, rounds)
        off, on = step[names[0]], step[names[1]]
        ctx.report(f"telemetry_overhead{'_gpt2' if shape == 'gpt2' else ''}_{capture}", round(100 * (on / off - 1), 2),
                   f"{shape_text(ctx, cfg)}: {1e3 * on:.2f} ms/step with telemetry every {every} steps, {1e3 * off:.2f} "
                   f"without; windows of {every} steps (one telemetry step each), {rounds} interleaved rounds",
                   f"the same run without telemetry: {1e3 * off:.2f} ms/step", command.format(shape=shape))
    import telemetry_profile

    for capture in ("eager", "compile"):
        telemetry_profile.acceptance_figure(ctx, capture)


# ----------------------------------------------------------------------------- the command line: sweeps and runs


def normlab_env(ctx: Context) -> dict[str, str]:
    from startup import script_env

    return {**script_env(), "OMP_NUM_THREADS": "1"} if ctx.smoke else script_env()  # one thread: bit-exact CPU reductions


def largest_difference(a: list[dict], b: list[dict], keys: tuple[str, ...]) -> float:
    """The largest relative difference of `keys` between rows of the same step (inf if the steps differ)."""
    rows_b = {r["step"]: r for r in b}
    if [r["step"] for r in a] != list(rows_b):
        return float("inf")
    worst = 0.0
    for row in a:
        for key in (k for k in keys if k in row):
            want, got = rows_b[row["step"]].get(key), row[key]
            worst = max(worst, float("inf") if want is None else abs(got - want) / max(abs(want), 1e-30))
    return worst


def sweep_wall(wall: float, jobs: dict[str, dict], expected: int, what: str) -> tuple[float | None, str]:
    """A sweep's wall time and the start of its detail: null, and why, where a run did not finish."""
    from sweep_throughput import unfinished

    if why := unfinished(jobs, expected, what):
        return None, f"{why}; the command took {wall:.2f} s, not a valid figure"
    return round(wall, 2), f"{len(jobs)} {what} ({', '.join(sorted({s['status'] for s in jobs.values()}))})"


def sweep8(ctx: Context) -> None:
    """The 8-arm medium sweep, command to closing table, default launcher; two of its arms run one after another."""
    from startup import normlab_command
    from sweep_throughput import SWEEP, run_sweep, unfinished

    keys = dict(o.split("=", 1) for o in SWEEP)
    overrides = ctx.run_overrides(keys)
    normlab = normlab_command()
    wall, jobs = run_sweep(normlab, overrides, ctx.workdir / "sweep8")
    sample = ctx.run_overrides({**keys, "norm": "layer,rms", "placement": "pre", "hydra.launcher.jobs_per_gpu": 1})
    _, alone = run_sweep(normlab, sample, ctx.workdir / "sequential")
    value, detail = sweep_wall(wall, jobs, 8, "jobs")
    tolerance, diff = 0.0 if ctx.smoke else 1e-3, float("inf")  # a GPU run is not bit-exact without deterministic=true
    detail += f"; final val losses of {', '.join(alone)} run one after another (jobs_per_gpu=1): "
    why = "the sweep's jobs did not finish" if value is None else unfinished(alone, 2, "arms")
    if why:
        detail += f"not compared, {why}"
    else:
        diff = max(abs(jobs[n]["final_val_loss"] - s["final_val_loss"]) / abs(s["final_val_loss"]) for n, s in alone.items())
        detail += f"largest relative difference {diff:.2e} (tolerance {tolerance:g})"
    ctx.report("sweep8_wall_s", value, detail, "the same arms one after another (jobs_per_gpu=1): their final val losses",
               f"normlab train -m {' '.join(overrides)}", ok=diff <= tolerance)


def pack21(ctx: Context) -> None:
    """The 21-run lr × seed pack, command to closing table; two members against their unpacked runs in fp32."""
    from startup import normlab_command
    from sweep_throughput import run_sweep, runs_by_name, unfinished

    grid = {"norm": "layer", "placement": "pre", "model": "medium", "max_steps": 300,
            "lr": "3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1", "seed": "0,1,2", "pack": "true"}
    overrides = ctx.run_overrides(grid)
    normlab = normlab_command()
    wall, jobs = run_sweep(normlab, overrides, ctx.workdir / "pack21")
    # The docs' tolerance holds for fp32 over a few steps (docs/sweeps.md: 1e-5 on the CPU; tests/test_cuda.py: 1e-4
    # on a GPU without tf32), so the sample trains that way, packed and unpacked.
    # Stable lrs only: at lr 3e-2 training is chaotic, and any change of rounding (the kernels', or the thread
    # count's) grows from 1e-5 to a few per cent within 3 steps (docs/sweeps.md, "Where exactness ends").
    sample = ctx.run_overrides({**grid, "lr": "1e-3,3e-3", "seed": 1, "max_steps": 20, "log_every": 1,
                                "eval_every": 10, "precision": "fp32", "tf32": "false"})
    _, packed = run_sweep(normlab, sample, ctx.workdir / "packed")
    _, unpacked = run_sweep(normlab, [o for o in sample if o != "pack=true"], ctx.workdir / "unpacked")
    value, detail = sweep_wall(wall, jobs, 21, "members")
    tolerance, worst = 1e-5 if ctx.smoke else 1e-4, float("inf")
    steps = next(o.split("=")[1] for o in sample if o.startswith("max_steps="))
    detail += f"; members {', '.join(unpacked)} (fp32, {steps} steps) against their unpacked runs: "
    if why := unfinished(packed, 2, "packed members") or unfinished(unpacked, 2, "unpacked runs"):
        detail += f"not compared, {why}"
    else:
        rows, alone = runs_by_name(ctx.workdir / "packed"), runs_by_name(ctx.workdir / "unpacked")
        worst = max(largest_difference(rows[n], alone[n], ("loss", "grad_norm", "val_loss")) for n in unpacked)
        detail += f"largest relative difference of loss, grad_norm, val_loss {worst:.2e} (tolerance {tolerance:g})"
    ctx.report("pack21_wall_s", value, detail, "the sampled members unpacked, rows of every step",
               f"normlab train -m {' '.join(overrides)}", ok=worst <= tolerance)


# Issue 38's ablation: 4 norms x 2 placements x 3 lrs x 3 seeds of the medium preset, 500 steps (147M tokens).
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


def ablation72(ctx: Context) -> None:
    """The 72-run ablation as one sweep command (packs, concurrent on the GPU), then two of its runs one at a
    time: the sweep's wall time, and whether their final val losses agree."""
    from normlab.launch.sweep_log import phase_totals
    from startup import normlab_command
    from sweep_throughput import run_sweep, unfinished

    grid = {**ABLATION, **ABLATION_RUN}
    overrides = ctx.run_overrides(grid, smoke=ABLATION_SMOKE)
    normlab = normlab_command()
    wall, jobs = run_sweep(normlab, overrides, ctx.workdir / "ablation")
    expected = 8 if ctx.smoke else 72
    value, detail = sweep_wall(wall, jobs, expected, "runs")
    steps = int(dict(o.split("=", 1) for o in overrides)["max_steps"])
    tokens = sum(s.get("tokens") or 0 for s in jobs.values())
    detail += (f"; {tokens / 1e6:.1f}M tokens, {tokens / wall:,.0f} tokens/s over the whole command; "
               f"{phase_totals(list(jobs.values())) or 'no phases recorded'}")
    sample = ctx.run_overrides({**grid, "norm": "layer,rms", "placement": "pre", "lr": "3e-3", "seed": "1",
                                "pack": "false", "hydra.launcher.jobs_per_gpu": 2},
                               smoke={"norm": "layer,rms", "placement": "pre", "lr": "3e-3", "seed": "1", "max_steps": 4})
    _, alone = run_sweep(normlab, sample, ctx.workdir / "alone")
    tolerance, diff = (1e-5 if ctx.smoke else ABLATION_TOLERANCE), float("inf")
    if why := ("the sweep's runs did not finish" if value is None else unfinished(alone, 2, "runs")):
        detail += f"; runs one at a time not compared: {why}"
    elif missing := [n for n in alone if n not in jobs]:
        detail += f"; runs one at a time not compared: {', '.join(missing)} not in the sweep"
    else:
        diff = max(abs(jobs[n]["final_val_loss"] - s["final_val_loss"]) / abs(s["final_val_loss"]) for n, s in alone.items())
        detail += (f"; {', '.join(sorted(alone))} one at a time (pack=false, {steps} steps): largest relative "
                   f"difference of final val loss {diff:.2e} (tolerance {tolerance:g})")
    ctx.report("ablation72_wall_s", value, detail, "two of its runs one at a time: their final val losses",
               f"normlab train -m {' '.join(overrides)}", ok=diff <= tolerance)


def deterministic(ctx: Context) -> None:
    """deterministic=true: its step-time cost in one process, then a run stopped by SIGTERM after its first
    checkpoint and resumed, whose rows must equal those of the same run uninterrupted."""
    from normlab.train.runtime import CUBLAS_DETERMINISTIC

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]  # before the first matmul, as step_speed_gpu.py does
    names = ["normlab eager", "normlab eager deterministic"]
    step, cfg = step_medians(ctx, "medium", names, 10, *((1, 1) if ctx.smoke else (3, 2)))
    ctx.report("deterministic_cost", round(100 * (step[names[1]] / step[names[0]] - 1), 2),
               f"{shape_text(ctx, cfg)}, eager: {1e3 * step[names[1]]:.2f} ms/step with deterministic=true, "
               f"{1e3 * step[names[0]]:.2f} without (CUBLAS_WORKSPACE_CONFIG set for both)",
               f"deterministic=false: {1e3 * step[names[0]]:.2f} ms/step",
               f"{SCRIPT} --stage deterministic  (python scripts/bench/step_speed_gpu.py --shapes medium --deterministic)")
    run = ctx.run_overrides({"model": "medium", "deterministic": "true", "max_steps": 200, "ckpt.every": 50,
                             "ckpt.keep": 5, "eval_every": 100, "progress": "false", "wandb.mode": "disabled"},
                            smoke={"max_steps": 60, "ckpt.every": 10})
    equal, detail = resumed_equals_whole(ctx, run)
    ctx.report("deterministic_resume_equal", equal, detail, "the same run uninterrupted, in the same stage",
               f"normlab train {' '.join(run)}; SIGTERM after the first checkpoint; normlab resume <run dir>")


def resumed_equals_whole(ctx: Context, run: list[str]) -> tuple[bool | None, str]:
    """Two runs side by side, one uninterrupted and one stopped by SIGTERM once its first checkpoint exists,
    then resumed; whether their metrics rows (times aside) are equal, and what happened."""
    from startup import normlab_command

    normlab, env = normlab_command(), normlab_env(ctx)
    dirs = {name: ctx.workdir / name for name in ("whole", "stopped")}
    procs = {name: subprocess.Popen([*normlab, "train", *run, f"hydra.run.dir={d}"], env=env) for name, d in dirs.items()}
    try:
        while not list((dirs["stopped"] / "checkpoints").glob("step-*.pt")):
            if procs["stopped"].poll() is not None:
                return None, f"the run ended (exit code {procs['stopped'].returncode}) before its first checkpoint"
            time.sleep(0.005)
        procs["stopped"].send_signal(signal.SIGTERM)
        code = procs["stopped"].wait()
        summary = json.loads((dirs["stopped"] / "summary.json").read_text())
        if summary["status"] != "preempted":
            return None, f"the signal came too late: the run ended {summary['status']} (exit code {code})"
        subprocess.run([*normlab, "resume", str(dirs["stopped"])], env=env, check=True)
        procs["whole"].wait()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    rows = {name: [{k: v for k, v in json.loads(line).items() if k not in TIMING}
                   for line in (d / "metrics.jsonl").open()] for name, d in dirs.items()}
    differ = [w["step"] for w, s in zip(rows["whole"], rows["stopped"]) if w != s]
    same = len(rows["whole"]) == len(rows["stopped"]) and not differ
    return same, (f"stopped by SIGTERM at step {summary['preempted_step']} (exit code {code}), resumed; "
                  f"{len(rows['stopped'])} rows against {len(rows['whole'])}: "
                  + ("equal, every key but the times" if same else f"differ first at step {(differ or ['(count)'])[0]}"))


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


def figures(*specs: tuple[str, str, str | None]) -> tuple[Figure, ...]:
    return tuple(Figure(*spec) for spec in specs)


# The whole script no longer fits one device call (at most 600 s, of which a fresh machine's start takes about 30):
# `--call 1` and `--call 2` run these halves, each within 560 s of budgets.
CALLS = (("gpt2", "medium_graphs", "telemetry", "deterministic", "sweep8", "suite"), ("pack21", "ablation72", "torchrun"))

# In order of value per second, so that a cut-off run keeps most figures: the headline speed ratios first, the
# workflow figures next, the suite (long; its failures also show in the stages before) and torchrun's CPU path last.
# The budgets: the H200's stage times of 2026-11-26 (docs/benchmarks/gpu-h200.md) and 10 to 20% more, but where the
# H100's calls 3 and 4 (docs/benchmarks/gpu-h100.md) measured more: pack21's sweep took 62-82 s and its fp32 sample
# about 40 s more; the suite's tests/test_cuda.py alone ran past 90 s; the ablation's sweep took about 210 s with its
# BatchNorm packs failing at once, so with them, its two runs one at a time and its head, 400 s. Each call's budgets
# sum to at most 560 s, so a call's run and a device's start-up fit one 600 s call.
STAGES = (
    Stage("gpt2", figures(("gpt2_eager_vs_ref", "x", ">= 1.0"), ("gpt2_compile_vs_ref", "x", ">= 1.0"),
                          ("gpt2_compile_mfu", "%", None)), 92, 240, gpt2,
          "GPT-2 small's shape (12×768, T 1024, B 32, bf16): normlab over the hand-written reference, eager and compiled"),
    Stage("medium_graphs", figures(("medium_graphs_tokens_per_s", "tokens/s", ">= 900000"),
                                   ("medium_graphs_vs_ref", "x", ">= 0.95")), 74, 180, medium_graphs,
          "the medium preset, compile=true compile_mode=reduce-overhead, against a CUDA-graph reference loop"),
    Stage("telemetry", figures(("telemetry_overhead_eager", "%", "<= 3"), ("telemetry_overhead_compile", "%", "<= 3"),
                               ("telemetry_overhead_gpt2_eager", "%", "<= 3"),
                               ("telemetry_step_added_kernels_eager", "kernels", None),
                               ("telemetry_step_added_kernels_compile", "kernels", None)),
          90, 240, telemetry, "step time with telemetry every 10 steps over without, minus 1 (medium preset eager and "
          "compiled, GPT-2 small's shape eager); one telemetry step profiled"),
    Stage("deterministic", figures(("deterministic_resume_equal", "", "== true"), ("deterministic_cost", "%", None)),
          75, 150, deterministic, "deterministic=true: its cost, and a SIGTERM-stopped, resumed run against the whole"),
    Stage("sweep8", figures(("sweep8_wall_s", "s", "<= 20"),), 95, 150, sweep8,
          "the 8-arm medium sweep, command to closing table, default launcher"),
    Stage("pack21", figures(("pack21_wall_s", "s", "<= 30"),), 110, 150, pack21,
          "the 21-run lr × seed grid of the medium preset as one pack"),
    Stage("ablation72", figures(("ablation72_wall_s", "s", "<= 150"),), 400, 300, ablation72,
          "the 72-run ablation (4 norms x 2 placements x 3 lrs x 3 seeds, medium, 500 steps), packed, 4 packs at once"),
    Stage("suite", figures(("suite_failed", "tests", "== 0"), ("suite_passed", "tests", None)), 120, 120, suite,
          "the test suite on this machine, tests/test_cuda.py included"),
    Stage("torchrun", figures(("torchrun_cpu2_ok", "", "== true"),), 33, 120, torchrun,
          "two gloo ranks on the CPU under torchrun"),
)
