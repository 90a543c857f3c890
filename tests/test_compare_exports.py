"""Tests for the report dir's data files (arms.csv/.json, runs.csv/.json) and `normlab compare --format`."""

import csv
import json
import math

import pytest

from normlab.analysis.compare import compare
from normlab.analysis.render.exports import cell_values
from test_compare import run_compare_cli, write_run


@pytest.fixture
def sweep(tmp_path):
    for norm, final in (("rms", 3.0), ("layer", 3.2)):
        for lr, extra in ((1e-3, 0.1), (3e-3, 0.0)):
            for seed in (0, 1):
                write_run(tmp_path / "sweep" / f"{norm}-{lr}-{seed}", norm=norm, lr=lr, seed=seed,
                          final=final + extra + seed / 100)
    return tmp_path / "sweep"


def test_arms_and_runs_are_written_as_csv_and_json_with_numbers_as_numbers(sweep, tmp_path):
    out = compare([str(sweep)], out=tmp_path / "r")
    arms = json.loads((out / "arms.json").read_text())
    assert [a["arm"] for a in arms] == ["rms", "layer"] and [a["rank"] for a in arms] == [1, 2]
    best = arms[0]
    assert best["final val loss"] == pytest.approx(3.005) and best["final val loss std"] == pytest.approx(0.00707107, rel=1e-4)
    assert best["best lr"] == 3e-3 and best["seeds"] == 2 and best["diverged/failed"] == 0 and best["diverged/failed of"] == 4
    assert best["LR sensitivity"] == pytest.approx(0.05, abs=1e-9) and best["loss spikes"] is None
    assert best["norm"] == "rms" and best["placement"] == "pre" and best["arm (full)"] == "rms-pre"
    with open(out / "arms.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(best) and float(rows[0]["final val loss"]) == best["final val loss"]
    assert rows[0]["loss spikes"] == ""  # no value: an empty cell, never "—" or NaN
    runs = json.loads((out / "runs.json").read_text())
    assert len(runs) == 8 and {r["arm"] for r in runs} == {"rms", "layer"}
    first = next(r for r in runs if r["run"] == "rms-0.003-1")
    assert first["final val loss"] == pytest.approx(3.01) and first["lr"] == 3e-3 and first["seed"] == 1
    assert first["status"] == "completed" and first["diverged at step"] is None and first["wall time s"] == 1.5
    with open(out / "runs.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 8


@pytest.mark.parametrize(
    "text, values",
    [
        ("2.7129 ± 0.0468", {"c": 2.7129, "c std": 0.0468}),
        ("—²", {"c": None}),
        ("0 of 4", {"c": 0, "c of": 4}),
        ("1 (1 of 4 runs)", {"c": 1, "c detail": "1 of 4 runs"}),
        ("3e-2", {"c": 0.03}),
        ("rms-pre depth=4", {"c": "rms-pre depth=4"}),
    ],
)
def test_a_table_cell_becomes_numbers_whatever_its_column(text, values):
    assert cell_values("c", text) == values


def test_format_draws_each_figure_in_each_format_and_report_links_the_first(sweep, tmp_path):
    out = tmp_path / "r"
    assert run_compare_cli([str(sweep), "--out", str(out), "--format", "svg,pdf"]) == 0
    assert (out / "loss_val.svg").read_text().lstrip().startswith("<?xml")
    assert (out / "loss_val.pdf").read_bytes().startswith(b"%PDF")
    assert not (out / "loss_val.png").exists()
    assert "![validation loss](loss_val.svg)" in (out / "report.md").read_text()


@pytest.mark.parametrize("formats", ["jpg", "png,gif", ""])
def test_a_bad_format_is_one_line_exit_2_and_nothing_written(sweep, tmp_path, capsys, formats):
    out = tmp_path / "r"
    assert run_compare_cli([str(sweep), "--out", str(out), "--format", formats]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a figure format: choose from png, svg, pdf" in err
    assert not out.exists()
