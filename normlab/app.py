"""The thin Hydra layer around `train(cfg, run_dir)`.

It composes the config from normlab's packaged conf/ (plus any --config-dir),
checks the command line before Hydra starts, validates each job's config, and
hands the run dir Hydra made to the training loop.
"""

from __future__ import annotations

import secrets
import sys
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .config import NORMS, PLACEMENTS, ConfigError, format_lr

CONFIG_MODULE = "normlab.conf"
CONFIG_GROUPS = ("model", "norm", "data", "optim")


def register_resolvers() -> None:
    """Resolvers the packaged config uses: ${uid:} (a per-launch id) and ${lr_label:${lr}}."""
    if not OmegaConf.has_resolver("uid"):
        # Cached, and Hydra copies the cache into every sweep job, so one launch keeps one id.
        OmegaConf.register_new_resolver("uid", lambda: secrets.token_hex(3), use_cache=True)
    if not OmegaConf.has_resolver("lr_label"):
        OmegaConf.register_new_resolver("lr_label", lambda lr: format_lr(float(lr)))


def group_options(group: str, config_dirs: list[str]) -> set[str]:
    """Option names of config group `group` in the packaged conf/ and in user config dirs."""
    names: set[str] = set()
    packaged = resources.files(CONFIG_MODULE) / group
    if packaged.is_dir():
        names |= {p.name[:-5] for p in packaged.iterdir() if p.name.endswith(".yaml")}
    for d in config_dirs:
        names |= {p.stem for p in (Path(d) / group).glob("*.yaml")}
    return names


def _check_value(key: str, value) -> None:
    if key == "placement" and value not in PLACEMENTS:
        raise ConfigError(f"placement={value!r} is not allowed: choose one of {', '.join(PLACEMENTS)}")
    if key == "norm.name" and value not in NORMS:
        raise ConfigError(f"norm.name={value!r} is not allowed: choose one of {', '.join(NORMS)}")
    if key == "lr" and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ConfigError(f"lr={value!r}: must be a positive number")
    if key == "depth" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ConfigError(f"depth={value!r}: must be an integer >= 1")
    if key == "telemetry.every" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ConfigError(f"telemetry.every={value!r}: must be an integer >= 0 (0 turns telemetry off)")


def precheck(overrides: list[str], config_dirs: list[str]) -> None:
    """Reject unknown group options and bad sweep values before Hydra launches any job."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if override.is_delete():
            continue
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        if key in CONFIG_GROUPS:
            known = group_options(key, config_dirs)
            for v in values:
                if v not in known:
                    raise ConfigError(f"{key}={v!r} is not a known option: choose one of {', '.join(sorted(known))}")
        else:
            for v in values:
                _check_value(key, v)


def run_train(argv: list[str]) -> int:
    """`normlab train ARGS`: run Hydra with ARGS; returns the process exit code."""
    from hydra._internal.utils import get_args_parser

    register_resolvers()
    args = get_args_parser().parse_args(argv)
    if not args.help and not args.hydra_help:
        config_dirs = [args.config_dir] if args.config_dir else []
        try:
            precheck(args.overrides, config_dirs)
        except ConfigError as err:
            return _fail(err)
        except Exception as err:  # Hydra's override grammar: one line is enough
            return _fail(f"could not parse the overrides: {str(err).splitlines()[0]}")
    sys.argv = ["normlab train", *argv]
    _hydra_main()
    return 0


def _fail(err) -> int:
    print(f"normlab: error: {err}", file=sys.stderr)
    return 2


def _task(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from .config import RunConfig

    hc = HydraConfig.get()
    try:
        run_cfg = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    except ConfigError as err:
        sys.exit(_fail(err))
    if hc.mode == RunMode.MULTIRUN and run_cfg.wandb.group is None:
        run_cfg.wandb.group = Path(hc.sweep.dir).name

    from .train import train

    summary = train(run_cfg, hc.runtime.output_dir)
    return summary["final_val_loss"]


def _hydra_main() -> None:
    import hydra

    hydra.main(version_base="1.3", config_path="pkg://" + CONFIG_MODULE, config_name="config")(_task)()
