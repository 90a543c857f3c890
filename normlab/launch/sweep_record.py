"""A sweep's record of its grid: every command that added jobs to the sweep dir, and the command that continues them.

Hydra's multirun.yaml holds the last command run in a sweep dir only. `<sweep dir>/sweep.yaml` keeps each grid
sweep's command run there (its overrides, its Hydra overrides but the sweep dir's, its --config-dir and
--config-name), written as the sweep starts (normlab.launch.sweep_log's callback, under every launcher); a sweep dir
made before it had one starts it from its multirun.yaml. (A search sweeper's trials are drawn as it goes: its
multirun.yaml is its record.) `sweep_command` is what `normlab resume <sweep dir>` names: the commands that run every
job of the grid again in the dir (each run found where its dir is: normlab.launch.sweep_index), merged into one
where they differ in one key's list of values, and never with overwrite=true (which would delete the runs' records).

Imports stay light (no torch): the sweep's callback imports this module before any job runs.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from normlab.config import is_bookkeeping, run_identity
from normlab.launch.overrides import quoted_value
from normlab.util.files import write_bytes_atomic

RECORD = "sweep.yaml"
HYDRA_RECORD = "multirun.yaml"
NOT_CONTINUED = ("overwrite", "resume")  # how a command started its runs, not which runs: left out of the command
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


def sweep_command(sweep_dir: str | Path) -> str:
    """The command, ready to paste, that runs every job of the grid of `sweep_dir` again there (commands joined by &&
    where one does not hold them all): finished runs are not trained again, stopped ones continue, unstarted ones
    start. overwrite= and resume= are left out."""
    commands = []
    for command in recorded_commands(sweep_dir):
        kept = [o for o in command.get("overrides") or [] if _key(o) not in NOT_CONTINUED]
        commands.append({**command, "overrides": kept})
    sweep = "hydra.sweep.dir=" + quoted_value(str(Path(sweep_dir).absolute()))
    lines = []
    for command in _merged(commands):
        options = ["-m", *(["--config-dir", command["config_dir"]] if command.get("config_dir") else []),
                   *(["--config-name", command["config_name"]] if command.get("config_name") else [])]
        lines.append(shlex.join(["normlab", "train", *options, *command.get("hydra", []), *command["overrides"], sweep]))
    return " && ".join(lines)


def _merged(commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`commands` with each one whose jobs an earlier one holds left out, and each one that differs from an earlier
    one in one key's plain list of values merged into it (lr=1e-3,3e-3 and lr=1e-2: lr=1e-3,3e-3,1e-2)."""
    merged: list[dict[str, Any]] = []
    for command in commands:
        for i, earlier in enumerate(merged):
            union = _union(earlier, command)
            if union is not None:
                merged[i] = union
                break
        else:
            merged.append(command)
    return merged


def _union(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """One command whose jobs are those of `a` and `b` (b the later), or None where none is this simple. How the jobs
    run (bookkeeping keys, the launcher's settings) changes no run: those of `b` are taken."""
    if [a.get(k) for k in ("config_dir", "config_name")] != [b.get(k) for k in ("config_dir", "config_name")]:
        return None
    if [o for o in a.get("hydra", []) if not _runs_how(o)] != [o for o in b.get("hydra", []) if not _runs_how(o)]:
        return None
    values_a, values_b = _values(a["overrides"]), _values(b["overrides"])
    grid = {key for key in values_a or {} if not is_bookkeeping(key)}
    if values_a is None or values_b is None or grid != {key for key in values_b if not is_bookkeeping(key)}:
        return None
    # Two grids make one where they differ in one key's values at most; b's within a's are a's.
    differ = [] if all(set(values_b[k]) <= set(values_a[k]) for k in grid) else [
        key for key in grid if set(values_b[key]) != set(values_a[key])]
    if len(differ) > 1 or any(t is None for key in differ for t in (*values_a[key].values(), *values_b[key].values())):
        return None
    added = {key: ",".join(text for value, text in values_b[key].items() if value not in values_a[key]) for key in differ}
    later = {_key(o): o for o in b["overrides"] if is_bookkeeping(_key(o))}
    overrides = [later.pop(_key(o), None) if is_bookkeeping(_key(o)) else o + "," + added[_key(o)] if _key(o) in added
                 else o for o in a["overrides"]]
    return {**b, "overrides": [o for o in overrides if o is not None] + list(later.values())}


def _runs_how(override: str) -> bool:
    """Whether a Hydra override says how a sweep's jobs run (its launcher and the launcher's settings), not which."""
    return _key(override) == "hydra/launcher" or _key(override).startswith("hydra.launcher.")


def _values(overrides: list[str]) -> dict[str, dict[Any, str | None]] | None:
    """{key: {value: its text}} of `overrides`, a plain list of values as each value (lr=1e-3,3e-3), anything else
    (range, glob, a quoted or bracketed value) as one value whose text is None; None if they do not parse."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return None
    values: dict[str, dict[Any, str | None]] = {}
    for text, override in zip(overrides, parsed):
        typed = text.split("=", 1)[1] if "=" in text else ""
        if any(c in typed for c in "()[]{}'\"\\$") or override.is_delete():
            values[override.key_or_group] = {("as typed", text): None}
            continue
        items = typed.split(",")
        shown = OverridesParser.create().parse_overrides([f"{override.key_or_group}={v}" for v in items])
        values[override.key_or_group] = {run_identity({"v": one.value()}): v for one, v in zip(shown, items)}
    return values


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")
