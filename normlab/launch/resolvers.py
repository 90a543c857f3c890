"""What normlab's packaged config needs registered before Hydra composes it: the schema `base` (RunConfig's
defaults, the first entry of conf/config.yaml's defaults list) and the OmegaConf resolvers ${launch_time:FORMAT},
${uid:}, ${lr_label:${lr}} and ${run_name:}. `register_resolvers` registers them all; nothing registers them at
import of this module."""

from __future__ import annotations

import secrets
import time
from datetime import datetime
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from normlab.config import ConfigError, RunConfig, format_lr


SCHEMA = "base"  # the name conf/config.yaml's defaults list gives RunConfig's defaults


def register_resolvers(stamp: tuple[float, str] | None = None) -> None:
    """What the packaged config uses: the schema `base` (register_schema), and the resolvers
    ${launch_time:FORMAT} and ${uid:} (the launch's time and id, which name its output dirs),
    ${lr_label:${lr}} and ${run_name:}.

    `stamp` = (unix time, id) pins the first two (torchrun ranks pass rank 0's); without it each
    process draws its own once. Both are cached, and Hydra copies the cache into every sweep job
    (and submitit pickles it with the launcher), so one launch, and a requeued job, keeps its dirs.
    """
    register_schema()
    if stamp is not None or not OmegaConf.has_resolver("uid"):
        launched, uid = stamp or (time.time(), secrets.token_hex(3))
        OmegaConf.register_new_resolver("uid", lambda: uid, use_cache=True, replace=True)
        OmegaConf.register_new_resolver(
            "launch_time", lambda fmt: datetime.fromtimestamp(launched).strftime(fmt), use_cache=True, replace=True
        )
    if not OmegaConf.has_resolver("lr_label"):
        OmegaConf.register_new_resolver("lr_label", lambda lr: format_lr(float(lr)))
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", _run_name)


def register_schema() -> None:
    """Register RunConfig's defaults with Hydra's ConfigStore as `base`, the config that conf/config.yaml
    composes first: so the YAML holds choices (a preset's size, a norm's name), never a second copy of a
    default, and `normlab train` with no overrides composes RunConfig(). Stored as a plain mapping, not as
    the dataclass: OmegaConf's typed nodes cannot hold `final_norm: bool | str` and would refuse a bad
    value in lines of their own, where RunConfig.from_dict says what is wrong in one line."""
    ConfigStore.instance().store(name=SCHEMA, node=RunConfig().to_dict())


def task_dict(cfg: DictConfig) -> dict:
    """A job's composed config without its hydra node, resolved, as plain data (what RunConfig.from_dict reads):
    what OmegaConf.to_container(resolve=True) gives for the config Hydra hands the job, which has no hydra node.
    Read section by section, not from a copy without the node (DictConfig.copy, OmegaConf.masked_copy: 5-8 times
    as long per job, c13396b measured), except where a value of the job's own names hydra: an interpolation into
    the node must fail here as it fails in the job, and only the copy lacks the node."""
    keys = [key for key in cfg if key != "hydra"]
    if "hydra" in cfg and _names_hydra(cfg, keys):
        return OmegaConf.to_container(OmegaConf.masked_copy(cfg, keys), resolve=True)
    return {key: _plain(cfg, key) for key in keys}


def _names_hydra(cfg: DictConfig, keys: list) -> bool:
    """Whether the values of `keys` in `cfg`, unresolved, hold the word hydra anywhere (a key, a string)."""
    values = [OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else value
              for _, value in cfg.items_ex(resolve=False, keys=keys)]
    return "hydra" in repr(values)


def _plain(cfg: DictConfig, key: str) -> Any:
    """cfg[key] resolved, as OmegaConf.to_container(cfg, resolve=True) gives it (a missing value as '???')."""
    if OmegaConf.is_missing(cfg, key):
        return MISSING
    value = cfg[key]
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _run_name(*, _root_: DictConfig) -> str:
    """${run_name:}: the job's run name (RunConfig.run_name), so run dirs and wandb runs share it."""
    raw = task_dict(_root_)  # without the hydra node, which holds the dir being named
    try:
        return RunConfig.from_dict(raw, validate=False).run_name
    except ConfigError:
        return "invalid-config"  # the job itself then stops with the one-line error
