"""A sweep job's end off the critical path (normlab.train.ending): the job returns once its summary.json says how it
ended, and its products, its sinks' finish and the last summary.json follow in the process's end thread, in that
order, under the run dir's lock; a failure there is recorded; a sweep's records are complete when it returns."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from conftest import tiny_config

from cli_here import normlab_here
from normlab.launch import task
from normlab.train import ending
from normlab.train.callbacks import TelemetryProducts
from normlab.train.run import train
from normlab.train.sinks import MetricsFile, RunDir, Sink
from normlab.util.files import exclusive
from wandb_log import finished_run_records


class Recorder(Sink):
    """Notes what it is handed, in order, and on which thread; its finish waits for `release` when given one."""

    def __init__(self, release: threading.Event | None = None):
        self.calls: list[tuple[str, str]] = []
        self.release = release

    def log(self, record):
        self.calls.append(("log", threading.current_thread().name))

    def log_table(self, name, columns, rows):
        self.calls.append((f"table {name}", threading.current_thread().name))

    def log_image(self, name, png):
        self.calls.append((f"image {name}", threading.current_thread().name))

    def finish(self, summary, exit_code):
        if self.release is not None:
            assert self.release.wait(60)
        self.calls.append((f"finish {summary['status']} {exit_code}", threading.current_thread().name))


def _cfg():
    cfg = tiny_config(max_steps=4, eval_every=2, sinks=["jsonl"])
    cfg.telemetry.every = 2
    return cfg


def _locked(path) -> bool:
    try:
        with exclusive(path.resolve(), wait=False):
            return False
    except BlockingIOError:
        return True


def test_a_sweep_jobs_end_runs_after_it_returns_in_order_and_holding_its_run_dir(tmp_path):
    release = threading.Event()
    recorder = Recorder(release)
    run_dir = RunDir(tmp_path / "run")
    try:
        summary = train(_cfg(), run_dir, sinks=[MetricsFile(run_dir), recorder], echo=False, defer_end=True)
        # Returned with the end still running: summary.json already says how the run ended.
        on_disk = json.loads(run_dir.summary_path.read_text())
        assert on_disk["status"] == summary["status"] == "completed"
        assert on_disk["final_val_loss"] == summary["final_val_loss"]
        assert _locked(run_dir.path)  # the end holds the run dir: another process is refused
        other = subprocess.run([sys.executable, "-c", "from normlab.train.sinks import RunDir\n"
                                f"with RunDir({str(run_dir.path)!r}).lock(): pass"], capture_output=True, text=True)
        assert other.returncode != 0 and "RunDirBusy" in other.stderr
    finally:
        release.set()
        ending.drain()
    assert not _locked(run_dir.path)
    names = [name for name, _ in recorder.calls]
    ends = [(name, thread) for name, thread in recorder.calls if not name.startswith("log")]
    assert [name for name, _ in ends] == ["table telemetry/layers", "image telemetry/resid_rms",
                                          "image telemetry/grad_norm", "finish completed 0"]
    assert {thread for _, thread in ends} == {"normlab-run-ends"}  # made and finished in the end thread
    assert names.index("finish completed 0") == len(names) - 1
    final = json.loads(run_dir.summary_path.read_text())
    assert {"products", "sinks"} <= set(final["phases"]) and final["status"] == "completed"
    assert final["wall_time_s"] >= summary["wall_time_s"]  # the end's own time added
    assert (run_dir.path / "telemetry" / "resid_rms.png").exists() and (run_dir.path / "telemetry" / "layers.csv").exists()


def test_a_failed_end_in_the_end_thread_is_recorded_in_summary_json(tmp_path, monkeypatch, capfd):
    def broken(self):
        raise RuntimeError("no room for the heatmaps")

    monkeypatch.setattr(TelemetryProducts, "write", broken)
    recorder = Recorder()
    summary = train(_cfg(), tmp_path / "run", sinks=[recorder], echo=False, defer_end=True)
    ending.drain()
    assert summary["status"] == "completed"  # as the job returned it
    final = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert final["status"] == "failed" and final["error"] == "RuntimeError: no room for the heatmaps"
    assert recorder.calls[-1][0] == "finish failed 1"
    assert "the run's end failed: RuntimeError: no room for the heatmaps" in capfd.readouterr().err


def test_without_defer_end_the_run_ends_before_train_returns(tmp_path):
    recorder = Recorder()
    train(_cfg(), tmp_path / "run", sinks=[recorder], echo=False)
    assert recorder.calls[-1] == ("finish completed 0", threading.current_thread().name)
    assert "products" in json.loads((tmp_path / "run" / "summary.json").read_text())["phases"]


def test_run_dir_holds_share_the_lock_and_the_last_release_unlocks(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    first = run_dir.hold()
    second = run_dir.hold()
    first()  # released out of order: the second hold still locks
    first()  # a second release of the same hold changes nothing
    assert _locked(run_dir.path)
    threading.Thread(target=second).start()  # released from another thread, as the end thread does
    for _ in range(100):
        if not _locked(run_dir.path):
            break
        threading.Event().wait(0.01)
    assert not _locked(run_dir.path)


def test_a_sweeps_summaries_products_and_wandb_runs_are_complete_when_it_returns(tmp_path, monkeypatch):
    # Jobs in this process, one after another: each job's end runs in the end thread while the next job trains
    # (as on a GPU: on the CPU a sweep's jobs end inline).
    monkeypatch.setattr(task, "ends_in_background", lambda run_cfg: True)
    result = normlab_here("train", "-m", "seed=0,1", "model=tiny", "batch_size=4", "seq_len=16", "eval_batches=1",
                          "max_steps=4", "eval_every=2", "telemetry.every=2", "device=cpu", "wandb.mode=offline",
                          "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir() and (p / "summary.json").exists())
    assert len(jobs) == 2
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "completed" and {"products", "sinks"} <= set(summary["phases"])
        assert (job / "telemetry" / "grad_norm.png").exists()
        [wandb_file] = job.glob("wandb/offline-run-*/run-*.wandb")
        records = finished_run_records(wandb_file)
        kinds = [r.WhichOneof("record_type") for r in records]
        assert "exit" in kinds
        logged = {"/".join(item.nested_key) or item.key
                  for r in records if r.WhichOneof("record_type") == "history" for item in r.history.item}
        products = {key.rsplit("/", 1)[0] for key in logged if key.endswith("/_type")}  # a table's or image's fields
        assert {"telemetry/layers", "telemetry/resid_rms"} <= products  # they reached wandb before its finish
    assert "products" in result.stdout + result.stderr  # the closing table's phases line counts the ends


def test_the_command_leaves_what_is_alive_at_exit_to_the_process_end():
    code = ("import atexit, gc; from normlab.cli import main; main(['--version']); gc.unfreeze(); "
            "atexit._run_exitfuncs(); print(gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[-1]) > 0


def test_a_sweep_job_ends_in_the_background_on_a_gpu_only():
    assert task.ends_in_background(tiny_config(device="cuda"))
    assert not task.ends_in_background(tiny_config(device="cpu"))


@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=basic"]], ids=["normlab", "basic"])
def test_the_sweeps_table_waits_for_the_jobs_ends_under_any_launcher(tmp_path, monkeypatch, launcher):
    """The closing table is read after every job's end has run, also under Hydra's basic launcher (which does
    not drain the end thread itself): a failed end shows in it as failed (review)."""
    import time

    def broken(self):
        time.sleep(0.5)
        raise RuntimeError("no room for the heatmaps")

    monkeypatch.setattr(task, "ends_in_background", lambda run_cfg: True)  # as on a GPU
    monkeypatch.setattr(TelemetryProducts, "write", broken)
    result = normlab_here("train", "-m", "seed=0,1", "model=tiny", "batch_size=4", "seq_len=16", "eval_batches=1",
                          "max_steps=4", "eval_every=2", "telemetry.every=2", "device=cpu", "wandb.mode=disabled",
                          "hydra.sweep.dir=sweep", *launcher, cwd=tmp_path)
    ending.drain()
    table = result.stdout[result.stdout.index("sweep: "):]
    on_disk = sorted(json.loads(p.read_text())["status"] for p in (tmp_path / "sweep").glob("*/summary.json"))
    assert on_disk == ["failed", "failed"]
    assert table.splitlines()[0].startswith("sweep: 2 jobs (2 failed)"), table
