"""The reproduction presets (xiong2020, dyt_vs_norm) compose to the intended sweeps, and every job validates.

A preset's jobs are composed once per module (the preset_jobs fixture) and read by every test that asks for the
same preset and overrides: each job is a Hydra compose, about 0.15 s of CPU.
"""

import functools

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict

from normlab.launch.prechecks import check_jobs, sweep_jobs
from normlab.launch.resolvers import register_resolvers
from normlab.config import RunConfig
from normlab.config.packing import pack_groups


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


@pytest.fixture(scope="module")
def preset_jobs():
    """_preset_jobs, remembered by its arguments for this module (the tests only read what it returns)."""
    return functools.cache(_preset_jobs)


@pytest.fixture(scope="module")
def checked():
    """check_jobs for a multirun, remembered by its overrides: a check that passed once passes again."""
    return functools.cache(lambda *overrides: check_jobs(list(overrides), [], multirun=True))


def test_xiong2020_is_pre_against_post_layernorm_with_xavier_at_depth_12_with_and_without_warmup(preset_jobs):
    params, jobs = preset_jobs("xiong2020")
    assert params == {"norm": "layer", "placement": "pre,post", "optim.warmup_steps": "0,50"}
    assert sorted((j.placement, j.optim.warmup_steps) for j in jobs) == [("post", 0), ("post", 50), ("pre", 0), ("pre", 50)]
    for job in jobs:
        assert job.norm.name == "layer" and job.init == "xavier" and job.depth == 12
        assert job.model.d_model == 128 and job.seq_len == 128 and job.lr == 3e-3
        assert job.telemetry.every > 0  # step 0, the paper's Figure 3, is a telemetry step
        assert job.optim.warmup_steps < job.max_steps
        # The paper's setting: no gradient clipping, token embeddings scaled by sqrt(d).
        assert job.optim.grad_clip == 0 and job.model.embed_scale


def test_xiong2020_init_sweep_of_the_script_is_one_step_per_seed_and_placement(preset_jobs, checked):
    # scripts/repro/xiong2020.sh's first sweep: the command line's lr and warmup replace the preset's axes.
    overrides = ("max_steps=1", "optim.warmup_steps=0", "eval_batches=1", "seed=0,1,2,3,4,5,6,7")
    _, jobs = preset_jobs("xiong2020", *overrides)
    assert sorted((j.placement, j.seed) for j in jobs) == sorted((p, s) for p in ("pre", "post") for s in range(8))
    assert all(j.max_steps == 1 and j.init == "xavier" and j.depth == 12 for j in jobs)
    checked("experiment=xiong2020", *overrides)  # what `normlab train -m` checks first


def test_dyt_vs_norm_is_three_norms_at_two_lrs_in_the_pre_placement(preset_jobs):
    params, jobs = preset_jobs("dyt_vs_norm")
    assert params == {"norm": "layer,rms,dyt", "lr": "1e-3,1e-2"}
    assert {(j.norm.name, j.lr) for j in jobs} == {(n, lr) for n in ("layer", "rms", "dyt") for lr in (1e-3, 1e-2)}
    assert len(jobs) == 6
    assert all(j.placement == "pre" for j in jobs)
    [dyt] = {j.norm.alpha_attn for j in jobs if j.norm.name == "dyt"}
    assert dyt == 0.5  # the paper's default α₀


@pytest.mark.parametrize("name", ["xiong2020", "dyt_vs_norm"])
def test_the_preset_passes_normlab_trains_own_check(name, checked):
    checked(f"experiment={name}")


# ---------------------------------------------------------------- the GPU presets (composed and validated, not run)


def test_wortsman2023_is_layernorm_pre_post_with_and_without_qk_norm_over_the_lr_grid_depths_and_seeds(preset_jobs):
    params, jobs = preset_jobs("wortsman2023", "lr=3e-4,3e-1", "seed=0")  # two corners of the grid, one seed
    assert params == {"norm": "layer", "placement": "pre,post", "qk_norm": "false,true", "depth": "8,16",
                      "lr": "3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1", "seed": "0,1,2"}
    assert {(j.placement, j.qk_norm, j.depth, j.lr) for j in jobs} == {
        (p, q, d, lr) for p in ("pre", "post") for q in (False, True) for d in (8, 16) for lr in (3e-4, 3e-1)
    }
    assert all(j.model.d_model == 256 and j.seq_len == 256 and j.telemetry.every > 0 for j in jobs)


