"""The metric-key grammar: how telemetry names what it measures, and how every reader parses it back.

A record is a flat mapping of slash-grouped keys (wandb's dashboard groups them by their first part).
A per-layer key is STAT/LAYER or STAT/LAYER/PART:

    act/resid_rms/L03            STAT = act/resid_rms, block 3, the whole block
    grad/norm/L03/mlp            STAT = grad/norm, block 3, PART = mlp
    norm/gain_mean/L03/norm1     STAT = norm/gain_mean, block 3, PART = norm1

LAYER is 'L' and the block index, zero-padded so that every label of a model has the same width
(`layer_label`) and wandb's panels sort. Keys without a LAYER (loss, grad/embed_norm, ...) are not
per-layer. This module is the one place that builds and parses them; it imports nothing of normlab.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Iterable, Mapping, NamedTuple

_LAYER_KEY = re.compile(r"^(?P<stat>.+?)/L(?P<layer>\d+)(?:/(?P<part>.+))?$")

# The per-layer statistics shown as end-of-run heatmaps and as compare's layer profiles:
# (STAT, short label, title).
RESID_RMS = "act/resid_rms"
GRAD_NORM = "grad/norm"
LAYER_PROFILES = (
    (GRAD_NORM, "gradient norm", "L2 norm of the gradient of each block's attention and MLP weights"),
    (RESID_RMS, "residual-stream RMS", "RMS of the residual stream after each block"),
)


class LayerKey(NamedTuple):
    stat: str
    layer: int
    part: str | None
    label: str  # the LAYER element as written, e.g. 'L03'


def layer_label(index: int, depth: int) -> str:
    """'L03' for block 3; wide enough that every label of a `depth`-block model has the same length."""
    return f"L{index:0{max(2, len(str(depth - 1)))}d}"


def layer_key(stat: str, label: str, part: str | None = None) -> str:
    """'act/resid_rms/L03', or with `part` 'grad/norm/L03/mlp'."""
    return f"{stat}/{label}" + (f"/{part}" if part else "")


@functools.lru_cache(maxsize=1 << 16)  # a run's keys recur every logged step; a LayerKey is immutable
def parse(key: str) -> LayerKey | None:
    """The parts of a per-layer key, or None for any other key."""
    m = _LAYER_KEY.match(key)
    if m is None:
        return None
    return LayerKey(m["stat"], int(m["layer"]), m["part"], f"L{m['layer']}")


def to_float(value: Any) -> float:
    """A value as metrics.jsonl writes it (number, null for NaN, "inf"/"-inf") as a float; NaN if not a number."""
    if value is None or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def layer_values(record: Mapping[str, Any], stat: str) -> dict[int, float]:
    """{block index: value} of the whole-block statistic `stat` (e.g. 'grad/norm') in one record; finite values only."""
    values = {}
    for key, raw in record.items():
        parsed = parse(key)
        if parsed and parsed.stat == stat and parsed.part is None:
            value = to_float(raw)
            if math.isfinite(value):
                values[parsed.layer] = value
    return values


def layer_table(records: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The per-layer statistics of `records` in long form: one row per (record, block) for every record
    that holds per-layer keys.

    Columns are 'step', 'layer' and one per statistic with the layer taken out of its key
    ('act/resid_rms', 'grad/norm/attn', 'norm/gain_mean/norm1', ...); a missing value is None.
    """
    columns: set[str] = set()
    by_record: list[tuple[Any, dict[str, dict[str, Any]]]] = []
    labels: set[str] = set()
    for record in records:
        per_layer: dict[str, dict[str, Any]] = {}
        for key, value in record.items():
            parsed = parse(key)
            if parsed is None:
                continue
            column = parsed.stat + (f"/{parsed.part}" if parsed.part else "")
            per_layer.setdefault(parsed.label, {})[column] = value
            columns.add(column)
        if per_layer:
            labels |= per_layer.keys()
            by_record.append((record.get("step"), per_layer))
    ordered = sorted(columns)
    layer_order = sorted(labels, key=lambda label: int(label[1:]))
    rows = [
        [step, label, *(per_layer.get(label, {}).get(c) for c in ordered)]
        for step, per_layer in by_record
        for label in layer_order
    ]
    return ["step", "layer", *ordered], rows
