"""The stages that time training steps: normlab beside a hand-written reference loop (GPT-2 small's shape, the
medium preset with CUDA graphs), telemetry's cost, and deterministic=true's cost and exact resume.

Every timed figure rests on at least MIN_WINDOWS (20) timed windows per variant, on the device's clock (CUDA events;
perf_counter with smoke), variants interleaved round after round (scripts/bench/windows.py): its value is a ratio of
medians, and its JSON keeps each variant's median, quartiles and raw per-window times. An overhead figure (telemetry,
deterministic=true) also times its base variant twice (A, A', B, A, A', B, ...): the A/A difference, in the figure's
unit, is its noise floor (`control`), and acceptance.py writes a figure whose control exceeds its target inconclusive.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from types import SimpleNamespace
from typing import Any

from gpu_stage import SCRIPT, TIMING, Context, normlab_env

# (rounds, timed windows per run) on a GPU and with smoke: 2 x 10 = MIN_WINDOWS windows per variant either way.
ROUNDS, WINDOWS = 2, 10


def timed_variants(ctx: Context, shape: str, names: list[str], every: int) -> tuple[dict[str, list[float]], Any]:
    """Each step_speed_gpu.py variant's per-window seconds per step (`ref eager`, `normlab compile telemetry/10`,
    `normlab eager again`, ...), ROUNDS rounds of WINDOWS windows of `every` steps, interleaved round after round in
    this process; and the config of the last run. With smoke: the tiny model at 4 x 16 tokens."""
    import step_speed_gpu
    from windows import MIN_WINDOWS, interleaved

    assert ROUNDS * WINDOWS >= MIN_WINDOWS
    args = SimpleNamespace(precision=ctx.precision, every=every, windows=WINDOWS)
    overrides = [*step_speed_gpu.SHAPES["tiny" if ctx.smoke else shape], *(["batch_size=4", "seq_len=16"] if ctx.smoke else [])]
    last: dict[str, Any] = {}

    def run(name: str) -> list[float]:
        last.update(step_speed_gpu.run_variant(name, overrides, args, ctx.device))
        return last["step_s"]

    return interleaved(names, ROUNDS, run), last["cfg"]


def timing(ctx: Context, times: dict[str, list[float]]) -> dict[str, Any]:
    from windows import timing as kept

    return kept(times, "perf_counter" if ctx.smoke else "cuda events")


def shape_text(ctx: Context, cfg) -> str:
    return (f"{'smoke, CPU: ' if ctx.smoke else ''}{cfg.depth}×{cfg.model.d_model}, T {cfg.seq_len}, B {cfg.batch_size}, "
            f"{cfg.precision}")


def windows_text(every: int) -> str:
    return f"medians of {ROUNDS} interleaved rounds of {WINDOWS} windows of {every} steps, each after a warm-up window"


def vs_reference(ctx: Context, shape: str, capture: str, every: int) -> tuple[float, float, Any, dict, str]:
    """normlab's and the reference's tokens/s (medians) at `capture`, the config, their timing, and the detail."""
    from windows import describe

    names = [f"ref {capture}", f"normlab {capture}"]
    times, cfg = timed_variants(ctx, shape, names, every)
    ref, ours = (cfg.batch_size * cfg.seq_len / timing(ctx, times)["seconds_per_step"][name]["median"] for name in names)
    detail = (f"{shape_text(ctx, cfg)}, {capture}: normlab {ours:.0f} tokens/s, {describe(times[names[1]])}; reference "
              f"{ref:.0f} tokens/s, {describe(times[names[0]])}; {windows_text(every)}")
    return ours, ref, cfg, timing(ctx, times), detail


def gpt2(ctx: Context) -> None:
    """GPT-2 small's shape: normlab's tokens/s over the hand-written reference's, eager and compiled; MFU."""
    import torch

    import step_speed
    from normlab.nn.flops import model_flops_per_token

    peak = step_speed.peak_matmul_flops(torch.bfloat16 if ctx.precision == "bf16" else torch.float32, ctx.device,
                                        256 if ctx.smoke else 8192)
    every = 2 if ctx.smoke else 10
    for capture in ("eager", "compile"):
        ours, ref, cfg, kept, detail = vs_reference(ctx, "gpt2", capture, every)
        command = f"{SCRIPT} --stage gpt2  (python scripts/bench/step_speed_gpu.py --shapes gpt2 --only 'ref {capture},normlab {capture}')"
        ctx.report(f"gpt2_{capture}_vs_ref", round(ours / ref, 4), detail,
                   f"hand-written GPT of scripts/bench/step_speed.py, {capture}: {ref:.0f} tokens/s", command, timing=kept)
    mfu = ours * model_flops_per_token(cfg) / peak
    ctx.report("gpt2_compile_mfu", round(100 * mfu, 2), f"normlab compiled, {ours:.0f} tokens/s × "
               f"{model_flops_per_token(cfg) / 1e6:.2f} MFLOP/token over the measured {ctx.precision} matmul peak",
               f"{ctx.precision} matmul peak measured here: {peak / 1e9:.1f} GFLOP/s", command, timing=kept)


