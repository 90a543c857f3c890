"""Sinks chosen in the config, the CSV sink, and the run dir the loop itself writes."""

import csv
import json

import pytest

from conftest import tiny_config
from normlab.train.checkpoint import checkpoint_path
from normlab.config import ConfigError, RunConfig
from normlab.train.sinks import SINKS, MetricsCsv
from normlab.train.run import train


def _cfg(sinks, **overrides):
    cfg = tiny_config("layer", "pre", **{"max_steps": 6, "eval_every": 3, "log_every": 2, **overrides})
    cfg.wandb.mode = "disabled"
    cfg.sinks = sinks
    return cfg


def _csv_rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_a_run_with_no_sinks_still_leaves_config_summary_and_log(tmp_path):
    cfg = _cfg([])
    summary = train(cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["config.json", "normlab.log", "summary.json"]
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(json.dumps(cfg.to_dict()))
    assert RunConfig.from_dict(json.loads((tmp_path / "config.json").read_text())) == cfg
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "completed" and saved["steps"] == 6
    assert saved["final_val_loss"] == pytest.approx(summary["final_val_loss"])
    for key in ("best_val_loss", "tokens", "tokens_per_s", "n_params", "wall_time_s", "corpus_sha256", "eval_time_s"):
        assert key in saved


def test_the_csv_sink_writes_the_run_level_columns_of_every_record(tmp_path):
    train(_cfg(["jsonl", "csv"], z_loss=1e-3), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    scalars = {k for r in records for k, v in r.items() if "/" not in k and isinstance(v, (int, float, str))}
    assert scalars <= set(MetricsCsv.COLUMNS)  # every run-level key a record holds (z_loss too) is a column
    rows = _csv_rows(tmp_path / "metrics.csv")
    assert list(rows[0]) == list(MetricsCsv.COLUMNS)
    assert [int(r["step"]) for r in rows] == [r["step"] for r in records] == [0, 2, 3, 4, 5, 6]
    for row, record in zip(rows, records):
        for column in MetricsCsv.COLUMNS:
            if column in record:
                assert float(row[column]) == pytest.approx(record[column], rel=1e-12), column
            else:
                assert row[column] == "", column
    assert not any("/" in column for column in rows[0])


def test_a_resumed_run_rewrites_the_csv_rows_it_measures_again(tmp_path):
    cfg = _cfg(["csv"])
    cfg.ckpt.every, cfg.ckpt.keep = 3, 5
    train(cfg, tmp_path)
    whole = _csv_rows(tmp_path / "metrics.csv")
    again = _cfg(["csv"])
    again.ckpt.every, again.ckpt.keep = 3, 5
    again.resume = str(checkpoint_path(tmp_path, 3))
    train(again, tmp_path)
    resumed = _csv_rows(tmp_path / "metrics.csv")
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]


def test_an_unknown_sink_is_a_one_line_config_error_naming_the_choices():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"sinks": ["jsonl", "tensorboard"]})
    message = str(err.value)
    assert "'tensorboard'" in message and "\n" not in message
    assert all(name in message for name in SINKS)


def test_the_default_sinks_are_jsonl_and_wandb():
    assert RunConfig().sinks == ["jsonl", "wandb"]


def test_the_registry_names_exactly_the_sinks_that_can_be_built():
    from normlab.config import SINK_NAMES

    assert tuple(SINKS) == SINK_NAMES
