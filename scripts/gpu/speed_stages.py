"""The stages that time training steps: normlab beside a hand-written reference loop (GPT-2 small's shape, the
medium preset with CUDA graphs), telemetry's cost, and deterministic=true's cost and exact resume."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from types import SimpleNamespace
from typing import Any

from gpu_stage import SCRIPT, TIMING, Context, normlab_env

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


