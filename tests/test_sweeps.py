"""Sweeps always finish: divergence is an outcome, a failed job is recorded, fail_fast stops the sweep.

The sweeps run through normlab.cli.main in this process (test_cli.normlab_here), what `python -m normlab` calls:
what is tested is the sweep's bookkeeping, not the process."""

import json
import math
import re

import pytest
import torch

from conftest import tiny_config
from cli_here import normlab_here
from test_cli import TINY, run_dirs
from normlab.train.run import train

# device=cuda is the failing job: it fails only where torch sees no CUDA.
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="device=cuda fails only without CUDA")
FAILING_SWEEP = ["device=cuda,cpu", *(o for o in TINY if not o.startswith("device="))]


def _summaries(root):
    return {json.loads((d / "summary.json").read_text())["name"]: (d, json.loads((d / "summary.json").read_text())) for d in run_dirs(root)}


def _wandb_exit_code(run_dir):
    [log] = run_dir.glob("wandb/offline-run-*/logs/debug.log")
    codes = re.findall(r"got exitcode: (\d+)", log.read_text())
    return int(codes[-1]) if codes else None


def test_a_diverging_job_is_recorded_and_the_sweep_exits_0(tmp_path):
    result = normlab_here(
        "train", "-m", "norm=none", "lr=1e-3,3e-3,1e5", "optim.warmup_steps=0", "optim.grad_clip=0",
        *TINY, "max_steps=6", "log_every=2", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = _summaries(tmp_path / "outputs")
    assert len(runs) == 3
    statuses = {s["lr"]: s["status"] for _, s in runs.values()}
    assert statuses == {1e-3: "completed", 3e-3: "completed", 1e5: "diverged"}
    d, s = runs["none-pre-d2-lr1e5-s0"]
    assert isinstance(s["diverged_step"], int) and 0 < s["diverged_step"] <= 6
    assert s["final_val_loss"] is None  # NaN in JSON
    rows = [json.loads(line) for line in (d / "metrics.jsonl").open()]
    assert rows[-1] == {"step": s["diverged_step"], "tokens": s["diverged_step"] * 4 * 16, "status": "diverged"}
    assert all(r["step"] < s["diverged_step"] for r in rows[:-1])
    for d, _ in runs.values():
        assert _wandb_exit_code(d) == 0  # finished; divergence is an outcome, not a failure
    # What the sweep says: a line per job as it ends, then every job, best final val loss first.
    sweep_dir = d.parent
    for d, s in runs.values():
        loss = "-" if s["final_val_loss"] is None else f"{s['final_val_loss']:.4f}"
        assert f"{s['name']}: {s['status']}, final val loss {loss}, " in result.stdout
    table = result.stdout[result.stdout.index("sweep: 3 jobs (2 completed, 1 diverged), best first"):]
    names = [line.split()[1] for line in table.splitlines()[2:5]]
    completed = sorted((s["final_val_loss"], s["name"]) for _, s in runs.values() if s["status"] == "completed")
    assert names == [n for _, n in completed] + ["none-pre-d2-lr1e5-s0"]
    assert "DIVERGED" in table.splitlines()[4]
    [phases] = [line for line in table.splitlines() if line.startswith("time by phase, summed over the jobs: ")]
    shown = sum(float(seconds) for seconds in re.findall(r" (\d+\.\d) s \(", phases))
    recorded = sum(sum(s["phases"].values()) for _, s in runs.values())
    assert shown == pytest.approx(recorded, abs=0.05 * len(re.findall(" s \\(", phases)))
    assert f"next: normlab compare {sweep_dir.relative_to(tmp_path)}" in table
    assert (sweep_dir / "sweep.log").read_text().strip().endswith(table.strip())


@no_cuda
def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    # device=cuda on a machine without CUDA raises inside the job, after the run dir and wandb run exist.
    result = normlab_here("train", "-m", *FAILING_SWEEP, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(run_dirs(tmp_path / "outputs"))
    assert len(runs) == 2
    failed = json.loads((runs[0] / "summary.json").read_text())
    assert failed["status"] == "failed" and "CUDA" in failed["error"]
    assert _wandb_exit_code(runs[0]) == 1
    assert json.loads((runs[1] / "summary.json").read_text())["status"] == "completed"
    assert _wandb_exit_code(runs[1]) == 0
    assert "failed: RuntimeError" in result.stderr
    assert "sweep: 2 jobs (1 completed, 1 failed)" in result.stdout
    [failed_row] = [line for line in result.stdout.splitlines() if runs[0].name in line and "FAILED" in line]


@no_cuda
def test_fail_fast_stops_the_sweep(tmp_path):
    result = normlab_here("train", "-m", *FAILING_SWEEP, "fail_fast=true", cwd=tmp_path)
    assert result.returncode != 0
    [only] = run_dirs(tmp_path / "outputs")
    assert json.loads((only / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("subdir, says", [
    ("../../x_${hydra.job.num}", "hydra.sweep.subdir=../../x_${hydra.job.num}: job 0's dir {root}/x_0 is not inside the sweep dir {root}/a/sweep"),
    ("/tmp/elsewhere_${hydra.job.num}", "job 0's dir /tmp/elsewhere_0 is not inside the sweep dir"),
    (".", "hydra.sweep.subdir=.: job 0's dir {root}/a/sweep is not inside the sweep dir"),
    ("same", "hydra.sweep.subdir=same: jobs 0 and 1 would share the dir {root}/a/sweep/same"),
])
def test_job_dirs_outside_the_sweep_dir_or_shared_are_refused_before_any_job(tmp_path, subdir, says):
    result = normlab_here("train", "-m", *TINY, "lr=1e-3,3e-3", "hydra.sweep.dir=a/sweep", f"hydra.sweep.subdir={subdir}",
                          cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("normlab: error: ") and says.replace("{root}", str(tmp_path)) in line, line
    assert list(tmp_path.iterdir()) == []  # nothing written: no sweep dir, no job dir


def test_a_nan_loss_stops_the_run_at_its_step(tmp_path, monkeypatch):
    cfg = tiny_config("layer", max_steps=8, log_every=3, eval_every=0)
    cfg.wandb.mode = "disabled"
    import normlab.train.loop as loop

    real = loop.accumulate_gradients
    calls = []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * math.nan if len(calls) == 5 else loss  # step 4 goes bad

    monkeypatch.setattr(loop, "accumulate_gradients", poisoned)
    summary = train(cfg, tmp_path)
    assert summary["status"] == "diverged" and summary["diverged_step"] == 4
    assert math.isnan(summary["final_val_loss"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 3, 4] and rows[-1]["status"] == "diverged"


def test_the_job_returns_its_final_val_loss(tmp_path, monkeypatch):
    """What Hydra's sweepers (Optuna) optimize: the job's return value."""
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict, read_write

    from normlab.launch.resolvers import register_resolvers
    from normlab.launch.task import train_job

    register_resolvers()
    monkeypatch.chdir(tmp_path)
    returned = {}
    for lr in ("1e-3", "1e5"):
        overrides = ["model=tiny", "max_steps=4", "eval_every=2", "batch_size=4", "seq_len=16", "progress=false",
                     "wandb.mode=disabled", "device=cpu", "norm=none", "optim.warmup_steps=0", "optim.grad_clip=0", f"lr={lr}",
                     f"hydra.run.dir={tmp_path / lr}", "hydra.job.num=0"]
        with initialize_config_module("normlab.conf", version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
                cfg.hydra.runtime.output_dir = str(tmp_path / lr)
            HydraConfig.instance().set_config(cfg)
            returned[lr] = train_job(cfg)
    summary = json.loads((tmp_path / "1e-3" / "summary.json").read_text())
    assert returned["1e-3"] == pytest.approx(summary["final_val_loss"])
    assert math.isnan(returned["1e5"])
    assert json.loads((tmp_path / "1e5" / "summary.json").read_text())["status"] == "diverged"


def test_experiment_presets_compose_to_their_sweeps():
    from hydra import compose, initialize_config_module

    from normlab.launch.resolvers import register_resolvers

    register_resolvers()
    with initialize_config_module("normlab.conf", version_base="1.3"):
        grid = compose("config", overrides=["experiment=norm_grid"], return_hydra_config=True)
        lrs = compose("config", overrides=["experiment=lr_sweep"], return_hydra_config=True)
        depth = compose("config", overrides=["experiment=depth_sweep"], return_hydra_config=True)
    assert dict(grid.hydra.sweeper.params) == {"norm": "none,layer,rms,batch", "placement": "pre,post"}
    assert lrs.hydra.sweeper.params.lr == "3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1"
    assert depth.hydra.sweeper.params.depth == "2,4,8,16"


def test_a_sweep_job_first_collects_what_the_jobs_before_left_and_the_first_two_freeze_what_lives():
    import gc
    import weakref

    from normlab.launch.task import settle_garbage, thaw_garbage

    class Node:
        pass

    def cycle():
        node = Node()
        node.cycle = node  # garbage that only the collector frees, like a finished job's autograd graph
        return node

    enabled = gc.isenabled()
    gc.disable()  # so that only settle_garbage collects the cycles below
    thaw_garbage()  # as a launch's end leaves the process
    try:
        left = cycle()
        freed = weakref.ref(left)
        del left
        alive = cycle()
        settle_garbage()  # the process's first job
        assert freed() is None
        assert gc.get_freeze_count() > 0 and not any(o is alive for o in gc.get_objects())
        # The second job: what the first left alive (what it imported) is frozen too.
        imported = cycle()
        settle_garbage()
        assert not any(o is imported for o in gc.get_objects())
        # A later job: what the job before left is collected, and nothing more is frozen.
        later = cycle()
        frozen = gc.get_freeze_count()
        settle_garbage()
        assert gc.get_freeze_count() == frozen and any(o is later for o in gc.get_objects())
        left = cycle()
        freed = weakref.ref(left)
        del left
        settle_garbage()
        assert freed() is None
        thaw_garbage()  # the launch ends: nothing stays frozen, and the next launch's first job freezes again
        assert gc.get_freeze_count() == 0
        settle_garbage()
        assert gc.get_freeze_count() > 0
    finally:
        thaw_garbage()
        if enabled:
            gc.enable()
