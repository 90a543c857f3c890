"""Tests for `normlab ls`: a line per run (status, running while its lock is held, step of max_steps, val loss,
wall, age, path), each sweep summed up by status, --json, and bad input."""

import json
import os
import time

from normlab import cli
from normlab.util.files import exclusive
from test_compare import write_run


def sweep_of_four(root):
    sweep = root / "sweep"
    write_run(sweep / "0_rms", max_steps=8)
    write_run(sweep / "1_layer", norm="layer", status="diverged", diverged_step=5)
    killed = write_run(sweep / "2_dyt", norm="dyt")
    (killed / "summary.json").unlink()  # killed before it wrote its summary: its metrics end at step 8
    write_run(sweep / "3_batch", norm="batch")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep


def ls(capsys, *args):
    code = cli.main(["ls", *args])
    return code, capsys.readouterr()


def test_ls_lists_each_run_and_sums_the_sweep_up_by_status_with_a_held_lock_as_running(tmp_path, capsys, monkeypatch):
    sweep = sweep_of_four(tmp_path)
    old = time.time() - 7200
    os.utime(sweep / "0_rms" / "summary.json", (old, old))
    for name in ("metrics.jsonl", "config.json"):
        os.utime(sweep / "0_rms" / name, (old, old))
    monkeypatch.chdir(tmp_path)
    with exclusive(sweep / "3_batch", wait=False):  # as a live run holds its dir
        code, out = ls(capsys, "sweep")
    assert code == 0 and out.err == ""
    lines = out.out.splitlines()
    assert lines[0].split() == ["status", "step", "val", "loss", "wall", "age", "path"]
    rows = {line.split()[-1]: line.split() for line in lines[1:5]}
    assert rows["sweep/0_rms"][:5] == ["completed", "8/8", "3.0000", "1.5", "s"] and rows["sweep/0_rms"][5:7] == ["2.0", "h"]
    assert rows["sweep/1_layer"][:3] == ["diverged", "5/8", "-"]
    assert rows["sweep/2_dyt"][:3] == ["incomplete", "8/8", "-"]
    assert rows["sweep/3_batch"][0] == "running"
    assert lines[5] == "sweep sweep: 4 runs: 1 completed, 1 diverged, 1 incomplete, 1 running"
    # the lock let go, the run is what its summary says
    code, out = ls(capsys, "sweep")
    assert "running" not in out.out and out.out.count("completed") == 3


def test_ls_json_gives_a_row_per_run_and_the_sweeps(tmp_path, capsys):
    sweep = sweep_of_four(tmp_path)
    code, out = ls(capsys, str(sweep), "--json")
    data = json.loads(out.out)
    assert code == 0 and [r["status"] for r in data["runs"]] == ["completed", "diverged", "incomplete", "completed"]
    first = data["runs"][0]
    assert (first["step"], first["max_steps"], first["final_val_loss"], first["wall_s"]) == (8, 8, 3.0, 1.5)
    assert first["sweep"] == str(sweep.resolve()) and first["age_s"] >= 0
    assert data["sweeps"] == {str(sweep.resolve()): {"completed": 2, "diverged": 1, "incomplete": 1}}  # runs by status
    assert first["phases"] is None  # a summary.json written before phases were recorded


def test_ls_json_carries_each_runs_phases(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    summary = json.loads((run / "summary.json").read_text())
    summary["phases"] = {"startup": 2.5, "train": 10.25, "eval": 1}
    (run / "summary.json").write_text(json.dumps(summary))
    bad = write_run(tmp_path / "bad")
    (bad / "summary.json").write_text(json.dumps({**summary, "phases": {"train": "fast"}}))
    code, out = ls(capsys, str(tmp_path), "--json")
    phases = {r["path"]: r["phases"] for r in json.loads(out.out)["runs"]}
    assert code == 0 and phases == {str(run): {"startup": 2.5, "train": 10.25, "eval": 1.0}, str(bad): None}


def test_ls_of_a_missing_dir_is_one_line_and_exit_2(tmp_path, capsys):
    code, out = ls(capsys, str(tmp_path / "nowhere"))
    assert code == 2 and out.err.count("\n") == 1 and "no such file or directory" in out.err


def test_a_damaged_summary_is_listed_as_damaged_not_as_a_killed_run(tmp_path, capsys, monkeypatch):
    sweep = sweep_of_four(tmp_path)
    (sweep / "0_rms" / "summary.json").write_text('{"status": "compl')  # cut short: not JSON
    (sweep / "3_batch" / "summary.json").write_text("[1, 2]")  # JSON, but not an object
    monkeypatch.chdir(tmp_path)
    code, out = ls(capsys, "sweep")
    rows = {line.split()[-1]: line.split() for line in out.out.splitlines()[1:5]}
    assert code == 0 and rows["sweep/0_rms"][:3] == ["damaged", "8/8", "-"] and rows["sweep/3_batch"][0] == "damaged"
    assert rows["sweep/2_dyt"][0] == "incomplete"  # no summary.json at all: killed
    assert out.out.splitlines()[5] == "sweep sweep: 4 runs: 2 damaged, 1 diverged, 1 incomplete"
