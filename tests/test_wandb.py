"""The wandb run as wandb itself records it: settings precedence, dashboard metadata, config, history and
summary, read back from the offline run's .wandb file; and an online run that cannot reach wandb."""

import json
import logging
import os
import time

import pytest
import wandb

from cli_here import normlab_here
from conftest import tiny_config
from normlab import keys
from normlab.train.sinks import WandbUnavailable
from normlab.train.run import train
from wandb_log import finished_run_records


class OfflineRun:
    """The records of the one offline wandb run under a run dir."""

    def __init__(self, run_dir):
        files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(files) == 1, files
        self.records = finished_run_records(files[0])

    def of(self, kind: str) -> list:
        return [getattr(r, kind) for r in self.records if r.WhichOneof("record_type") == kind]

    @property
    def run(self):
        return self.of("run")[0]

    @property
    def config(self) -> dict:
        return {item.key: json.loads(item.value_json) for item in self.run.config.update}

    @property
    def history(self) -> list[dict]:
        rows = []
        for history in self.of("history"):
            rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in history.item})
        return rows

    @property
    def summary(self) -> dict:
        merged = {}
        for summary in self.of("summary"):
            for item in summary.update:
                merged["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
        return merged


@pytest.fixture
def no_user_wandb_settings(monkeypatch, tmp_path):
    """No WANDB_* variable and no wandb settings file: normlab's defaults apply. wandb reads the environment
    once per process (wandb.setup): it is torn down around the test, so the test's own variables count."""
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    wandb.teardown()
    yield
    wandb.teardown()


def _cfg(**wandb):
    cfg = tiny_config("rms", "pre", max_steps=4, eval_every=2, log_every=1)
    cfg.sinks = ["jsonl", "wandb"]
    cfg.wandb.overrides = ["norm=rms", "max_steps=4"]
    for key, value in wandb.items():
        setattr(cfg.wandb, key, value)
    return cfg


def test_the_offline_run_holds_the_dashboards_metadata_config_history_and_summary(tmp_path, no_user_wandb_settings):
    summary = train(_cfg(), tmp_path)
    run = OfflineRun(tmp_path)

    assert run.run.project == "normlab" and run.run.job_type == "train" and run.run.display_name == summary["name"]
    config = run.config
    assert "name" not in config and "wandb" not in config  # no placeholder, no sink settings
    assert config["norm"]["label"] == "rms" and config["arm"] == "rms-pre"
    assert (config["placement"], config["depth"], config["lr"], config["seed"]) == ("pre", 2, 1e-3, 0)
    assert config["overrides"] == "norm=rms max_steps=4"
    assert config["run_dir"] == str(tmp_path.resolve())

    metrics = {m.name or m.glob_name: m for m in run.of("metric")}
    assert {"step", "tokens", "*", "val_loss", "val_bpb"} <= set(metrics)
    assert metrics["*"].step_metric == "step" and metrics["val_loss"].step_metric == "step"
    assert metrics["val_loss"].summary.min and metrics["val_loss"].summary.last
    assert not metrics["val_loss"].summary.max

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    logged = [row for row in run.history if "loss" in row or "val_loss" in row]
    assert [row["step"] for row in logged] == [row["step"] for row in rows]
    assert [row.get("val_loss") for row in logged] == [row.get("val_loss") for row in rows]
    assert not any(keys.parse(key) for row in logged for key in row)  # wandb.layers=false: no per-layer key

    final = run.summary
    assert final["status"] == "completed" and final["final_val_loss"] == pytest.approx(summary["final_val_loss"])
    val_losses = [row["val_loss"] for row in rows if "val_loss" in row]
    assert final["val_loss"] == pytest.approx({"min": min(val_losses), "last": val_losses[-1]})


def test_wandb_layers_true_sends_the_per_layer_curves(tmp_path, no_user_wandb_settings):
    train(_cfg(layers=True), tmp_path)
    keys = {key for row in OfflineRun(tmp_path).history for key in row}
    assert "act/resid_rms/L00" in keys and "grad/norm/L01" in keys


def test_wandbs_own_settings_win_unless_the_config_sets_the_key(tmp_path, monkeypatch, no_user_wandb_settings):
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_RUN_ID", "agentrun1")
    train(_cfg(), tmp_path / "env")
    run = OfflineRun(tmp_path / "env").run
    assert (run.project, run.run_id) == ("from-env", "agentrun1")

    train(_cfg(project="from-cli"), tmp_path / "cli")
    assert OfflineRun(tmp_path / "cli").run.project == "from-cli"


def test_wandb_mode_disabled_in_the_environment_writes_no_wandb_run(tmp_path, monkeypatch, no_user_wandb_settings):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train(_cfg(), tmp_path / "env")
    assert not (tmp_path / "env" / "wandb").exists() and (tmp_path / "env" / "metrics.jsonl").exists()

    train(_cfg(mode="offline"), tmp_path / "cli")  # the command line's wandb.mode wins
    assert OfflineRun(tmp_path / "cli").run.run_id


def test_wandb_offline_in_the_settings_file_applies(tmp_path, monkeypatch, no_user_wandb_settings):
    settings = tmp_path / "wandb-config" / "settings"
    settings.parent.mkdir()
    settings.write_text("[default]\nmode = offline\nproject = from-file\n")
    train(_cfg(), tmp_path / "run")
    assert OfflineRun(tmp_path / "run").run.project == "from-file"


def _unreachable(monkeypatch):
    """Online, with an API key, against a server that refuses every connection."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")


def test_an_unreachable_online_run_falls_back_to_offline_within_its_timeout(tmp_path, monkeypatch, caplog,
                                                                           no_user_wandb_settings):
    _unreachable(monkeypatch)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="normlab"):
        summary = train(_cfg(init_timeout=3.0), tmp_path)
    assert time.monotonic() - started < 60  # wandb's own default waits 90 s before it gives up
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "recording offline" in warnings[0] and "wandb sync" in warnings[0]
    assert summary["status"] == "completed"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [row["step"] for row in OfflineRun(tmp_path).history if "loss" in row or "val_loss" in row] == [
        row["step"] for row in rows
    ]


def test_no_api_key_with_on_unreachable_stop_stops_before_training(tmp_path, monkeypatch, no_user_wandb_settings):
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(WandbUnavailable) as err:
        train(_cfg(on_unreachable="stop"), tmp_path)
    assert "\n" not in str(err.value) and "wandb.on_unreachable=offline" in str(err.value)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "failed" and (tmp_path / "config.json").exists()


def test_through_the_command_no_api_key_is_one_warning_or_one_error_line(tmp_path, monkeypatch, capsys,
                                                                         no_user_wandb_settings):
    monkeypatch.setenv("WANDB_MODE", "online")
    tiny = ["model=tiny", "max_steps=2", "eval_every=1", "eval_batches=1", "batch_size=4", "seq_len=16", "progress=false"]

    def normlab(*args):
        return normlab_here("train", *tiny, *args, cwd=tmp_path)

    stopped = normlab("wandb.on_unreachable=stop", "hydra.run.dir=stopped")
    assert stopped.returncode == 2 and "Traceback" not in stopped.stdout + stopped.stderr
    [line] = stopped.stderr.strip().splitlines()
    assert line.startswith("normlab: error: wandb could not start an online run (No API key")
    assert not (tmp_path / "stopped").exists()  # refused before its first step: a single run leaves no dir

    offline = normlab("hydra.run.dir=offline")
    assert offline.returncode == 0, offline.stderr[-2000:]
    warnings = [line for line in offline.stdout.splitlines() if "[WARNING]" in line]
    assert len(warnings) == 1 and "recording offline" in warnings[0]
    assert json.loads((tmp_path / "offline" / "summary.json").read_text())["status"] == "completed"
    assert OfflineRun(tmp_path / "offline").run.run_id


def test_every_run_records_the_installed_packages(tmp_path, no_user_wandb_settings):
    """wandb lists the installed packages of each run (its requirements.txt): a sweep worker's second run too."""
    for name in ("first", "second"):
        train(_cfg(), tmp_path / name)
    listed = [next((tmp_path / name / "wandb").glob("offline-run-*/files/requirements.txt")).read_text().splitlines()
              for name in ("first", "second")]
    assert listed[0] == listed[1] and any(line.startswith("torch==") for line in listed[0])
