"""The stages of scripts/gpu/acceptance.py, in the order they run: what each measures, its figures, targets and
budgets. The stages themselves are in speed_stages.py, sweep_stages.py and suite_stages.py; what they share (Stage,
Figure, Context) in gpu_stage.py.
"""

from __future__ import annotations

from gpu_stage import Figure, Stage
from speed_stages import deterministic, gpt2, medium_graphs, telemetry
from suite_stages import suite, torchrun
from sweep_stages import ablation72, pack21, sweep8


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
