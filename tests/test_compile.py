"""compile=true: compiled training and telemetry steps, checkpoints that load into eager models.

A cold torch.compile takes tens of seconds on this CPU (a few with Inductor's on-disk cache warm). The tests
compile the same model with the same Inductor settings (off CUDA, reduce-overhead compiles as the default
mode does) and run in one xdist worker, in this order: the later ones find the first's compile in the cache.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_config
from normlab.train.checkpoint import Checkpoint, checkpoint_path
from normlab.config import CkptConfig, TelemetryConfig
from normlab.nn.model import GPT
from normlab.train.callbacks import Callback
from normlab.train.run import train
from test_pack import ABSOLUTE_SCALE

pytestmark = pytest.mark.xdist_group("torch_compile")  # one worker: the second test reuses the first's compile


def _run(tmp_path, name, **overrides):
    # Telemetry at steps 0, 3 and 4 (the last): steps 1 and 2 run the compiled model.
    cfg = tiny_config("rms", max_steps=5, eval_every=0, telemetry=TelemetryConfig(every=3), **overrides)
    cfg.wandb.mode = "disabled"
    cfg.ckpt.every = 2
    run_dir = tmp_path / name
    summary = train(cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return cfg, run_dir, summary, rows


def test_compiled_training_matches_eager_keeps_telemetry_and_saves_a_bare_model(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, _, eager_summary, eager_rows = _run(tmp_path, "eager")
    assert "compile_time_s" not in eager_summary
    assert not counters["stats"]["unique_graphs"]

    cfg, run_dir, summary, rows = _run(tmp_path, "compiled", compile=True)
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really compiled the training step
    assert summary["status"] == "completed" and summary["compile_time_s"] > 0

    # Same data, same initialization: the losses agree up to the compiled kernels' rounding.
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [0, 1, 2, 3, 4]
    for compiled, eager in zip(train_rows, (r for r in eager_rows if "loss" in r)):
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-4)
    assert summary["final_val_loss"] == pytest.approx(eager_summary["final_val_loss"], rel=1e-4)

    # Telemetry steps ran the Probe's compiled forward; the others carry no telemetry.
    with_telemetry = [r["step"] for r in rows if "act/resid_rms/L00" in r]
    assert with_telemetry == [0, 3, 4]

    # The checkpoint holds the bare model: no `_orig_mod.` keys, and it loads into an uncompiled GPT.
    state = Checkpoint.load(checkpoint_path(run_dir, 5)).payload["state"]["model"]
    assert not [k for k in state if "_orig_mod" in k]
    eager = GPT(cfg)
    eager.load_state_dict(state)
    x = torch.randint(0, 256, (2, 16))
    assert torch.isfinite(eager(x)).all()


class StepWatch(Callback):
    """Dynamo's graph count after each step, and a CPU profile of step `profiled`: the names of its events."""

    name = "step_watch"

    def __init__(self, profiled: int):
        self.profiled, self.graphs, self.events = profiled, {}, set()

    def on_step_start(self, state) -> None:
        if state.step == self.profiled:
            self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profile.__enter__()

    def on_step_end(self, state, record) -> None:
        from torch._dynamo.utils import counters

        self.graphs[state.step - 1] = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        if state.step - 1 == self.profiled:
            self.profile.__exit__(None, None, None)
            self.events = {event.key for event in self.profile.key_averages()}


def test_telemetry_steps_run_one_more_compiled_graph_reused_without_recompiling(tmp_path):
    """compile=true, telemetry every 10 steps over 30: every telemetry step (0, 10, 20, 29) runs a second compiled
    graph, the forward with its statistics (and its backward, which measures the stream's gradient), compiled
    at step 0 and reused: after step 1 Dynamo compiles nothing more, and breaks no graph. Step 20 runs it, not
    the eager model (whose block angles call aten::atan2), and logs what the eager run logs."""
    from torch._dynamo.utils import counters

    logged, watches = {}, {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cfg = tiny_config("rms", max_steps=30, eval_every=0, log_every=10, telemetry=TelemetryConfig(every=10),
                          compile=compiled)
        cfg.wandb.mode = "disabled"
        watches[compiled] = StepWatch(profiled=20)
        train(cfg, tmp_path / str(compiled), callbacks=[watches[compiled]])
        logged[compiled] = {r["step"]: r for r in map(json.loads, (tmp_path / str(compiled) / "metrics.jsonl").open())}
    graphs = watches[True].graphs
    assert graphs[0] == (1, 0) and graphs[1] == (2, 0)  # step 0: the telemetry graph; step 1: the plain one
    assert {graphs[step] for step in range(1, 30)} == {(2, 0)}
    assert "aten::atan2" in watches[False].events and "aten::atan2" not in watches[True].events
    assert any(e.startswith("Torch-Compiled Region") for e in watches[True].events)
    assert "CompiledFunctionBackward" in watches[True].events
    for step in (0, 10, 20, 29):
        want, got = logged[False][step], logged[True][step]
        keys = [k for k in want if k.startswith(("act/", "grad/", "attn/", "norm/", "out/", "update_ratio/"))]
        assert len(keys) > 50 and set(keys) <= set(got)
        for key in keys:
            floor = next((v for k, v in ABSOLUTE_SCALE.items() if key.startswith(k)), 1e-2)
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6 * floor), (step, key)


