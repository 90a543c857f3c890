"""Which runs of a sweep train together as one packed model (pack=true): a question of their configs alone."""

from __future__ import annotations

import json
from typing import Any, Sequence

from normlab.config.parse import flatten_config
from normlab.config.schema import RunConfig, bookkeeping_keys

PACKABLE_KEYS = ("lr", "seed")  # what the members of one pack may differ in


def shared_settings(cfg: RunConfig) -> dict[str, Any]:
    """The flattened config a pack's members share: all but the packable and the bookkeeping keys."""
    skip = bookkeeping_keys()
    return {
        key: value for key, value in flatten_config(cfg).items()
        if key not in PACKABLE_KEYS and not any(key == b or key.startswith(b + ".") for b in skip)
    }


def pack_key(cfg: RunConfig) -> str:
    """Equal for two configs iff they may train in one pack."""
    return json.dumps(shared_settings(cfg), sort_keys=True, default=str)


def pack_groups(cfgs: Sequence[RunConfig | None]) -> list[list[int]]:
    """A sweep's jobs as they train, as positions in `cfgs` (RunConfigs, or None for a job whose config
    could not be built): the jobs with pack=true grouped by pack_key, and every other job alone; groups
    ordered by their first job, and each group's jobs in order."""
    packed = [cfg is not None and cfg.pack for cfg in cfgs]
    groups: dict[str, list[int]] = {}
    for i, cfg in enumerate(cfgs):
        groups.setdefault("pack " + pack_key(cfg) if packed[i] else f"job {i}", []).append(i)
    return sorted(groups.values())
