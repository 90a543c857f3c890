"""Resume by run dir: `normlab train resume=<run dir>` (or `normlab resume <run dir>`) continues that run with
the config it was launched with, and the command that continues a stopped run.

A run dir holds the overrides Hydra composed the run from (.hydra/overrides.yaml), the Hydra settings it
ran under (.hydra/hydra.yaml: --config-dir, --config-name, hydra.job.chdir) and the resolved config
(config.json). `replay` puts the saved overrides back in front of the command line's, so Hydra composes
the run's config again and the run continues in its own dir (resume=auto there); `check_unchanged` then
holds the composed config to config.json: beside resume=, only bookkeeping keys may change (the schema's
`bookkeeping()` fields, which change no number of the result). A run dir without .hydra/overrides.yaml
(one written by `train()` from Python) resumes as before: with the config the command line gives.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from normlab.config import ConfigError, RunConfig, bookkeeping_keys, flatten_config
from normlab.launch.overrides import quoted_value
from normlab.launch.sweep_record import config_dir_of, recorded_commands, sweep_command

SAVED_OVERRIDES = Path(".hydra") / "overrides.yaml"
SAVED_HYDRA = Path(".hydra") / "hydra.yaml"
REPLAYED_HYDRA = ("hydra.job.chdir",)  # Hydra settings that change the run's config (paths: normlab.launch.paths)
NOT_REPLAYED = ("resume", "overwrite")  # how the run was started, not what it trains


@dataclass
class SavedRun:
    """What a run dir says about how its run was launched."""

    run_dir: Path
    overrides: list[str]
    hydra_overrides: list[str] = field(default_factory=list)
    config_dir: str | None = None
    config_name: str | None = None
    config: dict[str, Any] | None = None  # config.json, flattened; None before the run wrote it

    @classmethod
    def read(cls, run_dir: Path) -> "SavedRun | None":
        """The saved run of `run_dir`, or None if it has no .hydra/overrides.yaml."""
        if not (run_dir / SAVED_OVERRIDES).is_file():
            return None
        saved = cls(run_dir.absolute(), [str(o) for o in _yaml(run_dir / SAVED_OVERRIDES) or []])
        hydra = (_yaml(run_dir / SAVED_HYDRA) or {}).get("hydra") or {}
        saved.hydra_overrides = [str(o) for o in (hydra.get("overrides") or {}).get("hydra") or []
                                 if str(o).split("=", 1)[0] in REPLAYED_HYDRA]
        saved.config_dir = config_dir_of(hydra)
        name = (hydra.get("job") or {}).get("config_name")
        saved.config_name = name if name and name != "config" else None
        try:
            config = json.loads((run_dir / "config.json").read_text())
            saved.config = flatten_config(config) if isinstance(config, dict) else None
        except (OSError, ValueError):
            saved.config = None
        return saved


def _yaml(path: Path) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # a damaged file: as if there were none
        return None


def resume_spec(overrides: list[str]) -> str | None:
    """The path a single `resume=PATH` override names (not null or auto, not a sweep), else None."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return None  # the prechecks say what is wrong with it
    specs = [o.value() for o in parsed
             if o.key_or_group == "resume" and not o.is_delete() and not o.is_sweep_override()]
    return specs[-1] if specs and isinstance(specs[-1], str) and specs[-1] != "auto" else None


def saved_run_of(spec: str) -> SavedRun | None:
    """The saved run that resume=`spec` continues: `spec` is its run dir, or a checkpoint in its checkpoints/."""
    path = Path(spec)
    run_dir = path.parent.parent if path.is_file() and path.parent.name == "checkpoints" else path
    if not run_dir.is_dir():
        return None
    saved = SavedRun.read(run_dir)
    if saved is None and recorded_commands(run_dir):
        raise ConfigError(f"resume={spec}: a sweep dir, not a run dir: run the sweep again in it to continue its "
                          f"jobs: {sweep_command(run_dir)}")
    return saved


def replay(saved: SavedRun, spec: str, argv: list[str], overrides: list[str]) -> list[str]:
    """The command line (`argv`, whose overrides are `overrides`) that continues `saved`: its saved overrides,
    then the command line's, which win over them; its --config-dir and --config-name unless given; and for
    a run dir the run's own dir with resume=auto (a fresh start there if it has no checkpoint yet), for a
    checkpoint that checkpoint."""
    keys = {_key(o) for o in overrides}
    kept = [o for o in saved.hydra_overrides + saved.overrides
            if _key(o) not in keys and _key(o)[0] not in NOT_REPLAYED]
    given = [o for o in overrides if _key(o)[0] != "resume"]
    options = [a for a in argv if a not in overrides]
    if saved.config_dir and not any(a.startswith(("--config-dir", "-cd")) for a in options):
        options += ["--config-dir", saved.config_dir]
    if saved.config_name and not any(a.startswith(("--config-name", "-cn")) for a in options):
        options += ["--config-name", saved.config_name]
    if Path(spec).is_dir() and not keys & {("hydra.run.dir", None), ("overwrite", None)}:
        target = ["resume=auto", "hydra.run.dir=" + quoted_value(str(saved.run_dir))]
    else:
        target = ["resume=" + quoted_value(str(Path(spec).absolute()))]
    return options + kept + given + target


