"""A run's identity across a resume: the config keys a resumed run may change, and the first difference
between a checkpoint's flattened config and a run's that it may not."""

from __future__ import annotations

from typing import Any, Mapping

from normlab.config import RunConfig, bookkeeping_keys, flatten_config, is_bookkeeping

# Config keys a resumed run may change: the schema's bookkeeping, which changes no number of the result.
MAY_CHANGE_ON_RESUME = bookkeeping_keys()


ABSENT = "<absent>"  # a key one of two configs lacks (a config.json of an older normlab)


def config_differences(saved: Mapping[str, Any], cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """(key, saved value, `cfg`'s value) for each key in which the flattened config `saved` and `cfg` differ,
    bookkeeping keys aside, in key order; ABSENT stands for a key one of them lacks."""
    current = flatten_config(cfg)
    missing = object()
    return [
        (key, saved.get(key, ABSENT), current.get(key, ABSENT)) for key in sorted(set(saved) | set(current))
        if not may_change(key) and saved.get(key, missing) != current.get(key, missing)
    ]


def config_difference(saved: Mapping[str, Any], cfg: RunConfig) -> str | None:
    """None if the flattened config `saved` trains as `cfg` does (bookkeeping keys aside), else the first
    difference in words: "lr=0.003, this run has lr=0.01 (and 2 more differences)"."""
    differ = config_differences(saved, cfg)
    if not differ:
        return None
    key, was, now = differ[0]
    more = f" (and {len(differ) - 1} more differences)" if len(differ) > 1 else ""
    return f"{key}={was!r}, this run has {key}={now!r}{more}"


def may_change(key: str) -> bool:
    """Whether dotted key `key` may change when a run resumes: a bookkeeping key, or a key under one."""
    return is_bookkeeping(key)