def test_wortsman2023_script_arms_rms_and_dyt_pre_validate(preset_jobs):
    overrides = ("norm=rms,dyt", "placement=pre", "qk_norm=false", "lr=3e-1", "seed=0")
    _, jobs = preset_jobs("wortsman2023", *overrides)
    assert {(j.norm.name, j.placement, j.qk_norm, j.depth) for j in jobs} == {
        (n, "pre", False, d) for n in ("rms", "dyt") for d in (8, 16)
    }


def test_xiong2020_warmup_is_post_ln_at_three_warmups_against_pre_ln_for_thousands_of_steps(preset_jobs):
    params, jobs = preset_jobs("xiong2020_warmup")
    assert {(j.placement, j.optim.warmup_steps) for j in jobs} >= {("post", 0), ("post", 500), ("post", 4000), ("pre", 0)}
    for job in jobs:
        assert job.depth == 12 and job.init == "xavier" and job.model.embed_scale and job.optim.grad_clip == 0
        assert job.max_steps >= 2 * 4000 and job.norm.name == "layer"


def test_zhu2025_is_dyt_with_its_stated_alpha_and_the_baselines_validate(preset_jobs):
    _, jobs = preset_jobs("zhu2025")
    assert len(jobs) == 9 and all(j.norm.name == "dyt" and j.init == "xavier" and j.placement == "pre" for j in jobs)
    assert {(j.norm.alpha_attn, j.norm.alpha_mlp, j.norm.alpha_final) for j in jobs} == {(0.8, 0.2, 0.2)}
    _, baselines = preset_jobs("zhu2025_norms")
    assert {j.norm.name for j in baselines} == {"layer", "rms"} and len(baselines) == 18
    shared = ("init", "placement", "seq_len", "batch_size", "max_steps", "depth", "model")
    assert {tuple(str(getattr(j, k)) for k in shared) for j in jobs + baselines} == {
        tuple(str(getattr(jobs[0], k)) for k in shared)
    }  # the same grid and model as DyT's
    assert {(j.lr, j.seed) for j in baselines} == {(j.lr, j.seed) for j in jobs}


# ---------------------------------------------------------------- the CPU sizes of the GPU presets (run here)

@pytest.mark.parametrize("gpu, cpu, axes, fewer", [
    ("wortsman2023", "wortsman2023_cpu", {"depth": "4", "seed": "0"}, ("lr=3e-4,3e-1", "seed=0")),
    ("xiong2020_warmup", "xiong2020_warmup_cpu", {"optim.warmup_steps": "0,50,400", "lr": "0.001"}, ()),
    ("zhu2025", "zhu2025_cpu", {"seed": "0"}, ()),
    ("zhu2025_norms", "zhu2025_norms_cpu", {"seed": "0"}, ()),
    ("depth_gpu", "depth_cpu", {"lr": "0.003", "seed": "0,1"}, ()),
])  # fmt: skip
def test_a_cpu_preset_is_its_gpu_preset_with_only_the_size_and_its_stated_axes_changed(gpu, cpu, axes, fewer, preset_jobs,
                                                                                       checked):
    gpu_params, gpu_jobs = preset_jobs(gpu, *fewer)  # `fewer`: a corner of a large grid, to keep the test fast
    cpu_params, cpu_jobs = preset_jobs(cpu, *fewer)
    assert cpu_params == {**gpu_params, **axes}
    cpu_tokens = {j.max_steps * j.batch_size * j.seq_len * j.model.d_model * j.depth for j in cpu_jobs}
    gpu_tokens = {j.max_steps * j.batch_size * j.seq_len * j.model.d_model * j.depth for j in gpu_jobs}
    assert max(cpu_tokens) * 20 < min(gpu_tokens)  # well under the GPU size
    # Everything but the size is the GPU preset's: init, embeddings, clipping, norm, α₀, placement.
    same = lambda j: (j.init, j.model.embed_scale, j.optim.grad_clip, j.norm.name, j.norm.alpha_attn,  # noqa: E731
                      j.norm.alpha_mlp, j.norm.alpha_final, j.placement, j.qk_norm)  # fmt: skip
    assert {same(j) for j in cpu_jobs} <= {same(j) for j in gpu_jobs}
    checked(f"experiment={cpu}", *fewer)


