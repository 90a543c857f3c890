"""A sweep's record of its grid: every command that added jobs to the sweep dir.

Hydra's multirun.yaml holds the last command run in a sweep dir only. `<sweep dir>/sweep.yaml` keeps each grid
sweep's command run there (its overrides, its Hydra overrides but the sweep dir's, its --config-dir and
--config-name), written as the sweep starts (normlab.launch.sweep_log's callback, under every launcher); a sweep dir
made before it had one starts it from its multirun.yaml. (A search sweeper's trials are drawn as it goes: its
multirun.yaml is its record.)

Imports stay light (no torch): the sweep's callback imports this module before any job runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from normlab.util.files import write_bytes_atomic

RECORD = "sweep.yaml"
HYDRA_RECORD = "multirun.yaml"
NOT_RECORDED = ("hydra.sweep.dir", "hydra.mode")  # the dir itself, and -m


def command_of(hydra: dict) -> dict[str, Any]:
    """The command a sweep's hydra node (multirun.yaml's, as plain data) ran: its overrides, its Hydra overrides but
    the sweep dir's and the mode's, its --config-dir and --config-name (None for the packaged ones)."""
    overrides = (hydra.get("overrides") or {})
    name = (hydra.get("job") or {}).get("config_name")
    return {"overrides": [str(o) for o in overrides.get("task") or []],
            "hydra": [str(o) for o in overrides.get("hydra") or [] if _key(str(o)) not in NOT_RECORDED],
            "config_dir": config_dir_of(hydra), "config_name": name if name and name != "config" else None}


def config_dir_of(hydra: dict) -> str | None:
    """The --config-dir a run or sweep was launched with, from its saved hydra node (plain data); None if none."""
    for source in (hydra.get("runtime") or {}).get("config_sources") or []:
        if source.get("provider") == "command-line" and source.get("schema") == "file":
            return str(source.get("path"))
    return None


def record_command(sweep_dir: str | Path, hydra_node) -> None:
    """Add the command of the sweep starting in `sweep_dir` (its hydra node) to the sweep's record, unless it is
    there already; a record begins with the command of the sweep dir's multirun.yaml, where there is one."""
    sweep_dir = Path(sweep_dir)
    commands = recorded_commands(sweep_dir)
    command = command_of(OmegaConf.to_container(hydra_node, resolve=False))
    if command in commands:
        return
    sweep_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({"commands": [*commands, command]}, sort_keys=False, allow_unicode=True)
    write_bytes_atomic(sweep_dir / RECORD, text.encode())


def recorded_commands(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """The commands recorded in `sweep_dir`'s sweep.yaml, else the one of its multirun.yaml; [] where it has neither."""
    sweep_dir = Path(sweep_dir)
    record = _yaml(sweep_dir / RECORD)
    if isinstance(record, dict) and isinstance(record.get("commands"), list):
        return [c for c in record["commands"] if isinstance(c, dict)]
    saved = _yaml(sweep_dir / HYDRA_RECORD)
    hydra = saved.get("hydra") if isinstance(saved, dict) else None
    return [command_of(hydra)] if isinstance(hydra, dict) else []


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")