def _key(override: str) -> tuple[str, str | None]:
    """An override's key (a group's, a value's) and package: `norm=rms`, `+norm.eps=1`, `~lr`: norm, norm.eps, lr."""
    try:
        [parsed] = OverridesParser.create().parse_overrides([override])
        return parsed.key_or_group, parsed.package
    except Exception:
        return override.split("=", 1)[0].lstrip("+~"), None


def check_unchanged(saved: SavedRun, cfg: RunConfig, spec: str, given: list[str]) -> None:
    """ConfigError (one line naming the key, its saved value and the new one) unless `cfg`, the composed config
    of the command line that resumes `saved`, trains as its config.json does; `given`: the command line's own
    overrides, the ones to drop."""
    from normlab.train.checkpoint import config_differences, may_change  # torch: not for `normlab train --help`

    if saved.config is None:
        return  # stopped before it wrote config.json: nothing was trained with it
    differ = config_differences(saved.config, cfg)
    if not differ:
        return
    key, was, now = differ[0]
    more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
    # The override that sets the key (lr=, model=small), else the first that may not change (experiment=...).
    culprit = next((o for o in given if key == _key(o)[0] or key.startswith(_key(o)[0] + ".")), None)
    culprit = culprit or next((o for o in given if not (may_change(_key(o)[0]) or _key(o)[0].startswith("hydra"))),
                              None)
    where = f"resume={spec}: the run has {key}={was!r} (its config.json)"
    if culprit is None:
        raise ConfigError(f"{where}, but its saved overrides now compose {key}={now!r}{more}: normlab's configs "
                          f"changed since it ran; add {key}={_shown(was)} to continue it")
    raise ConfigError(f"{where}, this command gives {key}={now!r}{more}; beside resume= only bookkeeping keys may "
                      f"change ({', '.join(_bookkeeping_shown(saved.config))}): drop {culprit} to continue the run")


def _shown(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return quoted_value(value) if isinstance(value, str) else str(value)


def _bookkeeping_shown(flat: dict[str, Any]) -> list[str]:
    """The bookkeeping keys as a user writes them: a sub-config's as `ckpt.*`."""
    return [f"{k}.*" if any(key.startswith(k + ".") for key in flat) else k for k in bookkeeping_keys()]


def with_continue_command(err: BaseException) -> BaseException:
    """`err`, or for an unreadable newest checkpoint (checkpoint.UnreadableCheckpoint) the same refusal naming
    the command, ready to paste, that continues the run from its newest readable checkpoint."""
    from normlab.train.checkpoint import UnreadableCheckpoint  # torch: not for `normlab train --help`

    if not isinstance(err, UnreadableCheckpoint) or err.readable is None:
        return err
    command = shlex.join(["normlab", "resume", str(Path(err.readable.path).absolute())])
    return UnreadableCheckpoint(err.error, err.readable, command)


def continue_command(run_dir: str, multirun: bool, sweep_dir: str) -> str:
    """The command, ready to paste into a shell, that continues the run stopped in `run_dir`: `normlab resume
    DIR`; a sweep's job: the sweep's own command again with hydra.sweep.dir (so every job lands in its old
    dir and continues); under torchrun, torchrun's."""
    import normlab.train.distributed as distributed  # torch: not for `normlab train --help`

    if multirun:
        sweep = "hydra.sweep.dir=" + quoted_value(str(Path(sweep_dir).absolute()))
        launched = sys.argv[1:] if sys.argv and sys.argv[0] == "normlab train" else None
        if launched is None:  # a job in a process of its own (submitit's): its command line is not here
            return f"the sweep's command again with {shlex.quote(sweep)}"
        kept = [a for a in _absolute_config_dir(launched) if not a.startswith("hydra.sweep.dir=")]
        return shlex.join(["normlab", "train", *kept, sweep])
    command = ["normlab", "resume", str(Path(run_dir).absolute())]
    if distributed.world_size() > 1:
        local = os.environ.get("LOCAL_WORLD_SIZE", str(distributed.world_size()))
        command = ["torchrun", f"--nproc_per_node={local}", "-m", *command]
    return shlex.join(command)


def _absolute_config_dir(argv: list[str]) -> list[str]:
    """`argv` with its --config-dir (-cd) made absolute against the launch dir, so the command works from anywhere."""
    try:
        launch_dir = HydraConfig.get().runtime.cwd  # the job may run in its own dir (hydra.job.chdir=true)
    except Exception:
        launch_dir = os.getcwd()
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config-dir", "-cd") and i + 1 < len(out):
            out[i + 1] = os.path.join(launch_dir, out[i + 1])
        elif arg.startswith("--config-dir="):
            out[i] = "--config-dir=" + os.path.join(launch_dir, arg.split("=", 1)[1])
    return out
