"""A run's identity across a resume: the config keys a resumed run may change, and the first difference
between a checkpoint's flattened config and a run's that it may not."""

from __future__ import annotations

from typing import Any, Mapping

from normlab.config import RunConfig, bookkeeping_keys, flatten_config

# Config keys a resumed run may change: the schema's bookkeeping, which changes no number of the result.
MAY_CHANGE_ON_RESUME = bookkeeping_keys()


def config_difference(saved: Mapping[str, Any], cfg: RunConfig) -> str | None:
    """None if the flattened config `saved` trains as `cfg` does (bookkeeping keys aside), else the first
    difference in words: "lr=0.003, this run has lr=0.01 (and 2 more differences)"."""
    current = flatten_config(cfg)
    missing = object()
    differ = [
        key for key in sorted(set(saved) | set(current))
        if not _may_change(key) and saved.get(key, missing) != current.get(key, missing)
    ]
    if not differ:
        return None
    key = differ[0]
    more = f" (and {len(differ) - 1} more differences)" if len(differ) > 1 else ""
    return f"{key}={saved.get(key, '<absent>')!r}, this run has {key}={current.get(key, '<absent>')!r}{more}"


def _may_change(key: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in MAY_CHANGE_ON_RESUME)
