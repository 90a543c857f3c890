"""Checkpoints in-process: exact resume after a real signal, atomic writes, safe loading, clear errors."""

import json
import os
import signal
import time

import pytest
import torch

from conftest import tiny_config
from normlab.train import preempt
from normlab.train.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    resolve_resume,
    rewind_metrics,
    write_atomic,
)
from normlab.config import ConfigError, RunConfig
from normlab.nn.model import GPT
from normlab.train.sinks import MetricsFile, RunDir, Sink
from normlab.train.run import build_state, train

TIMING = ("tokens_per_s", "train_time_s", "wall_time_s", "eval_time_s", "resumed_from_step", "phases", "segments")


# Bit-exact comparisons need the same reduction order in every run: one torch thread.
pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**overrides):
    # BatchNorm in the post placement with 2 micro-batches: running statistics and the guard's limit are state too.
    cfg = tiny_config("batch", "post", **{"max_steps": 8, "eval_every": 3, "log_every": 2, "grad_accum": 2, **overrides})
    cfg.wandb.mode = "disabled"
    cfg.ckpt.every = 3
    return cfg


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def _without(mapping, keys=TIMING):
    return {k: v for k, v in mapping.items() if k not in keys}


class SignalAt(Sink):
    """A sink that sends this process a real signal when it sees the record of `step`."""

    def __init__(self, step, signum):
        self.step, self.signum = step, signum

    def log(self, record):
        if record["step"] == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signalled_run_checkpoints_at_the_step_boundary_and_resumes_exactly(tmp_path, signum):
    whole = _cfg()
    train(whole, tmp_path / "whole")

    cut = _cfg()
    run_dir = RunDir(tmp_path / "cut")
    with preempt.watch():
        with pytest.raises(preempt.Preempted) as stopped:
            train(cut, run_dir, sinks=[MetricsFile(run_dir), SignalAt(3, signum)])
    # Signalled while logging step 3: the update of step 3 completes, then the checkpoint of step 4.
    assert stopped.value.step == 4 and stopped.value.signum == signum
    assert [s for s, _ in list_checkpoints(run_dir.path)] == [4]
    assert json.loads(run_dir.summary_path.read_text())["status"] == "preempted"
    assert [r["step"] for r in _rows(run_dir.path)] == [0, 2, 3]

    resumed = _cfg()
    resumed.resume = "auto"
    summary = train(resumed, run_dir)
    assert summary["resumed_from_step"] == 4
    reference = _rows(tmp_path / "whole")
    assert [r["step"] for r in reference] == [0, 2, 3, 4, 6, 7, 8]
    assert [_without(r) for r in _rows(run_dir.path)] == [_without(r) for r in reference]
    saved = json.loads(run_dir.summary_path.read_text())
    assert _without(saved) == _without(json.loads((tmp_path / "whole" / "summary.json").read_text()))
    assert [s for s, _ in list_checkpoints(run_dir.path)] == [8]


class SlowAt(Sink):
    """A sink that takes `seconds` over the record of `step`: a segment of the run that costs wall time."""

    def __init__(self, step, seconds):
        self.step, self.seconds = step, seconds

    def log(self, record):
        if record["step"] == self.step:
            time.sleep(self.seconds)


def test_a_resumed_runs_wall_time_counts_every_segment_and_records_them_apart(tmp_path):
    run_dir = RunDir(tmp_path / "cut")
    with preempt.watch():
        with pytest.raises(preempt.Preempted):
            train(_cfg(), run_dir, sinks=[MetricsFile(run_dir), SlowAt(2, 0.6), SignalAt(3, signal.SIGTERM)])
    first = json.loads(run_dir.summary_path.read_text())
    assert first["wall_time_s"] >= 0.6 and "segments" not in first  # one segment so far

    summary = train(_cfg(), run_dir)  # resumes from the checkpoint of step 4
    on_disk = json.loads(run_dir.summary_path.read_text())
    segments = on_disk["segments"]
    assert [(s["from_step"], s["to_step"]) for s in segments] == [(0, 4), (4, 8)]
    assert segments[0]["wall_time_s"] >= 0.6  # the first process's time, up to its checkpoint
    assert on_disk["wall_time_s"] == pytest.approx(sum(s["wall_time_s"] for s in segments), abs=0.002)
    assert on_disk["wall_time_s"] >= on_disk["train_time_s"]  # the whole run's steps, in both processes
    assert summary["wall_time_s"] == on_disk["wall_time_s"] and summary["segments"] == segments


def test_resuming_a_finished_run_changes_nothing(tmp_path):
    cfg = _cfg()
    train(cfg, tmp_path)
    before = _rows(tmp_path)
    train(cfg, tmp_path)  # resume=auto finds the final checkpoint: only the final evaluation is redone
    assert [_without(r) for r in _rows(tmp_path)] == [_without(r) for r in before]


