"""The reproduction presets (xiong2020, dyt_vs_norm) compose to the intended sweeps, and every job validates."""

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict

from normlab.app import check_jobs, register_resolvers, sweep_jobs
from normlab.config import RunConfig


def _preset_jobs(name: str, *overrides: str) -> tuple[dict, list[RunConfig]]:
    """The preset's hydra.sweeper.params, and a validated RunConfig for every job that
    `normlab train -m experiment=NAME OVERRIDES...` launches (command-line sweeps included)."""
    register_resolvers()
    with initialize_config_module("normlab.conf", version_base="1.3"):
        sweep = compose("config", overrides=[f"experiment={name}"], return_hydra_config=True)
        params = dict(sweep.hydra.sweeper.params)
        jobs = []
        for job in sweep_jobs([f"{k}={v}" for k, v in params.items()] + [f"experiment={name}", *overrides]):
            cfg = compose("config", overrides=job)
            with open_dict(cfg):
                cfg.pop("hydra", None)
            jobs.append(RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True)))
    return params, jobs


def test_xiong2020_is_pre_against_post_layernorm_with_xavier_at_depth_12_with_and_without_warmup():
    params, jobs = _preset_jobs("xiong2020")
    assert params == {"norm": "layer", "placement": "pre,post", "optim.warmup_steps": "0,50"}
    assert sorted((j.placement, j.optim.warmup_steps) for j in jobs) == [("post", 0), ("post", 50), ("pre", 0), ("pre", 50)]
    for job in jobs:
        assert job.norm.name == "layer" and job.init == "xavier" and job.depth == 12
        assert job.model.d_model == 128 and job.seq_len == 128 and job.lr == 3e-3
        assert job.telemetry.every > 0  # step 0, the paper's Figure 3, is a telemetry step
        assert job.optim.warmup_steps < job.max_steps


def test_xiong2020_init_sweep_of_the_script_is_one_step_per_seed_and_placement():
    # scripts/xiong2020.sh's first sweep: the command line's lr and warmup replace the preset's axes.
    overrides = ("max_steps=1", "optim.warmup_steps=0", "eval_batches=1", "seed=0,1,2,3,4,5,6,7")
    _, jobs = _preset_jobs("xiong2020", *overrides)
    assert sorted((j.placement, j.seed) for j in jobs) == sorted((p, s) for p in ("pre", "post") for s in range(8))
    assert all(j.max_steps == 1 and j.init == "xavier" and j.depth == 12 for j in jobs)
    check_jobs(["experiment=xiong2020", *overrides], [], multirun=True)  # what `normlab train -m` checks first


def test_dyt_vs_norm_is_three_norms_at_two_lrs_in_the_pre_placement():
    params, jobs = _preset_jobs("dyt_vs_norm")
    assert params == {"norm": "layer,rms,dyt", "lr": "1e-3,1e-2"}
    assert {(j.norm.name, j.lr) for j in jobs} == {(n, lr) for n in ("layer", "rms", "dyt") for lr in (1e-3, 1e-2)}
    assert len(jobs) == 6
    assert all(j.placement == "pre" for j in jobs)
    [dyt] = {j.norm.alpha_attn for j in jobs if j.norm.name == "dyt"}
    assert dyt == 0.5  # the paper's default α₀


@pytest.mark.parametrize("name", ["xiong2020", "dyt_vs_norm"])
def test_the_preset_passes_normlab_trains_own_check(name):
    check_jobs([f"experiment={name}"], [], multirun=True)
