"""normlab.launch.derived: the checks' job configs, composed once per shape of job, equal Hydra's."""

import itertools

from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf

from normlab.launch.derived import Composer
from normlab.launch.prechecks import _main_hydra
from normlab.launch.resolvers import register_resolvers


def test_jobs_that_differ_in_values_equal_their_own_composition_and_are_composed_once_per_shape():
    register_resolvers()
    loader = _main_hydra([]).config_loader
    try:
        compose = Composer(loader, "config")
        jobs = [[f"norm={norm}", f"lr={lr}", f"seed={seed}", "model=tiny", "hydra.sweep.dir=sweeps/x", "optim.betas=[0.9,0.95]",
                 "pack=true"] for norm, lr, seed in itertools.product(("layer", "rms"), ("1e-3", "3e-3"), (0, 1))]
        jobs += [["norm=rms", "++norm.eps=1e-5", "lr=1e-2"], ["norm=rms", "++norm.eps=1e-3", "lr=3e-2"]]
        for job in jobs:
            derived = compose(job)
            whole = loader.load_configuration("config", job, run_mode=RunMode.RUN, from_shell=True)
            assert OmegaConf.to_container(derived, resolve=False) == OmegaConf.to_container(whole, resolve=False), job
        assert compose.whole == 3  # layer, rms and the ++ jobs' shape: the other 7 jobs were derived
        assert list(compose(jobs[-1]).hydra.overrides.task) == jobs[-1]
    finally:
        GlobalHydra.instance().clear()


def test_a_job_with_a_mapping_or_a_new_key_is_composed_whole():
    register_resolvers()
    loader = _main_hydra([]).config_loader
    try:
        compose = Composer(loader, "config")
        for job in (["+extra=1"], ["+extra=2"], ["optim={weight_decay:0.1}"], ["optim={weight_decay:0.2}"],
                    ["hydra.searchpath=[]", "lr=1e-3"], ["hydra.searchpath=[]", "lr=3e-3"]):  # Hydra's repository's source
            assert compose(job) is not None
        assert compose.whole == 6
    finally:
        GlobalHydra.instance().clear()


def test_the_sweepers_configs_equal_hydras_sweep_configs():
    from normlab.launch.composed import ComposedOnce

    register_resolvers()
    loader = _main_hydra([]).config_loader
    try:
        master = loader.load_configuration("config", ["hydra.sweep.dir=sweeps/x", "model=tiny"],
                                           run_mode=RunMode.MULTIRUN, from_shell=True)
        once = ComposedOnce(loader.load_sweep_config)
        for norm, lr in itertools.product(("none", "batch"), ("1e-3", "1e-2")):
            job = [f"norm={norm}", "placement=post", f"lr={lr}", "model=tiny"]
            ours, hydras = once(master, job), loader.load_sweep_config(master, job)
            assert OmegaConf.to_container(ours, resolve=False) == OmegaConf.to_container(hydras, resolve=False), job
        assert once.composer.whole == 2
    finally:
        GlobalHydra.instance().clear()