def test_keep_prunes_old_checkpoints(tmp_path):
    cfg = _cfg()
    cfg.ckpt.every, cfg.ckpt.keep = 2, 2
    train(cfg, tmp_path)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 8]
    assert not list((tmp_path / "checkpoints").glob(".*"))


def test_a_checkpoint_write_that_fails_leaves_the_previous_one_and_no_partial_file(tmp_path, monkeypatch):
    good = checkpoint_path(tmp_path, 3)
    write_atomic(good, {"format": "x", "value": torch.ones(3)})

    def dies_halfway(obj, fh):
        fh.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError):
        write_atomic(checkpoint_path(tmp_path, 6), {"format": "x"})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003.pt"]
    assert torch.load(good, weights_only=True)["value"].tolist() == [1.0, 1.0, 1.0]


def test_corrupt_truncated_and_foreign_files_give_one_line_naming_the_file(tmp_path):
    cfg = _cfg()
    train(cfg, tmp_path / "run")
    real = checkpoint_path(tmp_path / "run", 8)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint\n")
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    for path in (truncated, garbage, foreign):
        with pytest.raises(CheckpointError) as err:
            Checkpoint.load(path)
        message = str(err.value)
        assert message.startswith(str(path)) and "\n" not in message


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"format": "normlab-checkpoint/1", "step": 1, "payload": os.getcwd}, evil)  # a callable, not data
    with pytest.raises(CheckpointError, match="evil.pt"):
        Checkpoint.load(evil)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo ran",))


def test_a_crafted_pickle_of_another_protocol_is_refused_in_one_line_without_torchs_warning(tmp_path):
    import pickle
    import warnings

    crafted = tmp_path / "crafted.pt"
    with open(crafted, "wb") as fh:
        pickle.dump({"format": "normlab-checkpoint/1", "payload": _RunsCode()}, fh, protocol=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match="crafted.pt: unreadable checkpoint"):
            Checkpoint.load(crafted)
    assert [str(w.message) for w in caught] == []


def test_a_checkpoint_of_another_config_is_refused_and_the_run_dir_left_as_it_was(tmp_path):
    cfg = _cfg()
    train(cfg, tmp_path)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    deeper = _cfg(depth=3)
    with pytest.raises(CheckpointError) as err:
        train(deeper, tmp_path)
    assert "depth=2" in str(err.value) and "depth=3" in str(err.value) and "step-000008.pt" in str(err.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == files

    fresh = _cfg()
    fresh.resume = None
    with pytest.raises(CheckpointError, match="already holds a run"):
        resolve_resume(fresh, tmp_path)


def test_a_model_of_another_shape_is_named_with_both_shapes(tmp_path):
    cfg = _cfg()
    train(cfg, tmp_path)
    wider = _cfg()
    wider.model.d_model = 64
    checkpoint = Checkpoint.load(checkpoint_path(tmp_path, 8))
    with pytest.raises(CheckpointError) as err:
        checkpoint.restore(build_state(wider, torch.device("cpu"), "fp32"))
    assert "tok_emb.weight" in str(err.value) and "[256, 32]" in str(err.value) and "[256, 64]" in str(err.value)


def test_a_checkpoint_of_the_old_layout_is_refused_in_one_line(tmp_path):
    cfg = _cfg()
    old = checkpoint_path(tmp_path, 3)
    write_atomic(old, {"format": "normlab-checkpoint/1", "step": 3, "components": {"model": GPT(cfg).state_dict()},
                       "loop": {"tokens": 0}, "rng": {}, "config": {}})
    cfg.resume = str(old)
    with pytest.raises(CheckpointError) as err:
        train(cfg, tmp_path / "new")
    message = str(err.value)
    assert message.startswith(str(old)) and "'normlab-checkpoint/1'" in message and "\n" not in message
    assert not (tmp_path / "new" / "summary.json").exists()


def test_rewind_keeps_rows_before_the_step_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(6)) + '{"step": 6, "lo')
    rewind_metrics(path, 4)
    assert [json.loads(line)["step"] for line in path.open()] == [0, 1, 2, 3]
    assert not list(tmp_path.glob(".*"))
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(CheckpointError, match="line 2"):
        rewind_metrics(path, 1)
    assert path.read_text() == '{"step": 0}\nnot json\n{"step": 1}\n'


@pytest.mark.parametrize(
    "raw, key",
    [({"ckpt": {"every": -1}}, "ckpt.every=-1"), ({"ckpt": {"keep": 0}}, "ckpt.keep=0"),
     ({"resume": ""}, "resume=''"), ({"resume": False}, "resume=False")],
)
def test_bad_checkpoint_settings_give_one_line(raw, key):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(raw)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_chain_runs_the_previous_handler_then_exits_with_128_plus_the_signal():
    calls = []
    with pytest.raises(SystemExit) as exited:
        preempt.chain(signal.SIGUSR2, {signal.SIGUSR2: lambda signum, frame: calls.append(signum)})
    assert calls == [signal.SIGUSR2] and exited.value.code == 128 + signal.SIGUSR2
