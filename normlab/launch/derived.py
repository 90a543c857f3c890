"""A sweep's job configs for the checks before Hydra starts, composed by Hydra once per shape of job.

Hydra composes a job in two steps: the defaults list, which only the config-group overrides choose, is merged into
a config; then the other overrides (`key=value`) are applied to it one by one, in order, and listed in its hydra
node. Two jobs of one grid that choose the same group options and set the same keys in the same order (`lr=1e-3
seed=0` and `lr=3e-3 seed=1`) differ only in that second step. `Composer` composes the first job of each such shape
(about 0.1 s a job on a 2-core CPU: 72 jobs, 8 seconds) and gives the others as a copy of it with their own values
applied by Hydra's own function, and their hydra node's override lists and override_dirname as Hydra writes them
(10 ms). A job with any other kind of override (a mapping value, `+key`, `~key`, a package) is composed whole, and
so is a job whose values do not apply (its refusal is then Hydra's own). The checks before Hydra starts compose a
sweep's jobs with it (normlab.launch.overrides.check_composition), and so does the sweeper's validation of the
jobs, whose configs the launch then runs (normlab.launch.composed): tests/test_derived.py checks that each config,
hydra node included, equals Hydra's own composition of the job.
"""

from __future__ import annotations

import copy
from typing import Optional

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict


class Composer:
    """`composer(job)`: the config `loader.load_configuration(config_name, job, RUN, from_shell=True)` gives, from a
    job of the same shape composed before where there is one (the module's docstring)."""

    def __init__(self, loader, config_name: str) -> None:
        self.loader, self.config_name = loader, config_name
        self.parser = OverridesParser.create()
        self.composed: dict[tuple, DictConfig] = {}  # by shape: the first job of each
        self.whole = 0  # jobs Hydra composed whole (for the tests and the benchmark)

    def __call__(self, job: list[str]) -> DictConfig:
        parsed = self.parser.parse_overrides(job)
        shape = self._shape(parsed)
        base = self.composed.get(shape) if shape is not None else None
        if base is not None:
            try:
                return _applied(base, parsed, self.loader.repository)
            except Exception:  # Hydra's own refusal, in its own words
                pass
        self.whole += 1
        cfg = self.loader.load_configuration(self.config_name, job, run_mode=RunMode.RUN, from_shell=True)
        if shape is not None and shape not in self.composed:
            self.composed[shape] = copy.deepcopy(cfg)  # the caller's to change: the base stays as Hydra composed it
        return cfg

    def _shape(self, parsed: list[Override]) -> Optional[tuple]:
        """The group options chosen and the keys set, in order; None for a job that is composed whole."""
        shape = []
        for override in parsed:
            if (override.is_sweep_override() or override.package is not None or isinstance(override.value(), dict)
                    or override.key_or_group == "hydra.searchpath"):  # Hydra rebuilds its config repository from it
                return None
            if self.loader.repository.group_exists(override.key_or_group):
                shape.append(("group", override.input_line))
            elif override.type in (OverrideType.CHANGE, OverrideType.FORCE_ADD):
                shape.append((override.type, override.key_or_group))
            else:
                return None
        return tuple(shape)


def _applied(base: DictConfig, parsed: list[Override], repository) -> DictConfig:
    """`base` (a job of the same shape, as Hydra composed it) with the values and the override lists of `parsed`."""
    cfg = copy.deepcopy(base)
    values = [o for o in parsed if not repository.group_exists(o.key_or_group)]
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    hydra = cfg.hydra
    with open_dict(hydra):
        for name, listed in (("hydra", [o for o in parsed if o.is_hydra_override()]),
                             ("task", [o for o in parsed if not o.is_hydra_override()])):
            given = list(hydra.overrides[name])  # the config's own entries, then the base job's overrides
            hydra.overrides[name] = given[: len(given) - len(listed)] + [o.input_line for o in listed]
        dirname = hydra.job.config.override_dirname
        hydra.job.override_dirname = get_overrides_dirname(
            overrides=[o for o in parsed if not o.is_hydra_override()], kv_sep=dirname.kv_sep,
            item_sep=dirname.item_sep, exclude_keys=OmegaConf.to_container(dirname.exclude_keys))
    return cfg
