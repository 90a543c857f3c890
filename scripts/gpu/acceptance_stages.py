"""The stages of scripts/gpu/acceptance.py, in the order they run: what each measures, its figures, targets and
budgets. The stages themselves are in speed_stages.py, sweep_stages.py, ablation72_stage.py and suite_stages.py; what
they share (Stage, Figure, Context) in gpu_stage.py.
"""

from __future__ import annotations

from ablation72_stage import ablation72, ablation72_2000
from gpu_stage import Figure, Stage
from mps_stage import mps_sigterm
from speed_stages import deterministic, gpt2, medium_graphs, telemetry, telemetry_gpt2
from suite_stages import cuda_tests, suite, torchrun
from sweep_stages import pack21, sweep8


def figures(*specs: tuple[str, str, str | None]) -> tuple[Figure, ...]:
    return tuple(Figure(*spec) for spec in specs)


# In order of value per second, so that a cut-off run keeps most figures: the headline speed ratios first, the
# workflow figures next, the suite (long; its failures also show in the stages before) and torchrun's CPU path last.
# The budgets (seconds on one H100 or H200) rest on the stage times recorded in docs/benchmarks/gpu-h100.md and
# gpu-h200.md, 10 to 20% more. The timed stages run 20 windows per variant (speed_stages.py), more than those records
# timed, so theirs are estimates from the per-step times there: each run of a variant is 12 windows of 10 steps
# (medium eager about 25 ms a step, GPT-2 small's shape about 100 ms) plus its set-up and, compiled, a compilation
# from Inductor's cache after the first.
STAGES = (
    Stage("gpt2", figures(("gpt2_eager_vs_ref", "x", ">= 1.0"), ("gpt2_compile_vs_ref", "x", ">= 1.0"),
                          ("gpt2_compile_mfu", "%", None)), 200, 240, gpt2,
          "GPT-2 small's shape (12×768, T 1024, B 32, bf16): normlab over the hand-written reference, eager and compiled"),
    Stage("medium_graphs", figures(("medium_graphs_tokens_per_s", "tokens/s", ">= 900000"),
                                   ("medium_graphs_vs_ref", "x", ">= 0.95")), 100, 180, medium_graphs,
          "the medium preset, compile=true compile_mode=reduce-overhead, against a CUDA-graph reference loop"),
    Stage("telemetry", figures(("telemetry_overhead_eager", "%", "<= 3"), ("telemetry_overhead_compile", "%", "<= 3"),
                               ("telemetry_step_added_kernels_eager", "kernels", None),
                               ("telemetry_step_added_kernels_compile", "kernels", None)),
          140, 300, telemetry, "step time with telemetry every 10 steps over without, minus 1, beside the A/A control "
          "(medium preset, eager and compiled); one telemetry step profiled"),
    Stage("telemetry_gpt2", figures(("telemetry_overhead_gpt2_eager", "%", "<= 3"),), 150, 240, telemetry_gpt2,
          "telemetry's overhead at GPT-2 small's shape, eager, beside the A/A control"),
    Stage("deterministic", figures(("deterministic_resume_equal", "", "== true"), ("deterministic_cost", "%", None)),
          130, 200, deterministic, "deterministic=true: its cost beside the A/A control, and a SIGTERM-stopped, resumed "
          "run against the whole"),
    Stage("sweep8", figures(("sweep8_wall_s", "s", "<= 20"),), 90, 150, sweep8,
          "the 8-arm medium sweep, command to closing table, default launcher"),
    Stage("pack21", figures(("pack21_wall_s", "s", "<= 30"),), 110, 150, pack21,
          "the 21-run lr × seed grid of the medium preset as one pack"),
    Stage("ablation72", figures(("ablation72_wall_s", "s", "<= 150"), ("ablation72_head_s", "s", "<= 15"),
                                ("ablation72_failed", "runs", "== 0"), ("ablation72_compare_s", "s", None),
                                ("ablation72_2000_projected_s", "s", "<= 600"),
                                ("ablation72_packed_vs_alone", "relative", "<= 0.01")), 450, 300, ablation72,
          "the 72-run ablation (4 norms x 2 placements x 3 lrs x 3 seeds, medium, 500 steps), packed, 4 packs at once, "
          "then normlab compare on it and the record of its answer"),
    Stage("ablation72_2000", figures(("ablation72_2000_wall_s", "s", "<= 600"), ("ablation72_2000_head_s", "s", "<= 15"),
                                     ("ablation72_2000_failed", "runs", "== 0")), 560, 300, ablation72_2000,
          "the same grid at 2,000 steps (590M tokens), timed"),
    Stage("cuda_tests", figures(("cuda_tests_failed", "tests", "== 0"), ("cuda_tests_passed", "tests", None),
                                ("cuda_tests_wall_s", "s", "<= 60")), 85, 120, cuda_tests,
          "tests/test_cuda.py, in one process, timed"),
    Stage("mps_sigterm", figures(("mps_sigterm_exit_s", "s", "<= 30"), ("mps_daemon_left", "", "== false")), 110, 180,
          mps_sigterm, "the 8-arm medium sweep under MPS (hydra.launcher.mps=true, 4 jobs on the GPU) stopped by SIGTERM "
          "mid-training: the seconds until its output closed, and whether its daemon was left running"),
    Stage("suite", figures(("suite_failed", "tests", "== 0"), ("suite_passed", "tests", None)), 240, 120, suite,
          "the rest of the test suite on this machine"),
    Stage("torchrun", figures(("torchrun_cpu2_ok", "", "== true"),), 33, 120, torchrun,
          "two gloo ranks on the CPU under torchrun"),
)
