"""A telemetry step's statistics reach the host without blocking it: its row is completed and written later, during
the next step, with the step's own values, and no row is lost when the run ends, is signalled, diverges or fails."""

import json
import logging
import math
import signal

import pytest

from conftest import tiny_config
from normlab.config import TelemetryConfig
from normlab.train import preempt
from normlab.train.callbacks import Callback, Diverged
from normlab.train.checkpoint import checkpoint_path
from normlab.train.rows import Rows
from normlab.train.run import train
from normlab.train.sinks import MetricsFile, RunDir, Sink

KEY = "act/resid_rms/L00"  # one statistic of every telemetry row


def _cfg(text_data, **overrides):
    cfg = tiny_config("layer", "pre", data=text_data, **{"max_steps": 6, "eval_every": 0, "log_every": 1,
                                                        "telemetry": TelemetryConfig(every=2), **overrides})
    cfg.wandb.mode = "disabled"
    return cfg


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Events(Callback, Sink):
    """The order of steps and rows: ('start', s) as step s starts, ('row', s, has statistics) as the sinks get the
    row of step s, and at each step's end whether its record already holds its statistics."""

    name = "events"

    def __init__(self):
        self.events: list[tuple] = []
        self.complete_at_step_end: dict[int, bool] = {}

    def on_step_start(self, state) -> None:
        self.events.append(("start", state.step))

    def on_step_end(self, state, record) -> None:
        if record is not None:
            self.complete_at_step_end[record["step"]] = KEY in record

    def log(self, record) -> None:
        self.events.append(("row", record["step"], KEY in record))


class ReadAtOnce(Callback):
    """Leaves the loop's rows out of the Telemetry callback's reach: it then reads each step's statistics at once."""

    name = "read_at_once"

    def on_step_start(self, state) -> None:
        state.rows = None


def test_a_telemetry_row_is_read_during_the_next_step_with_its_own_steps_values(tmp_path, text_data, one_thread):
    events = Events()
    run_dir = RunDir(tmp_path / "deferred")
    train(_cfg(text_data), run_dir, sinks=[MetricsFile(run_dir), events], callbacks=[events])
    # Telemetry at steps 0, 2, 4 and 5 (the last): each row is written once the next step's work is queued (the last
    # one's before the final record); a plain step's row at once, after the one before it.
    assert events.events == [
        ("start", 0), ("start", 1), ("row", 0, True), ("row", 1, False), ("start", 2), ("start", 3), ("row", 2, True),
        ("row", 3, False), ("start", 4), ("start", 5), ("row", 4, True), ("row", 5, True), ("row", 6, False)]
    assert events.complete_at_step_end == {0: False, 1: False, 2: False, 3: False, 4: False, 5: False}

    # The same run with every statistic read at once, at its own step: the deferred rows hold the same values, though
    # they were read after the next step had changed the weights.
    at_once = RunDir(tmp_path / "at_once")
    train(_cfg(text_data), at_once, sinks=[MetricsFile(at_once)], callbacks=[ReadAtOnce()])
    deferred, direct = _rows(run_dir.path), _rows(at_once.path)
    assert [r["step"] for r in deferred] == [r["step"] for r in direct] == list(range(7))
    for late, now in zip(deferred, direct):
        stats = sorted(k for k in now if "/" in k)
        assert (len(stats) > 50) == (now["step"] in (0, 2, 4, 5)) and sorted(k for k in late if "/" in k) == stats
        for key in stats:
            assert late[key] == now[key] or (late[key] is None and now[key] is None), (now["step"], key)
    assert (tmp_path / "deferred" / "telemetry" / "layers.csv").read_text() == (at_once.path / "telemetry" / "layers.csv").read_text()


def test_a_signal_checkpoints_only_once_the_rows_before_it_are_written(tmp_path, text_data):
    """SIGTERM during telemetry step 2: the checkpoint of step 3 is written after the row of step 2, whole, and the
    resumed run's table of statistics holds step 2 once."""

    class SignalDuring(Callback):
        name = "signal_during"

        def after_optimizer_step(self, state, record) -> None:
            if state.step == 3:
                preempt.request(signal.SIGTERM)

    class Row2(Sink):
        checkpointed_before: bool | None = None

        def log(self, record) -> None:
            if record["step"] == 2:
                Row2.checkpointed_before = checkpoint_path(tmp_path / "cut", 3).exists()

    run_dir = RunDir(tmp_path / "cut")
    with preempt.watch(), pytest.raises(preempt.Preempted) as stopped:
        train(_cfg(text_data), run_dir, sinks=[MetricsFile(run_dir), Row2()], callbacks=[SignalDuring()])
    assert stopped.value.step == 3 and checkpoint_path(run_dir.path, 3).exists()
    assert Row2.checkpointed_before is False
    assert [(r["step"], KEY in r) for r in _rows(run_dir.path)] == [(0, True), (1, False), (2, True)]
    train(_cfg(text_data), run_dir)  # resume=auto: from the checkpoint of step 3
    steps = [line.split(",")[0] for line in (run_dir.path / "telemetry" / "layers.csv").read_text().splitlines()[1:]]
    assert sorted(set(steps), key=int) == ["0", "2", "4", "5"] and steps.count("2") == steps.count("0")


