"""On a CUDA GPU (skipped without one): mixed precision, the GradScaler, compile, CUDA graphs,
deterministic resume, and the memory a sweep's jobs give back. Tiny models: seconds each, but a compile. So that
the file runs within a minute, runs that several tests read are trained once (module-scoped fixtures), and the
compiled tests share their models where they can, so that Inductor's cache serves a graph compiled before."""

import dataclasses
import json

import pytest
import torch

from conftest import tiny_config
from normlab.train.checkpoint import checkpoint_path
from normlab.config import CkptConfig, TelemetryConfig
from normlab.train.run import train

# One worker of pytest-xdist runs them all, so the GPU is not shared between workers.
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), pytest.mark.xdist_group("cuda")]


def cuda_config(**overrides):
    cfg = tiny_config("rms", **{"device": "cuda", "max_steps": 6, "eval_every": 3, "telemetry": TelemetryConfig(every=3),
                                **overrides})
    cfg.wandb.mode = "disabled"
    return cfg


def rows(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())}


@pytest.fixture
def exact_fp32():
    """IEEE float32 matmuls, so CUDA runs compare at fp32 tolerances."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    torch.use_deterministic_algorithms(False)


class ScaleSpy:
    """Notes, at a run's end, whether its GradScaler was enabled and its scale."""

    name = "scale_spy"

    def __init__(self):
        self.scale: tuple[bool, float] | None = None

    def __getattr__(self, hook):
        return lambda *args: None

    def on_train_end(self, state, summary):
        self.scale = (state.scaler.is_enabled(), state.scaler.get_scale())

    def state_dict(self):
        return {}


@pytest.fixture(scope="module")
def mixed_runs(tmp_path_factory):
    """A bf16 and an fp16 run, trained once for the tests that read them: summary, rows, and the GradScaler's state."""
    runs = {}
    for precision in ("bf16", "fp16"):
        spy, run_dir = ScaleSpy(), tmp_path_factory.mktemp(precision)
        summary = train(cuda_config(precision=precision), run_dir, callbacks=[spy])
        runs[precision] = (summary, rows(run_dir), spy.scale)
    return runs


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_the_gpu_and_reports_its_memory(mixed_runs, precision):
    summary, logged, _ = mixed_runs[precision]
    assert summary["status"] == "completed" and summary["device"] == "cuda" and summary["precision"] == precision
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in logged.values() if "loss" in r)
    assert summary["peak_memory_gib"] > 0 and summary["flops_per_token"] > 0
    assert "act/resid_rms/L00" in logged[3]  # telemetry on a mixed-precision step


def test_fp16_scales_the_loss_and_bf16_does_not(mixed_runs):
    enabled, scale = mixed_runs["fp16"][2]
    assert enabled and scale >= 1.0
    assert mixed_runs["bf16"][2][0] is False


@pytest.fixture(scope="module")
def eager_fp32(tmp_path_factory):
    """The eager run the compiled ones are compared with: IEEE float32, two micro-batches a step; trained once."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    base = cuda_config(precision="fp32", tf32=False, grad_accum=2)
    run_dir = tmp_path_factory.mktemp("eager")
    summary = train(base, run_dir)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    return base, summary, rows(run_dir)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_and_cuda_graph_steps_match_eager(tmp_path, exact_fp32, eager_fp32, mode):
    base, eager, want = eager_fp32
    fast = train(dataclasses.replace(base, compile=True, compile_mode=mode), tmp_path / mode)
    assert fast["status"] == "completed" and fast["compile_time_s"] > 0
    got = rows(tmp_path / mode)
    assert got.keys() == want.keys()
    for step, row in want.items():
        for key in ("loss", "grad_norm", "val_loss", "grad/norm/L00"):
            if key in row:
                assert got[step][key] == pytest.approx(row[key], rel=1e-4), (step, key)
    assert fast["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=1e-4)


def test_telemetry_steps_replay_cuda_graphs_of_their_own_beside_the_plain_steps(tmp_path, monkeypatch):
    """compile_mode=reduce-overhead with telemetry every 3 steps (0, 3, 6, 9, 11): the plain steps' forward and
    backward are warmed up at step 1 and captured at step 2, the telemetry steps' (their own compiled graph) warmed
    up at step 0 and captured at step 3; from step 4 on every step, plain or telemetry, replays what was captured
    and nothing is captured again."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

    from normlab.train.callbacks import Callback

    step, seen = [0], {"record_function": [], "execute_node": []}
    for name in seen:
        real = getattr(CUDAGraphTreeManager, name)
        monkeypatch.setattr(CUDAGraphTreeManager, name,
                            lambda self, *args, _real=real, _name=name: seen[_name].append(step[0]) or _real(self, *args))

    class StepNumber(Callback):
        name = "step_number"

        def on_step_start(self, state):
            step[0] = state.step

    counters.clear()
    cfg = cuda_config(precision="bf16", compile=True, compile_mode="reduce-overhead", max_steps=12, eval_every=0)
    train(cfg, tmp_path, callbacks=[StepNumber()])
    assert set(seen["record_function"]) == {2, 3}
    assert set(range(4, 12)) <= set(seen["execute_node"])
    assert not counters["inductor"]["cudagraph_skips"]
    assert "act/resid_rms/L00" in rows(tmp_path)[9]


