"""DDP on the CPU with gloo and 2 processes: global BatchNorm statistics, identical parameters on both
ranks, gradients synchronized once per step, loss curves equal to a single-process run, and the real
command started as torchrun starts it (rank by rank, seconds apart) sharing one run dir."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from conftest import tiny_config
from normlab.config import RunConfig
from normlab.nn.norms import BatchNorm
from normlab.train.run import train

WORLD = 2
STEPS = 4


# Bit-exact comparisons need the same reduction order in every run: one torch thread.
pytestmark = pytest.mark.usefixtures("one_thread")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loop_configs() -> dict[str, RunConfig]:
    def cfg(norm, placement="pre", grad_accum=2, sync=True, causal=False):
        c = tiny_config(norm, placement, grad_accum=grad_accum, max_steps=STEPS, eval_every=2, log_every=1)
        c.norm.sync, c.norm.causal = sync, causal
        c.wandb.mode = "disabled"
        c.ckpt.every = 0
        return c

    return {
        "layer": cfg("layer"),
        "rms": cfg("rms", "post"),
        "none_accum1": cfg("none", grad_accum=1),
        "batch_sync": cfg("batch", "post"),
        "batch_causal_sync": cfg("batch", causal=True),
        "batch_local": cfg("batch", "post", sync=False),
    }


def bn_input():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4 * WORLD, 5, 8, generator=gen) * 3 + 1  # (batch, time, features), off-centre
    weights = torch.randn(4 * WORLD, 5, 8, generator=gen)
    return x, weights


def bn_step(bn, x, weights):
    x = x.clone().requires_grad_()
    y = bn(x)
    (y * weights).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "w_grad": bn.weight.grad, "b_grad": bn.bias.grad,
            "running_mean": bn.running_mean.clone(), "running_var": bn.running_var.clone()}


def _worker(rank, port, out, cache):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), NORMLAB_CACHE=cache, WANDB_MODE="disabled")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import normlab.train.run as loop
    from normlab.train import distributed

    assert distributed.init_from_env()
    results = {}

    # BatchNorm alone: this rank's half of the batch, statistics over both halves.
    x, weights = bn_input()
    mine = slice(rank * 4, (rank + 1) * 4)
    synced = BatchNorm(8, momentum=0.3)
    synced.process_group = dist.group.WORLD
    results["bn_sync"] = bn_step(synced, x[mine], weights[mine])
    results["bn_local"] = bn_step(BatchNorm(8, momentum=0.3), x[mine], weights[mine])

    # The real loop: capture each model built, and count DDP's gradient all-reduces.
    built, reductions = [], []
    real_gpt, real_wrap = loop.GPT, distributed.wrap

    def recording_gpt(cfg):
        built.append(real_gpt(cfg))
        return built[-1]

    def counting_wrap(*args, **kwargs):
        ddp = real_wrap(*args, **kwargs)

        def hook(state, bucket):
            reductions[-1] += 1
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        return ddp

    loop.GPT, distributed.wrap = recording_gpt, counting_wrap
    for name, cfg in loop_configs().items():
        reductions.append(0)
        train(cfg, os.path.join(out, name))
        results[name] = {
            "params": torch.cat([p.detach().flatten() for p in built[-1].parameters()]),
            "buffers": torch.cat([b.detach().float().flatten() for b in built[-1].buffers()] or [torch.zeros(0)]),
            "reductions": reductions[-1],
        }
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    distributed.shutdown()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    cache = str(tmp_path_factory.getbasetemp() / "cache")  # conftest's token cache for the test run
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NORMLAB_CACHE", cache)
        warm = tiny_config(max_steps=1)
        warm.wandb.mode = "disabled"
        train(warm, out / "warm_cache")  # tokenize once, before two processes would race to
    mp.spawn(_worker, args=(free_port(), str(out), cache), nprocs=WORLD, join=True)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def test_synced_batchnorm_equals_single_process_statistics_and_gradients(spawned):
    _, ranks = spawned
    x, weights = bn_input()
    whole = bn_step(BatchNorm(8, momentum=0.3), x, weights)
    got = {k: torch.cat([r["bn_sync"][k] for r in ranks]) for k in ("y", "x_grad")}
    torch.testing.assert_close(got["y"], whole["y"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["x_grad"], whole["x_grad"], rtol=1e-5, atol=1e-5)
    for k in ("w_grad", "b_grad"):  # a parameter's gradient is the sum of the ranks' (DDP then averages)
        torch.testing.assert_close(ranks[0]["bn_sync"][k] + ranks[1]["bn_sync"][k], whole[k], rtol=1e-5, atol=1e-5)
    for r in ranks:
        torch.testing.assert_close(r["bn_sync"]["running_mean"], whole["running_mean"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["bn_sync"]["running_var"], whole["running_var"], rtol=1e-5, atol=1e-6)
    # Per-rank statistics (norm.sync=false) are another computation: the check above could fail.
    local = torch.cat([r["bn_local"]["y"] for r in ranks])
    assert not torch.allclose(local, whole["y"], rtol=1e-3, atol=1e-3)


def test_ranks_end_with_identical_parameters_and_sync_gradients_once_per_step(spawned):
    _, ranks = spawned
    for name in loop_configs():
        assert torch.equal(ranks[0][name]["params"], ranks[1][name]["params"]), name
        assert torch.equal(ranks[0][name]["buffers"], ranks[1][name]["buffers"]), name
        # One gradient all-reduce per bucket per step, whether 1 or 2 micro-batches: no_sync covers the first.
        assert ranks[0][name]["reductions"] == ranks[0]["none_accum1"]["reductions"] == STEPS, name


def test_loss_curves_match_a_single_process_run_with_the_same_global_batch(spawned, tmp_path):
    out, _ = spawned
    keys = ("loss", "val_loss", "grad_norm")
    for name, cfg in loop_configs().items():
        train(cfg, tmp_path / name)
        single, ddp = _rows(tmp_path / name), _rows(out / name)
        assert [r["step"] for r in ddp] == [r["step"] for r in single] == list(range(STEPS + 1)), name  # rank 0 alone wrote
        pairs = [(a[k], b[k]) for a, b in zip(ddp, single) for k in keys if k in b]
        if name == "batch_local":
            # Per-rank BatchNorm normalizes each half with its own statistics: a different model.
            assert any(abs(a - b) > 1e-4 * abs(b) for a, b in pairs), name
        else:
            for a, b in pairs:
                assert a == pytest.approx(b, rel=2e-5, abs=1e-6), name


def test_the_real_command_started_rank_by_rank_shares_one_run_dir(tmp_path):
    """As torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR/PORT), but rank 1 a second and a half later."""
    overrides = ["model=tiny", "batch_size=8", "seq_len=16", f"max_steps={STEPS}", "eval_every=2", "eval_batches=2",
                 "log_every=1", "progress=false", "wandb.mode=offline", "device=cpu"]
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "normlab", "train", *overrides], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(1.5)
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    [run_dir] = list((tmp_path / "outputs" / "runs").iterdir())
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / "checkpoints" / f"step-{STEPS:06d}.pt").exists()
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    ddp = _rows(run_dir)
    assert [r["step"] for r in ddp] == list(range(STEPS + 1))
    environment = json.loads((run_dir / "summary.json").read_text())["environment"]
    assert environment["world_size"] == WORLD and environment["torch_threads"] == 1  # what the result depends on

    from omegaconf import OmegaConf

    cfg = RunConfig.from_dict(OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=True))
    cfg.wandb.mode = "disabled"
    train(cfg, tmp_path / "single")
    for a, b in zip(ddp, _rows(tmp_path / "single")):
        for k in ("loss", "val_loss"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=2e-5), (a["step"], k)


def test_joining_the_group_leaves_cuda_alone_until_the_run_is_on_cuda(monkeypatch):
    """On a host with CUDA, `torchrun ... device=cpu` must not pick a GPU per rank (1 GPU, 2 ranks:
    "invalid device ordinal"); a CUDA run drives the GPU of its LOCAL_RANK."""
    from normlab.train import distributed

    backends, devices = [], []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: bool(backends))
    monkeypatch.setattr(distributed.dist, "init_process_group", backends.append)
    assert distributed.init_from_env()
    assert backends == ["cpu:gloo,cuda:nccl"] and devices == []
    assert distributed.local_device(torch.device("cpu")) == torch.device("cpu") and devices == []
    assert distributed.local_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert devices == [torch.device("cuda", 1)]


RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "SUBMITIT_EXECUTOR", "SLURM_NTASKS")
SLURM_TASK = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
              "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("env, several", [
    ({}, False),
    ({"WORLD_SIZE": "1"}, False),
    ({"WORLD_SIZE": "2"}, True),  # torchrun's
    ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_NTASKS": "2"}, True),  # a SLURM job's tasks
    ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_NTASKS": "1"}, False),
    ({"SUBMITIT_EXECUTOR": "local", "SLURM_NTASKS": "2"}, False),
    ({"SUBMITIT_EXECUTOR": "slurm", "SLURM_NTASKS": "2", "WORLD_SIZE": "1"}, False),  # told it is one of one
])
def test_several_ranks_is_true_exactly_where_init_from_env_joins_a_group(monkeypatch, env, several):
    """`normlab train` imports normlab.train.distributed (torch) only where ranks.several_ranks() says this process
    is one of several: there, and only there, init_from_env joins a process group (submitit's exported variables
    for a SLURM job's tasks included)."""
    from normlab.train import distributed
    from normlab.train.ranks import several_ranks

    for key in RANK_VARIABLES:  # absent, and absent again after the test whatever the export sets
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in {**SLURM_TASK, **env}.items():
        monkeypatch.setenv(key, value)
    joined = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(distributed.dist, "init_process_group", joined.append)
    assert several_ranks() is several
    assert distributed.init_from_env() is several and len(joined) == several
