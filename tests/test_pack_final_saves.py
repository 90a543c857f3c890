"""A pack's final checkpoints, written by a thread while its members' ends run (normlab.train.pack.loop): what
a failure on either side leaves on disk and says, and what the pack's clock counts."""

import errno
import json
import logging
import time

import pytest

from conftest import tiny_config
from normlab.train.pack import train_pack


def two_members(tmp_path):
    cfgs = [tiny_config("layer", "pre", lr=lr, seed=0, max_steps=2, sinks=["jsonl"]) for lr in (1e-3, 3e-3)]
    return [(cfg, tmp_path / f"member{i}") for i, cfg in enumerate(cfgs)]


def test_a_final_checkpoint_taken_is_on_disk_before_the_pack_ends_though_a_later_one_could_not_be_taken(
        tmp_path, monkeypatch):
    """The second member's final checkpoint cannot be taken (on a GPU: no memory for its copies) after the first's
    was handed to the thread: the pack fails, and the first's file is whole on disk before train_pack returns (and
    lets go of the run dirs' locks)."""
    import normlab.train.checkpoint.file as file

    real_payload, real_write = file.Checkpointer.payload, file.write_atomic
    taken = []

    def payload(self, state, callbacks=()):
        if state.step == 2 and taken:
            raise MemoryError("no memory for the checkpoint's copies")
        taken.append(self.run_dir.name)
        return real_payload(self, state, callbacks)

    def slow_write(path, payload):
        time.sleep(0.3)
        real_write(path, payload)

    monkeypatch.setattr(file.Checkpointer, "payload", payload)
    monkeypatch.setattr(file, "write_atomic", slow_write)
    with pytest.raises(MemoryError):
        train_pack(two_members(tmp_path))
    assert taken == ["member0"]
    assert (tmp_path / "member0" / "checkpoints" / "step-000002.pt").exists()
    assert not (tmp_path / "member1" / "checkpoints").exists()
    statuses = [json.loads((tmp_path / f"member{i}" / "summary.json").read_text())["status"] for i in range(2)]
    assert statuses == ["failed"] * 2


def test_a_refused_final_checkpoint_is_said_when_a_members_end_fails_too(tmp_path, monkeypatch, caplog):
    """The disk refuses the final checkpoints and a member's end (its heatmaps) fails: the end's error fails the pack,
    and the log says which checkpoint was not written and why."""
    import normlab.train.checkpoint.file as file
    from normlab.train.callbacks import TelemetryProducts

    def full(path, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    def broken(self):
        raise RuntimeError("no heatmap")

    monkeypatch.setattr(file, "write_atomic", full)
    monkeypatch.setattr(TelemetryProducts, "write", broken)
    caplog.set_level(logging.ERROR, logger="normlab")
    members = two_members(tmp_path)
    for cfg, _ in members:
        cfg.telemetry.every = 1  # records, so heatmaps to make
    with pytest.raises(RuntimeError, match="no heatmap"):
        train_pack(members)
    assert [json.loads((tmp_path / f"member{i}" / "summary.json").read_text())["error"] for i in range(2)] == \
        ["RuntimeError: no heatmap"] * 2
    said = [r.getMessage() for r in caplog.records if "step-000002.pt" in r.getMessage()]
    assert len(said) == 2 and all("No space left on device" in line for line in said), said


def test_the_clocks_figures_are_taken_before_the_final_checkpoints(tmp_path, monkeypatch):
    """The throughput clock's end (on CUDA: the peak memory the run allocated) comes before the final checkpoints are
    taken, as an unpacked run's clock ends before its Checkpointing: not after every member's copies, which a pack
    holds at once until the thread has written them (three times the pack's parameters in all)."""
    import normlab.train.checkpoint.file as file
    from normlab.train.callbacks import ThroughputClock

    real_payload, real_end = file.Checkpointer.payload, ThroughputClock.on_train_end
    finals, seen = [], []

    def payload(self, state, callbacks=()):
        finals.append(state.step == 2)
        return real_payload(self, state, callbacks)

    def end(self, state, summary):
        seen.append(sum(finals))
        real_end(self, state, summary)

    monkeypatch.setattr(file.Checkpointer, "payload", payload)
    monkeypatch.setattr(ThroughputClock, "on_train_end", end)
    train_pack(two_members(tmp_path))
    assert seen == [0] and sum(finals) == 2
