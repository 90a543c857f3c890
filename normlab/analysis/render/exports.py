"""The report's tables as data: arms.csv / arms.json (the ranked table, a row per arm) and runs.csv /
runs.json (a row per run), numbers as numbers, for a notebook or a paper's table.

arms.* holds every column of the ranked table (ranking.py), whatever columns it has: a cell's text
becomes numbers ("2.7129 ± 0.0468" is the column and `<column> std`, "0 of 4" the column and
`<column> of`, a dash with its footnote mark an empty value), and the figures the table rounds are
then written at full precision from the arm's results. Then the arm's full name and its settings.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any

from normlab.analysis.stats.arms import ArmResult, mean_std
from normlab.analysis.stats.comparison import Comparison
from normlab.analysis.render.ranking import MARKS, MISSING, header, ranking
from normlab.analysis.read.runs import MEASURES, Run
from normlab.util.files import write_bytes_atomic

EXPORTS = ("arms.csv", "arms.json", "runs.csv", "runs.json")
FIGURE_FORMATS = ("png", "svg", "pdf")  # the formats `normlab compare --format` may draw the figures in
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan"
_PLUS_MINUS = re.compile(rf"({_NUMBER}) ± ({_NUMBER})")
_OF = re.compile(rf"({_NUMBER}) of ({_NUMBER})")
_LEADING = re.compile(rf"({_NUMBER})\s+\((.*)\)")


def cell_values(column: str, text: str) -> dict[str, Any]:
    """A table cell as {column: value, ...}: numbers as numbers, a dash (and its footnote mark) as None."""
    text = text.strip().rstrip(MARKS)
    if text in ("", MISSING):
        return {column: None}
    if found := _PLUS_MINUS.fullmatch(text):
        return {column: float(found[1]), f"{column} std": float(found[2])}
    if found := _OF.fullmatch(text):
        return {column: _number(found[1]), f"{column} of": _number(found[2])}
    if found := _LEADING.fullmatch(text):
        return {column: _number(found[1]), f"{column} detail": found[2]}
    if re.fullmatch(_NUMBER, text):
        return {column: _number(text)}
    return {column: text}


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if math.isfinite(value) and value == int(value) and re.fullmatch(r"[-+]?\d+", text) else value


def arm_records(comparison: Comparison) -> list[dict[str, Any]]:
    """A record per arm, ranked: the ranked table's columns as numbers, then the exact figures and the settings."""
    rows, _ = ranking(comparison)
    head = header(comparison)
    records = []
    for result, row in zip(comparison.ranked, rows):
        record: dict[str, Any] = {}
        gap = _gap_values(comparison, result)  # the gap columns' text ("−0.0100", "[−0.05, +0.07] 3 paired seeds")
        for column, text in zip(head, row):
            if column == "gap to best":
                record[column] = gap.pop(column)
            elif column == "95% interval":
                record.update(gap)
            else:
                record.update(cell_values(column, text))
        record.update(_exact(result, MEASURES[comparison.measure]))
        record["arm (full)"] = result.arm.full_label
        record.update({"norm": result.arm.norm, "placement": result.arm.placement, **dict(result.arm.extras)})
        records.append(record)
    return records


def _gap_values(comparison: Comparison, result: ArmResult) -> dict[str, Any]:
    """The gap to the best arm as numbers: the gap (0 on the best arm's row), its 95% interval's bounds (None
    without one), what it is over ("paired", "Welch") and its numbers of seeds."""
    if result is comparison.ranked[0] and result.best_point is not None:
        return {"gap to best": 0.0, "95% interval low": None, "95% interval high": None, "gap kind": None, "gap n": None,
                "gap n other": None}  # fmt: skip
    gap = comparison.gaps.get(result.arm)
    if gap is None:
        return {"gap to best": None, "95% interval low": None, "95% interval high": None, "gap kind": None, "gap n": None,
                "gap n other": None}  # fmt: skip
    return {"gap to best": _finite(gap.diff), "95% interval low": _finite(gap.low), "95% interval high": _finite(gap.high),
            "gap kind": gap.kind, "gap n": gap.n, "gap n other": gap.n_other or None}  # fmt: skip


def _exact(result: ArmResult, measure: str) -> dict[str, Any]:
    """The figures the table rounds, at full precision (the table's column names)."""
    point = result.best_point
    mean, std = mean_std(point.finished_losses) if point is not None else (math.nan, math.nan)
    stability = result.stability
    exact = {
        f"final {measure}": mean, f"final {measure} std": std, "best lr": result.best_lr,
        "LR sensitivity": result.sensitivity, "LR sensitivity std": result.sensitivity_std,
        "init loss": result.init_loss,
    }  # fmt: skip
    if stability is not None:
        exact.update({"max grad norm": stability.max_grad_norm, "max attn logit": stability.max_attn_logit})
    return {key: _finite(value) for key, value in exact.items()}


def run_records(comparison: Comparison) -> list[dict[str, Any]]:
    """A record per run, in the report's order: what its row in report.md shows, at full precision."""
    measure = MEASURES[comparison.measure]
    records = []
    for run in comparison.runs:
        arm = comparison.arm_of.get(run.path)
        records.append({
            "run": comparison.run_label(run), "arm": arm.label if arm else None, "norm": run.norm,
            "placement": run.placement, "depth": run.depth, "lr": _finite(run.lr), "seed": run.seed,
            f"final {measure}": _finite(run.final_val_loss), f"best {measure}": _finite(run.best_val_loss),
            "init loss": _finite(run.init_loss), "status": run.status, "diverged at step": run.diverged_step,
            "last step": run.last_step, "tokens/s": _finite(run.tokens_per_s), "wall time s": _wall(run),
            "path": str(run.path),
        })  # fmt: skip
    return records


def _wall(run: Run) -> float | None:
    value = run.summary.get("wall_time_s")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def csv_text(records: list[dict[str, Any]]) -> str:
    """The records as CSV: every key any record has, in first-seen order; None an empty cell."""
    columns = list(dict.fromkeys(key for record in records for key in record))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in record.items()} for record in records)
    return buffer.getvalue()


def write_exports(comparison: Comparison, out: Path) -> list[str]:
    """Write arms.csv, arms.json, runs.csv and runs.json into `out`; returns their names."""
    for name, records in (("arms", arm_records(comparison)), ("runs", run_records(comparison))):
        write_bytes_atomic(out / f"{name}.csv", csv_text(records).encode())
        text = json.dumps(records, indent=1, default=str, allow_nan=False)
        write_bytes_atomic(out / f"{name}.json", (text + "\n").encode())
    return list(EXPORTS)
