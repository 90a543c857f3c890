"""A run's metric records read back from whichever sink wrote them: metrics.jsonl, else metrics.csv.

metrics.jsonl holds every key of every logged step; metrics.csv (sinks=[csv]) only the run-level
columns (step, tokens, loss, val_loss, val_bpb, lr, grad_norm, tokens_per_s, status), so a run
read from it has no per-layer telemetry. Rows that are not readable (a line torn by a kill, not
UTF-8, a value of the wrong type) are counted and skipped, never guessed at.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from normlab import keys

METRICS = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
METRICS_FILES = (METRICS, METRICS_CSV)  # in the order compare prefers them
TEXT_COLUMNS = ("status",)  # the csv columns that hold text; every other one holds numbers


def read_records(run_dir: Path) -> tuple[list[dict[str, Any]], int, str | None]:
    """The run's metric rows, the number of unreadable lines skipped, and the file read (None if neither exists)."""
    if (run_dir / METRICS).is_file():
        return *_read_jsonl(run_dir / METRICS), METRICS
    if (run_dir / METRICS_CSV).is_file():
        return *_read_csv(run_dir / METRICS_CSV), METRICS_CSV
    return [], 0, None


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    rows, bad = [], 0
    with open(path, "rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))  # a line of invalid UTF-8 is a bad line, like torn JSON
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict) and _row_is_sound(row):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def _read_csv(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Rows of metrics.csv as the records metrics.jsonl would hold: numbers as numbers, an empty cell as no key."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return [], 1
    rows, bad = [], 0
    for cells in csv.DictReader(io.StringIO(text)):
        row = _csv_row(cells)
        if row is None:
            bad += 1
        elif row:
            rows.append(row)
    return rows, bad


def _csv_row(cells: dict[str | None, Any]) -> dict[str, Any] | None:
    """One csv row as a record; None if it is not readable (too many or too few cells, a number that is not one)."""
    if None in cells or None in cells.values():  # more cells than columns, or fewer (a line cut short)
        return None
    row: dict[str, Any] = {}
    for column, text in cells.items():
        if text == "":
            continue
        if column in TEXT_COLUMNS:
            row[column] = text
        elif text.lstrip("-").isdigit():
            row[column] = int(text)
        else:
            try:
                row[column] = float(text)
            except ValueError:
                return None
    return row if _row_is_sound(row) else None


_NUMBER_TYPES = frozenset([int, float, type(None)])  # what JSON gives a number or null (NaN); not bool


def number_text(text: str) -> bool:
    """A number written as text, as metrics are ("inf", "-inf", "nan", "1e-3")."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _row_is_sound(row: dict[str, Any]) -> bool:
    """A metrics row compare can use: an integer step (if any), and numbers, null or a number as text ("inf")
    everywhere but in the text columns. (Exact types, not isinstance: a row has a hundred values and a sweep
    thousands of rows.)"""
    step = row.get("step")
    if step is not None and type(step) is not int:
        return False
    for key, value in row.items():
        kind = type(value)
        if kind is str:
            if key not in TEXT_COLUMNS and not number_text(value):
                return False
        elif kind not in _NUMBER_TYPES:
            return False
    return True


# keys.parse is a regular expression, and a sweep's rows share a few layouts of their hundred keys: the keys
# of `stats` in each layout are found once.
_LAYOUTS: dict[tuple[tuple[str, ...], frozenset[str]], list[tuple[str, str, int]]] = {}


def _wanted(layout: tuple[str, ...], stats: frozenset[str]) -> list[tuple[str, str, int]]:
    """(key, STAT, block) of each key of `layout` that is a whole-block key of one of `stats`."""
    found = _LAYOUTS.get((layout, stats))
    if found is None:
        if len(_LAYOUTS) > 10_000:
            _LAYOUTS.clear()
        parsed = [(key, keys.parse(key)) for key in layout]
        found = [(key, p.stat, p.layer) for key, p in parsed if p and p.part is None and p.stat in stats]
        _LAYOUTS[layout, stats] = found
    return found


def layer_series(rows: list[dict[str, Any]], stats: frozenset[str]) -> dict[str, list[tuple[int, dict[int, float]]]]:
    """The whole-block per-layer statistics `stats` of `rows`: {STAT: [(step, {block: value}), ...]} in row
    order, finite values only, rows without the statistic left out."""
    series: dict[str, list[tuple[int, dict[int, float]]]] = {}
    for row in rows:
        found: dict[str, dict[int, float]] = {}
        for key, stat, layer in _wanted(tuple(row), stats):
            value = keys.to_float(row[key])
            if math.isfinite(value):
                found.setdefault(stat, {})[layer] = value
        for stat, values in found.items():
            series.setdefault(stat, []).append((row.get("step"), values))
    return series
