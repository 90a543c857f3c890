"""One telemetry step beside the plain step before it, under torch.profiler: kernels launched, aten ops, device and
CPU time, and the ops that take the most of them.

    python scripts/bench/telemetry_profile.py [--shape medium] [--compile] [--precision bf16] [--out DIR] [--cpu]

A real normlab run of step_speed_gpu.py's shape (`medium`: the medium preset; `gpt2`: GPT-2 small's shape; `tiny`) with
telemetry every 10 steps and the step's figures read every step; steps 9 (plain), 10 (telemetry) and 11 (the step
that reads and writes the telemetry step's row: normlab.train.rows) are profiled, each from its start to its end,
the device synchronized at both. Printed, and with --out written to
DIR/telemetry-profile-<shape>-<eager|compile>.txt: per step the CUDA kernels launched, the aten ops dispatched
(nested ones counted), the kernels' total time, the CPU time the profiler saw (self time summed) and the step's
wall time, and the telemetry step's figures with what the step after it adds (step 10 + step 11 − step 9); then the telemetry step's table by self device time, and on CUDA a second by self CPU time (the host's
time: aten ops and CUDA's runtime calls, launches, allocations and synchronizations); on the CPU (`--cpu` or without
CUDA, where it runs fp32) one table by self CPU time. Last, what the telemetry step runs more than the plain step,
event by event (calls, self CPU and device time added), most calls first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from normlab.train.callbacks import Callback  # noqa: E402

PLAIN, TELEMETRY, AFTER = 9, 10, 11  # with telemetry every 10 steps


class StepProfiler(Callback):
    """torch.profiler around the steps `steps`, from their start to their end, the device synchronized."""

    name = "step_profiler"

    def __init__(self, steps: tuple[int, ...], device: torch.device):
        self.steps, self.device = steps, device
        self.profiles: dict[int, tuple[torch.profiler.profile, float]] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_step_start(self, state) -> None:
        if state.step in self.steps:
            self._sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities)
            self.profile.__enter__()
            self.started = time.perf_counter()

    def on_step_end(self, state, record) -> None:
        if state.step - 1 in self.steps:
            self._sync()
            wall = time.perf_counter() - self.started
            self.profile.__exit__(None, None, None)
            self.profiles[state.step - 1] = (self.profile, wall)


def step_figures(profile: torch.profiler.profile, wall: float) -> dict[str, float]:
    """A profiled step's kernels, aten ops, kernel time (ms), CPU time seen (ms) and wall time (ms)."""
    events = profile.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"kernels": kernels, "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
            "device_ms": sum(e.self_device_time_total for e in events) / 1e3,
            "cpu_ms": sum(e.self_cpu_time_total for e in events) / 1e3, "wall_ms": 1e3 * wall}


def added_events(plain, telemetry, rows: int = 30) -> list[str]:
    """The events (aten ops, kernels, CUDA runtime calls) the telemetry step has more of than the plain step, most
    calls first: where its added host and device time go, op by op."""
    before = {e.key: e for e in plain}
    added = []
    for e in telemetry:
        b = before.get(e.key)
        calls = e.count - (b.count if b else 0)
        cpu = (e.self_cpu_time_total - (b.self_cpu_time_total if b else 0)) / 1e3
        device = (e.self_device_time_total - (b.self_device_time_total if b else 0)) / 1e3
        if calls > 0 or cpu > 0.05:
            added.append((calls, cpu, device, e.key))
    added.sort(key=lambda row: (-row[0], -row[1]))
    return [f"{calls:+7d} calls  {cpu:+8.3f} CPU  {device:+8.3f} device  {key[:90]}" for calls, cpu, device, key in added[:rows]]


