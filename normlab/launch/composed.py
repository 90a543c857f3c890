"""ComposedOnce: a sweep's job configs composed once where Hydra composes each twice (normlab's launcher uses it)."""

from __future__ import annotations

import contextlib
import copy
import uuid
from typing import List

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from omegaconf import DictConfig, OmegaConf

from normlab.launch.derived import Composer


class ComposedOnce:
    """A config loader's load_sweep_config that composes each job once where Hydra composes it twice: the
    sweeper composes every job of a batch to validate it, then the launcher composes it again to run it
    (0.2 s a job). Outside a launch (the sweeper validating), a copy of each config composed is kept; in
    the launch, the first call for a job takes its copy (so every caller gets a config of its own), and
    the launch's end forgets what no call took. At most `keep` are kept. The sweeper's calls compose by way of a
    Composer: only the first job of each shape is composed whole (normlab.launch.derived). Pickled (a config loader
    sent to a worker process with each unit of jobs), it is the worker's own ComposedOnce for this one (in_worker),
    which keeps nothing: the worker composes its jobs itself, by way of its own Composer, and the configs kept stay
    here."""

    def __init__(self, load, keep: int = 256):
        self.load, self.keep, self.kept = load, keep, {}
        self.launching = False
        self.composer: Composer | None = None
        self.token = uuid.uuid4().hex  # names it to the workers (in_worker)

    def __call__(self, master_config: DictConfig, sweep_overrides: List[str]) -> DictConfig:
        key = (id(master_config), tuple(sweep_overrides))
        if self.launching and key in self.kept:
            return self.kept.pop(key)
        sweep_config = self._validated(master_config, sweep_overrides) if not self.launching else None
        if sweep_config is None:
            sweep_config = self.load(master_config, sweep_overrides)
        if not self.launching and len(self.kept) < self.keep:
            self.kept[key] = copy.deepcopy(sweep_config)  # a copy of its own: callers set their job's fields
        return sweep_config

    def _validated(self, master_config: DictConfig, sweep_overrides: List[str]) -> DictConfig | None:
        """The job's config as Hydra's ConfigLoaderImpl.load_sweep_config composes it, by way of a Composer: jobs
        that differ from an earlier one only in values are not composed again (normlab.launch.derived). None where
        the method wrapped is not a ConfigLoaderImpl's."""
        loader = getattr(self.load, "__self__", None)
        if not isinstance(loader, ConfigLoaderImpl):
            return None
        if self.composer is None or self.composer.config_name != master_config.hydra.job.config_name:
            self.composer = Composer(loader, master_config.hydra.job.config_name)
        sweep_config = self.composer([*master_config.hydra.overrides.hydra, *sweep_overrides])
        OmegaConf.copy_cache(from_config=master_config, to_config=sweep_config)  # as load_sweep_config does
        return sweep_config

    def __reduce__(self):
        return in_worker, (self.load, self.token)

    @contextlib.contextmanager
    def launch(self):
        """The launch of a batch: kept configs are handed out, none kept; at the end the rest are forgotten."""
        self.launching = True
        try:
            yield
        finally:
            self.launching = False
            self.kept.clear()


# A worker's ComposedOnce (in_worker), by the token of the launching process's that it stands for.
_in_worker: dict[str, ComposedOnce] = {}


def in_worker(load, token: str) -> ComposedOnce:
    """The ComposedOnce of the launching process's `token` in this process (a worker), made on the first unit of jobs
    it sends and kept for the next: a worker's later jobs of a shape it composed are derived from it (0.01 s, not the
    0.075 s of composing one whole on the 2-core CPU). It keeps no configs; `load`, the loader's method as each unit
    brings it, is that of the first unit (the same launch's loader)."""
    once = _in_worker.get(token)
    if once is None:
        if len(_in_worker) >= 4:  # a unit brings a launch's one or two (its HydraContext's, the sweeper's): the oldest go
            del _in_worker[next(iter(_in_worker))]
        once = _in_worker[token] = ComposedOnce(load, keep=0)
    return once