def test_cpu_presets_keep_the_gpu_presets_head_size_and_warmup_fraction(preset_jobs):
    _, wortsman = preset_jobs("wortsman2023_cpu", "lr=1e-2")
    assert {(j.model.d_model // j.model.n_head, j.optim.warmup_steps / j.max_steps) for j in wortsman} == {(32, 0.1)}
    _, xiong = preset_jobs("xiong2020_warmup_cpu")
    # 50 and 400 of 800 steps: the GPU preset's 500 and 4,000 of 8,000, within a step.
    assert sorted({j.optim.warmup_steps / j.max_steps for j in xiong}) == [0, 50 / 800, 0.5]
    assert {(j.depth, j.init, j.model.embed_scale, j.optim.grad_clip, j.lr) for j in xiong} == {(12, "xavier", True, 0, 1e-3)}
    _, zhu = preset_jobs("zhu2025_cpu")
    _, norms = preset_jobs("zhu2025_norms_cpu")
    assert {(j.norm.alpha_attn, j.norm.alpha_mlp, j.norm.alpha_final) for j in zhu} == {(0.8, 0.2, 0.2)}
    grid = lambda jobs: {(j.lr, j.seed, j.max_steps, j.model.d_model, j.depth, j.init) for j in jobs}  # noqa: E731
    assert grid(zhu) == grid(norms) and {j.lr for j in zhu} == {3e-4, 1e-3, 3e-3}


# ---------------------------------------------------------------- the depth reproduction (Curse of Depth, Peri-LN)

DEPTH_PLACEMENTS = ("pre", "lns", "sandwich", "reordered", "post")


def test_depth_gpu_is_five_layernorm_placements_at_depth_24_over_three_lrs_and_three_seeds(preset_jobs):
    params, jobs = preset_jobs("depth_gpu")  # the whole grid, composed once for this test and the CPU preset's
    assert params == {"norm": "layer", "placement": ",".join(DEPTH_PLACEMENTS), "lr": "3e-4,1e-3,3e-3",
                      "seed": "0,1,2"}
    assert {(j.placement, j.lr) for j in jobs} == {(p, lr) for p in DEPTH_PLACEMENTS for lr in (3e-4, 1e-3, 3e-3)}
    for job in jobs:
        assert (job.norm.name, job.depth, job.model.d_model, job.model.n_head, job.seq_len) == ("layer", 24, 256, 8, 256)
        assert job.max_steps == 5000 and job.optim.warmup_steps == 500
        assert job.telemetry.every > 0 and job.max_steps % job.telemetry.every == 0


def test_depth_cpu_is_the_five_placements_at_depth_12_with_two_seeds_packed_per_placement(preset_jobs, checked):
    params, jobs = preset_jobs("depth_cpu")
    assert params == {"norm": "layer", "placement": ",".join(DEPTH_PLACEMENTS), "lr": "0.003", "seed": "0,1"}
    assert sorted((j.placement, j.seed) for j in jobs) == sorted((p, s) for p in DEPTH_PLACEMENTS for s in (0, 1))
    for job in jobs:
        assert (job.norm.name, job.depth, job.model.d_model, job.model.n_head, job.lr) == ("layer", 12, 64, 2, 3e-3)
        assert job.max_steps == 300 and job.optim.warmup_steps == 30 and job.pack
        # Telemetry is recorded at step 0 and at the last step whenever it is on: the figure's two panels.
        assert 0 < job.telemetry.every <= job.max_steps
    # One pack per placement, of its two seeds.
    packs = [sorted((jobs[i].placement, jobs[i].seed) for i in group) for group in pack_groups(jobs)]
    assert sorted(packs) == sorted([(p, 0), (p, 1)] for p in DEPTH_PLACEMENTS)
    checked("experiment=depth_cpu")
