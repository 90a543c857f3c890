"""ComposedOnce: a sweep's job configs composed once where Hydra composes each twice (normlab's launcher uses it)."""

from __future__ import annotations

import contextlib
import copy
from typing import List

from omegaconf import DictConfig


class ComposedOnce:
    """A config loader's load_sweep_config that composes each job once where Hydra composes it twice: the
    sweeper composes every job of a batch to validate it, then the launcher composes it again to run it
    (0.2 s a job). Outside a launch (the sweeper validating), a copy of each config composed is kept; in
    the launch, the first call for a job takes its copy (so every caller gets a config of its own), and
    the launch's end forgets what no call took. At most `keep` are kept. Pickled (a config loader sent to a worker
    process), it is the method it wraps: the worker composes its jobs itself, and the configs kept stay here."""

    def __init__(self, load, keep: int = 256):
        self.load, self.keep, self.kept = load, keep, {}
        self.launching = False

    def __call__(self, master_config: DictConfig, sweep_overrides: List[str]) -> DictConfig:
        key = (id(master_config), tuple(sweep_overrides))
        if self.launching and key in self.kept:
            return self.kept.pop(key)
        sweep_config = self.load(master_config, sweep_overrides)
        if not self.launching and len(self.kept) < self.keep:
            self.kept[key] = copy.deepcopy(sweep_config)  # a copy of its own: callers set their job's fields
        return sweep_config

    def __reduce__(self):
        return getattr, (self.load.__self__, self.load.__name__)

    @contextlib.contextmanager
    def launch(self):
        """The launch of a batch: kept configs are handed out, none kept; at the end the rest are forgotten."""
        self.launching = True
        try:
            yield
        finally:
            self.launching = False
            self.kept.clear()