def test_telemetry_in_cuda_graphs_logs_what_eager_telemetry_logs(tmp_path, exact_fp32):
    """Two micro-batches (the 8 probed sequences all in the first: two graphs), telemetry at steps 0 (warm-up), 3
    (capture) and 5 (replay): every statistic as the eager run's, within the compiled kernels' rounding."""
    from test_pack import ABSOLUTE_SCALE

    base = cuda_config(precision="fp32", tf32=False, grad_accum=2, batch_size=16, eval_every=0)
    train(base, tmp_path / "eager")
    train(dataclasses.replace(base, compile=True, compile_mode="reduce-overhead"), tmp_path / "graphs")
    want, got = rows(tmp_path / "eager"), rows(tmp_path / "graphs")
    for step in (0, 3, 5):
        keys = [k for k in want[step] if k.startswith(("act/", "grad/", "attn/", "norm/", "out/", "update_ratio/"))]
        assert len(keys) > 50 and set(keys) <= set(got[step])
        for key in keys:
            floor = next((v for k, v in ABSOLUTE_SCALE.items() if key.startswith(k)), 1e-2)
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6 * floor), (step, key)


def test_telemetry_statistics_reach_the_host_through_pinned_memory_without_a_sync():
    """Probe.stage queues the step's last statistics and their copy into pinned host memory and returns without
    waiting for the device (torch's sync debug mode raises on a synchronizing call); they are read once the copy's
    event has passed, as the values the device held."""
    from normlab.nn.model import GPT
    from normlab.telemetry.probe import Probe
    from normlab.telemetry.readback import Readback

    values = torch.randn(1000, device="cuda")
    readback = Readback(values)
    assert readback._host.is_pinned() and readback.values() == values.tolist() and readback.ready()
    torch.manual_seed(0)
    model = GPT(cuda_config()).cuda()
    probe = Probe(model, every=1, max_steps=1)
    probe.forward(torch.randint(0, 256, (8, 16), device="cuda")).float().mean().backward()
    probe.measure_gradients(torch.amp.GradScaler("cuda", enabled=False))
    probe.before_update()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = probe.stage()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stats = pending.read()[0]
    assert len(stats) > 50 and stats["grad/resid_rms/L01"] > 0 and stats["update_ratio/L01"] > 0


def test_cuda_graphs_keep_divergence_detection(tmp_path):
    # The model and settings of the test before (the lr, warm-up and clipping are outside the compiled graphs): its
    # graphs come from Inductor's cache, not compiled again. RMSNorm at lr 1e5 diverges at the first step on the CPU.
    cfg = cuda_config(precision="bf16", lr=1e5, compile=True, compile_mode="reduce-overhead", eval_every=0)
    cfg.optim.warmup_steps, cfg.optim.grad_clip = 0, 0.0
    summary = train(cfg, tmp_path)
    assert summary["status"] == "diverged" and 0 < summary["diverged_step"] <= 6


@pytest.mark.parametrize("compiled", [False, True])
def test_deterministic_resume_repeats_the_uninterrupted_rows(tmp_path, exact_fp32, compiled):
    cfg = cuda_config(precision="bf16", deterministic=True, compile=compiled, ckpt=CkptConfig(every=3, keep=5))
    train(cfg, tmp_path / "whole")
    resumed = dataclasses.replace(cfg, resume=str(checkpoint_path(tmp_path / "whole", 3)))
    assert train(resumed, tmp_path / "resumed")["resumed_from_step"] == 3
    whole, again = rows(tmp_path / "whole"), rows(tmp_path / "resumed")
    for step in range(3, cfg.max_steps + 1):
        for key in ("loss", "grad_norm", "val_loss", "grad/norm/L00", "update_ratio/L01"):
            if key in whole[step]:
                assert again[step][key] == whole[step][key], (step, key)


def test_a_sweeps_jobs_give_their_gpu_memory_back(tmp_path):
    # A warm-up job first: cuBLAS keeps a workspace per handle and stream in torch's allocator for the
    # process's life, allocated at the first matmul, whichever test runs first.
    train(cuda_config(precision="bf16", seed=99), tmp_path / "warm-up")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    peaks = []
    for seed in range(3):
        summary = train(cuda_config(precision="bf16", seed=seed), tmp_path / str(seed))
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - baseline < 2**20, f"job {seed} left memory allocated"
        peaks.append(summary["peak_memory_gib"])
    assert max(peaks) <= 1.05 * min(peaks)  # every job's peak is its own, not the sweep's so far


def test_a_pack_on_the_gpu_equals_its_unpacked_runs(tmp_path, exact_fp32):
    from normlab.train.pack import train_pack

    cfgs = [cuda_config(precision="fp32", tf32=False, lr=lr, seed=seed) for lr in (1e-3, 1e-2) for seed in (0, 1)]
    for i, cfg in enumerate(cfgs):
        train(cfg, tmp_path / f"run{i}")
    summaries = train_pack([(cfg, tmp_path / f"member{i}") for i, cfg in enumerate(cfgs)])
    assert {s["device"] for s in summaries} == {"cuda"}
    for i in range(len(cfgs)):
        alone, member = rows(tmp_path / f"run{i}"), rows(tmp_path / f"member{i}")
        assert alone.keys() == member.keys()
        for step, row in alone.items():
            for key in ("loss", "grad_norm", "val_loss", "act/resid_rms/L01", "grad/resid_rms/L01"):
                if key in row:
                    assert member[step][key] == pytest.approx(row[key], rel=1e-4), (i, step, key)


def test_a_bf16_pack_trains_on_the_gpu(tmp_path):
    from normlab.train.pack import train_pack

    cfgs = [cuda_config(precision="bf16", lr=lr) for lr in (1e-3, 3e-3, 1e-2)]
    summaries = train_pack([(cfg, tmp_path / f"member{i}") for i, cfg in enumerate(cfgs)])
    assert [s["status"] for s in summaries] == ["completed"] * 3 and summaries[0]["precision"] == "bf16"
    assert summaries[0]["pack_size"] == 3 and summaries[0]["pack_tokens_per_s"] > summaries[0]["tokens_per_s"]