@pytest.mark.slow_compile
def test_cuda_graph_mode_trains_resumes_and_keeps_telemetry_on_any_device(tmp_path):
    """compile_mode=reduce-overhead (CUDA graphs on CUDA; the CPU compiles alone): a run killed after its
    step-2 checkpoint and resumed gives the uninterrupted run's rows, telemetry steps included."""
    cfg, run_dir, summary, rows = _run(tmp_path, "whole", compile=True, compile_mode="reduce-overhead",
                                       ckpt=CkptConfig(keep=5))
    assert summary["status"] == "completed" and summary["compile_time_s"] > 0
    assert [r["step"] for r in rows if "act/resid_rms/L00" in r] == [0, 3, 4]
    cut = tiny_config("rms", max_steps=5, eval_every=0, telemetry=TelemetryConfig(every=3), compile=True,
                      compile_mode="reduce-overhead", resume=str(checkpoint_path(run_dir, 2)))
    cut.wandb.mode = "disabled"
    resumed = train(cut, tmp_path / "resumed")
    assert resumed["resumed_from_step"] == 2
    assert resumed["final_val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-5)


def test_reduce_overhead_compiles_with_the_default_modes_inductor_settings_off_cuda(monkeypatch):
    """Off CUDA, compile_mode=reduce-overhead has no graphs to capture: torch.compile gets the default mode, so
    Inductor's on-disk cache holds one compile for both modes. The graph-step wrapper stays."""
    from normlab.train import runtime

    modes = []
    monkeypatch.setattr(torch, "compile", lambda net, mode=None: modes.append(mode) or net)
    net = torch.nn.Linear(2, 2)
    graphed = runtime.compile_model(net, "reduce-overhead", torch.device("cpu"))
    assert graphed is not net and graphed(torch.ones(1, 2)).shape == (1, 2)
    assert runtime.compile_model(net, "default", torch.device("cpu")) is net
    runtime.compile_model(net, "reduce-overhead", torch.device("cuda"))
    runtime.compile_model(net, "max-autotune", torch.device("cpu"))
    assert modes == [None, None, "reduce-overhead", "max-autotune"]


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_the_telemetry_graph_is_captured_in_cuda_graphs_where_the_plain_steps_are(tmp_path, monkeypatch, mode):
    """The Probe compiles its forward with dynamic=False (one graph per micro-batch shape, none made dynamic by a
    second shape), in torch.compile's reduce-overhead mode (CUDA graphs) where the plain steps run in CUDA graphs:
    compile_mode=reduce-overhead on CUDA. Off CUDA, in every mode, the default mode."""
    import normlab.telemetry.probe as probe_module
    from normlab.train.callbacks import Telemetry
    from normlab.train.run import build_state, standard_callbacks
    from normlab.train.runtime import cuda_graphs

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append((fn, kwargs)) or fn)
    cfg = tiny_config("rms", compile=True, compile_mode=mode)
    state = build_state(cfg, torch.device("cpu"), "fp32")
    checkpointer = SimpleNamespace(run_dir=tmp_path)
    callbacks = standard_callbacks(cfg, state, [], checkpointer, torch.device("cpu"))
    (telemetry,) = [c for c in callbacks if isinstance(c, Telemetry)]
    assert calls == [(probe_module.watched_forward, {"dynamic": False})]
    assert telemetry.probe.net is state.model
    assert cuda_graphs(cfg, torch.device("cuda")) == (mode == "reduce-overhead") and not cuda_graphs(cfg, torch.device("cpu"))
    calls.clear()
    graphed = probe_module.Probe(state.model, 1, 2, compiled=True, graphs=True)
    assert calls == [(probe_module.watched_forward, {"dynamic": False, "mode": "reduce-overhead"})]
    assert all(c.grad is not None and c.grad.item() == 0 for c in graphed._collectors)  # kept outside the graphs
