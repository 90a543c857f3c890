"""Where a run's time goes (normlab.train.phases): summary.json's `phases` cover its wall time, phase by phase."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import tiny_config

from normlab.train import phases as phases_module
from normlab.train.phases import Phases, process_start, run_ended, startup_seconds
from normlab.train.callbacks import Callback
from normlab.train.run import train

MEASURED = {"startup", "setup", "data", "model", "sinks", "compile", "train", "eval", "checkpoint", "products"}


def test_a_runs_phases_add_up_to_its_wall_time(tmp_path, monkeypatch):
    monkeypatch.setattr(phases_module, "_last_end", time.time() - 3.0)  # as if the previous job ended 3 s ago
    cfg = tiny_config(max_steps=6, eval_every=3, sinks=["jsonl"])
    cfg.telemetry.every = 3
    cfg.ckpt.every = 3
    summary = train(cfg, tmp_path / "run", echo=False)
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["phases"] == summary["phases"] and on_disk["wall_time_s"] == summary["wall_time_s"]
    phases = summary["phases"]
    assert set(phases) == MEASURED and all(seconds >= 0 for seconds in phases.values())
    assert phases["startup"] == pytest.approx(3.0, abs=0.5)  # from the previous job's end to train()'s start
    # Each phase is measured, none is the remainder: together they cover train()'s wall time within 5%.
    covered = sum(phases.values()) - phases["startup"]
    assert covered == pytest.approx(summary["wall_time_s"], rel=0.05)
    assert covered <= summary["wall_time_s"] + 0.002  # nothing counted twice
    assert phases["eval"] == pytest.approx(summary["eval_time_s"], abs=0.002)
    assert phases_module._last_end == pytest.approx(time.time(), abs=1.0)  # the next job's startup counts from here


class FailsAtStep3(Callback):
    name = "fails"

    def on_step_end(self, state, record) -> None:
        if state.step == 3:
            raise RuntimeError("a fault at step 3")


def test_a_failed_run_records_the_phases_it_reached(tmp_path):
    with pytest.raises(RuntimeError, match="a fault at step 3"):
        train(tiny_config(max_steps=6, sinks=["jsonl"]), tmp_path / "run", callbacks=[FailsAtStep3()], echo=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and {"data", "model", "compile", "train"} <= set(summary["phases"])
    assert "products" not in summary["phases"]  # the run never reached its end
    covered = sum(summary["phases"].values()) - summary["phases"].get("startup", 0.0)
    assert covered == pytest.approx(summary["wall_time_s"], rel=0.05)


def test_startup_counts_from_the_process_start_or_the_previous_run():
    code = ("import time; time.sleep(0.6); import importlib.util as u; "
            f"s = u.spec_from_file_location('p', {phases_module.__file__!r}); m = u.module_from_spec(s); "
            "s.loader.exec_module(m); print(m.startup_seconds())")
    seconds = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.6 <= seconds < 5.0  # the interpreter's own start, then the sleep
    start = process_start()
    assert start is not None and start <= time.time()
    run_ended(now=100.0)
    try:
        assert startup_seconds(now=102.5) == pytest.approx(2.5)
    finally:
        phases_module._last_end = None


def test_phases_add_and_time():
    phases = Phases()
    phases.add("eval", 0.25)
    phases.add("eval", 0.5)
    with phases.time("train"):
        time.sleep(0.01)
    record = phases.record()
    assert record["eval"] == 0.75 and 0.01 <= record["train"] < 1.0


def test_a_packs_members_record_the_packs_phases(tmp_path):
    from normlab.train.pack import train_pack

    members = [(tiny_config(lr=lr, max_steps=3, sinks=["jsonl"]), tmp_path / f"m{i}") for i, lr in enumerate((1e-3, 2e-3))]
    summaries = train_pack(members)
    for summary in summaries:
        phases = summary["phases"]
        assert {"setup", "data", "sinks", "train"} <= set(phases)
        covered = sum(phases.values()) - phases.get("startup", 0.0)
        assert covered == pytest.approx(summary["wall_time_s"], rel=0.05)


def test_the_sweeps_line_sums_the_jobs_phases_counting_a_pack_once():
    from normlab.launch.sweep_log import phase_totals

    alone = {"phases": {"train": 6.0, "startup": 2.0}}
    pack = {"phases": {"train": 9.0, "startup": 1.0}, "phases_shared_by": 3}
    line = phase_totals([alone, pack, pack, pack, None, {"status": "failed"}])
    assert line == "time by phase, summed over the jobs: train 15.0 s (83%), startup 3.0 s (17%)"
    assert phase_totals([{"status": "completed"}]) == ""
