"""Which runs of a sweep train together as one packed model (pack=true): a question of their configs alone."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from normlab.config.errors import ConfigError
from normlab.config.parse import flatten_config
from normlab.config.schema import RunConfig, bookkeeping_keys

PACKABLE_KEYS = ("lr", "seed")  # what the members of one pack may differ in
# Bookkeeping keys (a sweep's records ignore them) whose value a pack takes from its first member for all of them
# (normlab.train.pack): where and how it computes, what it measures and logs, when it saves. Members must
# share them, so jobs that differ in one train in separate packs.
PACK_WIDE_KEYS = ("device", "compile", "compile_mode", "tf32", "deterministic", "telemetry", "log_every", "ckpt")


def shared_settings(cfg: RunConfig) -> dict[str, Any]:
    """The flattened config a pack's members share: all but the packable keys and the bookkeeping keys each member
    keeps its own of (its name, wandb run, sinks, resume, ...); PACK_WIDE_KEYS are shared."""
    skip = [key for key in bookkeeping_keys() if key not in PACK_WIDE_KEYS]
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


TORCHRUN_REFUSED = "pack=true under torchrun: a pack trains in one process; run it without torchrun, or pack=false for DDP"
FP16_REFUSED = ("pack=true with precision=fp16: one GradScaler would skip every member's step when one member "
                "overflows; use precision=bf16 or fp32, or pack=false")


def check_packable(cfgs: Sequence[RunConfig]) -> None:
    """Raise ConfigError (one line) unless `cfgs` can train as one exact pack as far as their configs and the
    environment say: the same settings but for PACKABLE_KEYS, eager, not under torchrun, not precision=fp16. What
    the device decides (precision=auto is fp16 on a CUDA device without bf16) normlab.train.pack.check_pack adds."""
    if not cfgs:
        raise ConfigError("pack=true: a pack needs at least one run")
    first = shared_settings(cfgs[0])
    for cfg in cfgs[1:]:
        other = shared_settings(cfg)
        differ = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
        if differ:
            key = differ[0]
            raise ConfigError(
                f"pack=true: runs {cfgs[0].run_name} and {cfg.run_name} differ in {key} ({first.get(key)!r} and "
                f"{other.get(key)!r}): the runs of a pack may differ only in {', '.join(PACKABLE_KEYS)}"
            )
    cfg = cfgs[0]
    if cfg.compile:
        raise ConfigError("pack=true with compile=true: a pack trains eager; set compile=false, or pack=false to compile each run")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(TORCHRUN_REFUSED)
    if cfg.precision == "fp16":
        raise ConfigError(FP16_REFUSED)
