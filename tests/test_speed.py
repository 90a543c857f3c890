"""The speed bookkeeping of a run: deterministic kernels on request, the steady-state throughput with
compilation apart, model FLOPs per token and MFU, and the compile mode's validation."""

import os

import pytest
import torch

from conftest import tiny_config
from normlab.config import ConfigError
from normlab.nn.flops import PEAK_TFLOPS, model_flops_per_token, peak_flops
from normlab.train.run import train


@pytest.fixture
def restore_determinism(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_true_sets_torch_and_cublas_and_the_next_run_clears_it(tmp_path, restore_determinism):
    seen = {}

    class Spy:
        name = "spy"

        def __getattr__(self, hook):  # every hook a no-op, except the first one
            return lambda *args: None

        def on_train_start(self, state):
            seen["flag"] = torch.are_deterministic_algorithms_enabled()
            seen["cublas"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")

        def state_dict(self):
            return {}

    cfg = tiny_config("layer", max_steps=2, deterministic=True)
    cfg.wandb.mode = "disabled"
    assert train(cfg, tmp_path / "on", callbacks=[Spy()])["status"] == "completed"
    assert seen == {"flag": True, "cublas": ":4096:8"}
    train(tiny_config("layer", max_steps=1, resume=None), tmp_path / "off", sinks=[], callbacks=[Spy()])
    assert seen["flag"] is False


def test_summary_reports_steady_throughput_flops_and_no_mfu_on_the_cpu(tmp_path):
    cfg = tiny_config("layer", max_steps=4)
    cfg.wandb.mode = "disabled"
    summary = train(cfg, tmp_path)
    d, L, T = 32, 2, 16
    assert summary["flops_per_token"] == 6 * (L * 12 * d * d + d * 256) + 12 * L * d * T
    assert summary["tokens_per_s"] > 0 and "mfu" not in summary and "peak_memory_gib" not in summary
    assert "compile_time_s" not in summary


def test_the_flops_formula_is_the_one_bench_uses_and_peaks_are_dense():
    cfg = tiny_config("layer")
    assert model_flops_per_token(cfg) == 6 * (2 * 12 * 32 * 32 + 32 * 256) + 12 * 2 * 32 * 16
    assert peak_flops(torch.device("cpu"), "bf16", True) is None
    assert PEAK_TFLOPS["H100"][0] == pytest.approx(989.4)  # SXM, dense bf16 (1979 is 2:4 sparse)


def test_an_unknown_compile_mode_is_refused():
    with pytest.raises(ConfigError, match="compile_mode='fast' is not allowed: choose one of default, reduce-overhead"):
        tiny_config("layer", compile_mode="fast")


def clocked_steps(clock, durations, watched, monkeypatch) -> dict:
    """The summary `clock` (a ThroughputClock) writes after steps of `durations` seconds (time.perf_counter faked),
    each watched (a telemetry step) or not, of 100 tokens each."""
    from types import SimpleNamespace

    import normlab.train.callbacks.throughput as throughput

    now = [0.0]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: now[0])
    state = SimpleNamespace(tokens=0, watched=False)
    for seconds, state.watched in zip(durations, watched):
        clock.on_step_start(state)
        now[0] += seconds
        clock.after_optimizer_step(state, None)
        state.tokens += 100
    summary = {}
    clock.on_train_end(state, summary)
    return summary


def test_the_clock_leaves_the_first_step_and_compilation_out_of_the_steady_rate(monkeypatch):
    import normlab.train.callbacks.throughput as throughput

    # Step 0 is watched (telemetry: its graph compiles, first in the process), step 1 the first compiled plain
    # one, then steady steps (step 4 a telemetry step again, its graph compiled).
    durations, watched = [3.0, 10.0, 0.5, 0.5, 0.5], [True, False, False, False, True]
    clock = throughput.ThroughputClock(100, compile_steps=1, flops_per_token=1e6, peak_flops=1e9)
    summary = clocked_steps(clock, durations, watched, monkeypatch)
    assert summary["tokens_per_s"] == pytest.approx(300 / 1.5)
    assert summary["compile_time_s"] == 13.0 and summary["train_time_s"] == 14.5
    assert summary["mfu"] == pytest.approx(200 * 1e6 / 1e9)


def test_under_cuda_graphs_the_first_two_telemetry_steps_are_compilation_too(monkeypatch):
    """compile_steps=2 (compile_mode=reduce-overhead on CUDA): the telemetry steps' graph is compiled and warmed up at
    the first of them and captured at the second, as the plain steps' at theirs; both are left out of the steady rate."""
    import normlab.train.callbacks.throughput as throughput

    durations = [3.0, 10.0, 5.0, 2.0, 0.5, 0.5, 0.7]
    watched = [True, False, False, True, False, False, True]
    clock = throughput.ThroughputClock(100, compile_steps=2)
    summary = clocked_steps(clock, durations, watched, monkeypatch)
    assert summary["compile_time_s"] == 20.0 and summary["tokens_per_s"] == pytest.approx(300 / 1.7)