def profile_telemetry_step(shape: str, compiled: bool, precision: str, device: torch.device) -> tuple[dict, str]:
    """The figures of the plain and the telemetry step ({'plain': ..., 'telemetry': ...}) and the report's text."""
    import step_speed
    import step_speed_gpu
    from normlab.train.run import train

    overrides = [*step_speed_gpu.SHAPES[shape], f"device={device.type}",
                 f"precision={precision}", f"compile={str(compiled).lower()}", "telemetry.every=10", "log_every=1",
                 f"max_steps={AFTER + 2}", "eval_every=0", "eval_batches=1", "progress=false", "ckpt.every=0",
                 "wandb.mode=disabled"]
    cfg = step_speed.compose(overrides)
    torch._dynamo.reset()
    profiler = StepProfiler((PLAIN, TELEMETRY, AFTER), device)
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, run_dir, sinks=[], callbacks=[profiler])
    steps = {name: step_figures(*profiler.profiles[step]) for name, step in
             (("plain", PLAIN), ("telemetry step", TELEMETRY), ("after it", AFTER))}
    # What telemetry costs: its step, and what the step after it adds by reading the row
    figures = {"plain": steps["plain"], "telemetry": {key: value + steps["after it"][key] - steps["plain"][key]
                                                      for key, value in steps["telemetry step"].items()}}
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    lines = [f"{shape} ({' '.join(overrides[:5])}), {'compiled' if compiled else 'eager'}: step {PLAIN} (plain) and "
             f"step {TELEMETRY} (telemetry), {device.type}; the telemetry step's row is read and written in step "
             f"{AFTER}, whose figures less the plain step's count in the telemetry line"]
    for name, f in (*figures.items(), (f"  step {TELEMETRY}", steps["telemetry step"]), (f"  step {AFTER}", steps["after it"])):
        lines.append(f"{name:<10} kernels {f['kernels']:>6}  aten ops {f['aten_ops']:>6}  kernel time {f['device_ms']:8.3f} ms"
                     f"  CPU time seen {f['cpu_ms']:8.3f} ms  wall {f['wall_ms']:8.3f} ms")
    events = profiler.profiles[TELEMETRY][0].key_averages()
    lines += ["", f"telemetry step, by {sort}:", events.table(sort_by=sort, row_limit=40)]
    lines += ["", "what the telemetry step runs more than the plain step (calls; CPU and device self time, ms):",
              *added_events(profiler.profiles[PLAIN][0].key_averages(), events)]
    if device.type == "cuda":  # where the host's time goes: aten ops and CUDA's runtime calls (launches, mallocs, syncs)
        lines += ["", "telemetry step, by self_cpu_time_total:", events.table(sort_by="self_cpu_time_total", row_limit=40)]
    return figures, "\n".join(lines)


def acceptance_figure(ctx, capture: str) -> None:
    """The GPU acceptance's telemetry stage (scripts/gpu/speed_stages.py, `ctx` its Context): one medium-preset
    telemetry step profiled (the tiny shape with smoke), its report written beside the JSON, its added kernels
    reported as a figure."""
    figures, text = profile_telemetry_step("tiny" if ctx.smoke else "medium", capture == "compile", ctx.precision,
                                           ctx.device)
    path = ctx.out / f"telemetry-profile-medium-{capture}.txt"
    path.write_text(text + "\n")
    plain, step = figures["plain"], figures["telemetry"]
    unit = "aten ops (smoke: the CPU launches no kernels)" if ctx.smoke else "kernels"
    key = "aten_ops" if ctx.smoke else "kernels"
    ctx.report(f"telemetry_step_added_kernels_{capture}", step[key] - plain[key],
               f"{'smoke, CPU, the tiny shape' if ctx.smoke else 'medium preset'}, {capture}: {unit} of the telemetry step "
               f"{step[key]}, of the plain step before it {plain[key]}; kernel time {step['device_ms']:.2f} ms against "
               f"{plain['device_ms']:.2f}, CPU time seen {step['cpu_ms']:.1f} ms against {plain['cpu_ms']:.1f}, wall "
               f"{step['wall_ms']:.1f} ms against {plain['wall_ms']:.1f}; the profile: {path.name} beside this JSON",
               f"the plain step: {plain[key]} {unit}",
               f"python scripts/bench/telemetry_profile.py --shape medium{' --compile' if capture == 'compile' else ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="medium", choices=("medium", "gpt2", "tiny"))
    parser.add_argument("--compile", action="store_true", help="compile=true")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--out", type=Path, default=None, help="write the report into this directory")
    parser.add_argument("--cpu", action="store_true", help="on the CPU, even where CUDA is")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    precision = args.precision if device.type == "cuda" else "fp32"
    _, text = profile_telemetry_step(args.shape, args.compile, precision, device)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"telemetry-profile-{args.shape}-{'compile' if args.compile else 'eager'}.txt"
        (args.out / name).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