def medium_graphs(ctx: Context) -> None:
    """The medium preset with compile=true compile_mode=reduce-overhead, beside a CUDA-graph reference loop."""
    capture = "compile" if ctx.smoke else "cudagraph"  # the CPU has no CUDA graphs: compile alone
    ours, ref, cfg, kept, detail = vs_reference(ctx, "medium", capture, 2 if ctx.smoke else 10)
    command = (f"{SCRIPT} --stage medium_graphs  (normlab train model=medium compile=true "
               f"compile_mode={'default' if ctx.smoke else 'reduce-overhead'})")
    detail += "; smoke: compile_mode=default, no CUDA graphs" if ctx.smoke else ""
    ctx.report("medium_graphs_tokens_per_s", round(ours), detail, None, command, timing=kept)
    ctx.report("medium_graphs_vs_ref", round(ours / ref, 4), detail,
               f"hand-written GPT of scripts/bench/step_speed.py, {capture}: {ref:.0f} tokens/s", command, timing=kept)


def overhead_figure(ctx: Context, name: str, shape: str, base: str, treated: str, every: int, command: str,
                    what: str) -> None:
    """`treated`'s step time over `base`'s, minus 1, in per cent, beside the A/A control (`base` timed twice,
    interleaved: base, base again, treated, ...)."""
    from windows import again, describe, overhead

    times, cfg = timed_variants(ctx, shape, [base, again(base), treated], every)
    value, control = overhead(times, base, treated)
    detail = (f"{shape_text(ctx, cfg)}: {describe(times[treated])} {what}, {describe(times[base])} without, and "
              f"{describe(times[again(base)])} for the same run again (A/A: {control:+.2f}%); {windows_text(every)}")
    kept = timing(ctx, times)
    ctx.report(name, round(value, 2), detail, f"{base}: {1e3 * kept['seconds_per_step'][base]['median']:.2f} ms/step",
               command, control=round(control, 2), timing=kept)


def telemetry_overheads(ctx: Context, cases: tuple[tuple[str, str], ...]) -> None:
    """Step time with telemetry at its default interval (2 steps with smoke) over the step time without, minus 1, for
    each (shape, capture), beside its A/A control; windows of that interval, so that each holds one telemetry step."""
    from normlab.config import TelemetryConfig

    every = 2 if ctx.smoke else TelemetryConfig().every
    for shape, capture in cases:
        base, treated = f"normlab {capture}", f"normlab {capture} telemetry/{every}"
        command = (f"{SCRIPT} --stage {'telemetry_gpt2' if shape == 'gpt2' else 'telemetry'}  (python "
                   f"scripts/bench/step_speed_gpu.py --shapes {shape} --every {every} --aa --only "
                   f"'{base},{base} again,{treated}')")
        overhead_figure(ctx, f"telemetry_overhead{'_gpt2' if shape == 'gpt2' else ''}_{capture}", shape, base, treated,
                        every, command, f"with telemetry every {every} steps")


def telemetry(ctx: Context) -> None:
    """Telemetry's overhead for the medium preset, eager and compiled, each beside its A/A control; then one
    telemetry step of the medium preset profiled beside the plain step before it, eager and compiled, each profile
    written beside the JSON."""
    telemetry_overheads(ctx, (("medium", "eager"), ("medium", "compile")))
    import telemetry_profile

    for capture in ("eager", "compile"):
        telemetry_profile.acceptance_figure(ctx, capture)


def telemetry_gpt2(ctx: Context) -> None:
    """Telemetry's overhead at GPT-2 small's shape, eager, beside its A/A control."""
    telemetry_overheads(ctx, (("gpt2", "eager"),))


def deterministic(ctx: Context) -> None:
    """deterministic=true: its step-time cost in one process, then a run stopped by SIGTERM after its first
    checkpoint and resumed, whose rows must equal those of the same run uninterrupted."""
    from normlab.train.runtime import CUBLAS_DETERMINISTIC

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]  # before the first matmul, as step_speed_gpu.py does
    overhead_figure(ctx, "deterministic_cost", "medium", "normlab eager", "normlab eager deterministic", 2 if ctx.smoke else 10,
                    f"{SCRIPT} --stage deterministic  (python scripts/bench/step_speed_gpu.py --shapes medium --deterministic "
                    "--aa --only 'normlab eager,normlab eager again,normlab eager deterministic')",
                    "with deterministic=true (CUBLAS_WORKSPACE_CONFIG set for every variant)")
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