class StopAt(Callback):
    """Raises `error` during step `step`, after its backward: before the loop writes the rows that wait."""

    name = "stop_at"

    def __init__(self, step: int, error: BaseException):
        self.step, self.error = step, error

    def after_backward(self, state) -> None:
        if state.step == self.step:
            raise self.error


@pytest.mark.parametrize("stop", ["diverged", "error"])
def test_a_run_that_stops_in_the_next_step_still_writes_the_telemetry_row_before_it(tmp_path, text_data, stop):
    """Telemetry step 2's row waits for step 3; a divergence or an exception in step 3 ends the run before step 3
    reads it: the row is written whole, before the run says how it ended."""
    error = Diverged(3) if stop == "diverged" else RuntimeError("a fault in step 3")
    run_dir = RunDir(tmp_path / "run")
    if stop == "diverged":
        summary = train(_cfg(text_data), run_dir, callbacks=[StopAt(3, error)])
        assert summary["status"] == "diverged" and summary["diverged_step"] == 3
    else:
        with pytest.raises(RuntimeError, match="a fault in step 3"):
            train(_cfg(text_data), run_dir, callbacks=[StopAt(3, error)])
        assert json.loads(run_dir.summary_path.read_text())["status"] == "failed"
    rows = _rows(run_dir.path)
    assert [(r["step"], KEY in r) for r in rows[:3]] == [(0, True), (1, False), (2, True)]
    assert math.isfinite(rows[2][KEY]) and [r.get("status") for r in rows[3:]] == (["diverged"] if stop == "diverged" else [])


class Logged(Sink):
    def __init__(self):
        self.rows = []

    def log(self, record) -> None:
        self.rows.append(dict(record))


def test_rows_are_written_in_step_order_each_once_complete():
    sink, kept = Logged(), []
    rows = Rows([sink])
    first, second, third = {"step": 0}, {"step": 1}, {"step": 2}
    rows.later(first, lambda: {"stat": 1.5})
    rows.write(first)
    rows.written(first, kept.append)
    assert sink.rows == [] and kept == []  # waits for its statistics
    rows.write(second)  # a row that waits for nothing goes out at once, after the row before it
    assert sink.rows == [{"step": 0, "stat": 1.5}, {"step": 1}] and kept == [first]
    rows.written(second, kept.append)  # already written: at once
    assert kept == [first, second]
    landed = [False]
    rows.later(third, lambda: {"stat": 2.5}, ready=lambda: landed[0])
    rows.write(third)
    rows.flush(wait=False)  # its copy has not landed: left for later, not waited for
    assert len(sink.rows) == 2
    landed[0] = True
    rows.flush(wait=False)
    assert sink.rows[-1] == {"step": 2, "stat": 2.5}
    rows.flush()  # nothing waits: nothing written twice
    assert len(sink.rows) == 3
    fourth, fifth = {"step": 3}, {"step": 4}
    rows.later(fourth, lambda: {"stat": 3.5}, ready=lambda: False)
    rows.write(fourth)
    rows.write(fifth)  # a row after it waits for it: written together, reading the first whether ready or not
    assert sink.rows[3:] == [{"step": 3, "stat": 3.5}, {"step": 4}]


def test_a_failed_read_leaves_its_row_written_without_it(caplog):
    sink = Logged()
    rows = Rows([sink])

    def broken():
        raise RuntimeError("the copy failed")

    record = {"step": 4}
    rows.later(record, broken)
    rows.write(record)
    with pytest.raises(RuntimeError, match="the copy failed"):
        rows.flush()
    assert sink.rows == [{"step": 4}]
    record = {"step": 5}
    rows.later(record, broken)
    rows.write(record)
    with caplog.at_level(logging.WARNING, logger="normlab"):
        rows.close()  # as the run stops: said, not raised
    assert sink.rows[-1] == {"step": 5} and "the copy failed" in caplog.text
