"""A run whose run dir is deleted, moved or replaced while it trains: it stops at its next step
boundary with one line naming the dir, exit code 1, never says it completed, and writes nothing more at
the dir's path (no dir made again there); a sweep's job whose dir went is that job's failure."""

import json
import shutil
from pathlib import Path

import pytest

import normlab.train.loop as loop
from cli_here import normlab_here
from conftest import tiny_config
from normlab.train.callbacks import Callback
from normlab.train.run import train

RUN = ["model=tiny", "batch_size=4", "seq_len=16", "max_steps=10", "eval_every=5", "eval_batches=2",
       "log_every=1", "ckpt.every=5", "progress=false", "wandb.mode=disabled"]


class Vanish(Callback):
    """Deletes, moves or replaces the run dir at the end of step `at`."""

    name = "vanish"

    def __init__(self, run_dir: Path, how: str, at: int):
        self.run_dir, self.how, self.at = run_dir, how, at

    def on_step_end(self, state, record):
        if state.step != self.at:
            return
        if self.how == "deleted":
            shutil.rmtree(self.run_dir)
        else:
            self.run_dir.rename(self.run_dir.with_name("moved"))
            if self.how == "replaced":
                self.run_dir.mkdir()


@pytest.mark.parametrize("how", ["deleted", "moved", "replaced"])
def test_train_stops_at_the_next_step_once_its_run_dir_went(tmp_path, how):
    from normlab.train.sinks import RunDirGone

    run_dir = tmp_path / "run"
    cfg = tiny_config(max_steps=8)
    cfg.ckpt.every = 2
    with pytest.raises(RunDirGone) as gone:
        train(cfg, run_dir, callbacks=[Vanish(run_dir, how, at=3)])
    message = str(gone.value)
    assert str(run_dir) in message and "noticed at step 4" in message and "\n" not in message
    assert ("replaced by another" if how == "replaced" else "deleted or moved away") in message
    if how == "deleted":
        assert not run_dir.exists()  # not made again by the checkpoint of step 4 or the summary
    else:
        moved = tmp_path / "moved"
        assert not (moved / "summary.json").exists() and sorted(p.name for p in (moved / "checkpoints").iterdir()) == [
            "step-000002.pt"]
        assert [json.loads(line)["step"] for line in (moved / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
        assert run_dir.exists() == (how == "replaced") and not (run_dir.exists() and list(run_dir.iterdir()))


def _delete_at_the_second_evaluation(monkeypatch, deleted):
    """loop.evaluate that deletes the run dir of the job running (Hydra's) at its second call: mid-run."""
    from hydra.core.hydra_config import HydraConfig

    evaluate, calls = loop.evaluate, []

    def deleting_evaluate(*args):
        calls.append(1)
        if len(calls) == 2:
            deleted.append(Path(HydraConfig.get().runtime.output_dir))
            shutil.rmtree(deleted[-1])
        return evaluate(*args)

    monkeypatch.setattr(loop, "evaluate", deleting_evaluate)


def test_a_run_whose_dir_is_deleted_mid_run_fails_in_one_line(tmp_path, monkeypatch, capsys):
    deleted = []
    _delete_at_the_second_evaluation(monkeypatch, deleted)
    result = normlab_here("train", *RUN, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("normlab: error: ") and str(tmp_path / "run") in lines[0], lines
    assert "completed" not in result.stdout + result.stderr
    assert deleted == [tmp_path / "run"] and not deleted[0].exists()


def test_a_sweep_job_whose_dir_went_is_that_jobs_failure_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    deleted = []
    _delete_at_the_second_evaluation(monkeypatch, deleted)
    sweep = tmp_path / "sweep"
    result = normlab_here("train", "-m", *RUN, "norm=layer,rms", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode in (0, None), result.stderr[-3000:]
    failures = [line for line in result.stderr.splitlines() if line.startswith("normlab: error:")]
    assert len(failures) == 1 and "job 0" in failures[0] and str(deleted[0]) in failures[0], result.stderr[-3000:]
    [job] = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert job.name.startswith("1_") and json.loads((job / "summary.json").read_text())["status"] == "completed"
    assert not deleted[0].exists()
    # Its line, sweep.log and the table say what became of it, and the table lists every job of the sweep.
    gone = f"job 0 {deleted[0].name[2:]}: failed: run dir deleted or moved away at step "
    [line] = [line for line in result.stdout.splitlines() if line.startswith("job 0 ")]
    assert line.startswith(gone) and "final val loss -, run wall time -" in line, line
    assert "sweep: 2 jobs (1 completed, 1 failed), best first" in result.stdout
    [row] = [r for r in result.stdout.splitlines() if r.startswith("0 ")]
    assert f"FAILED: run dir deleted or moved away at step" in row and deleted[0].name in row, row
    log = (sweep / "sweep.log").read_text()
    assert gone in log and "sweep: 2 jobs (1 completed, 1 failed)" in log


def test_a_pack_member_whose_dir_went_fails_alone_and_its_path_stays_empty(tmp_path, monkeypatch, capsys):
    import normlab.train.pack.loop as pack_loop

    sweep, moved = tmp_path / "sweep", tmp_path / "moved"
    member = sweep / "0_layer-pre-d2-lr1e-3-s0"
    evaluate, calls = pack_loop.evaluate_pack, []

    def moving_evaluate(*args):  # member 0's dir moved away at the pack's second evaluation (step 5's): mid-run
        calls.append(1)
        if len(calls) == 2:
            member.rename(moved)
        return evaluate(*args)

    monkeypatch.setattr(pack_loop, "evaluate_pack", moving_evaluate)
    result = normlab_here("train", "-m", *RUN, "lr=1e-3,3e-3", "pack=true", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    failures = [line for line in result.stderr.splitlines() if line.startswith("normlab: error:")]
    assert len(failures) == 1 and failures[0].startswith("normlab: error: job 0 (layer-pre-d2-lr1e-3-s0) failed: ")
    assert f"the run dir {member} was deleted or moved away during the run (noticed at step 6)" in failures[0]
    assert not member.exists()  # nothing made again at its path: no checkpoint, summary, .hydra/ or log
    assert not (moved / "summary.json").exists() and sorted(p.name for p in (moved / "checkpoints").iterdir()) == [
        "step-000005.pt"]
    assert [json.loads(line)["step"] for line in (moved / "metrics.jsonl").read_text().splitlines()][-1] == 5
    [other] = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")]
    done = json.loads((other / "summary.json").read_text())
    assert other.name == "1_layer-pre-d2-lr3e-3-s0" and done["status"] == "completed" and done["steps"] == 10
    assert "job 0 layer-pre-d2-lr1e-3-s0: failed: run dir deleted or moved away at step 6, final val loss -" in result.stdout
    assert "sweep: 2 jobs (1 completed, 1 failed), best first" in result.stdout
