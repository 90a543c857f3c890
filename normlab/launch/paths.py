"""Relative paths on the command line under `hydra.job.chdir=true`, where a job runs inside its run dir.

A user types paths relative to the dir they launch from (`data.files=[notes.txt]`); in the run dir they
would point nowhere. Hydra's convention (hydra.utils.to_absolute_path) is to read them against the launch
dir, so each job's config has them made absolute before it is built: the run's config.json then names the
files it read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The config keys that hold a local path, and whether a relative value is certainly one: tokenizer.name
# is a hub name (gpt2) unless a file or dir of that name lies in the launch dir.
PATH_KEYS = (("data.files", True), ("data.cache_dir", True), ("tokenizer.name", False), ("resume", True))
NOT_PATHS = (None, "auto")  # resume's other values


def from_launch_dir(raw: dict[str, Any], launch_dir: str | os.PathLike) -> dict[str, Any]:
    """The resolved config tree `raw` (changed in place, and returned) with each relative path of PATH_KEYS
    made absolute against `launch_dir`."""
    for key, always in PATH_KEYS:
        section, _, leaf = key.rpartition(".")
        node = raw.get(section) if section else raw
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node[leaf]
        if isinstance(value, list):
            node[leaf] = [_absolute(v, launch_dir, always) for v in value]
        elif value not in NOT_PATHS:
            node[leaf] = _absolute(value, launch_dir, always)
    return raw


def _absolute(value: Any, launch_dir: str | os.PathLike, always: bool) -> Any:
    if not isinstance(value, str) or not value:
        return value
    path = Path(os.path.expanduser(value))
    if path.is_absolute():
        return value
    resolved = Path(launch_dir) / path
    return str(resolved) if always or resolved.exists() else value
