"""Callbacks: hooks in step order, extra callbacks passed to train(), and their state across a checkpoint."""

import json

import pytest

from conftest import tiny_config
from normlab.train.callbacks import Callback
from normlab.train.checkpoint import CheckpointError, checkpoint_path
from normlab.train.run import train


class HookLog(Callback):
    """Writes down every hook call: (hook, state.step, the record's step or None)."""

    name = "hook_log"

    def __init__(self):
        self.calls = []

    def _note(self, hook, state, record=None):
        self.calls.append((hook, state.step, None if record is None else record["step"]))

    def on_train_start(self, state):
        self._note("on_train_start", state)

    def on_step_start(self, state):
        self._note("on_step_start", state)

    def after_backward(self, state):
        assert state.loss is not None and state.model.blocks[0].mlp.fc.weight.grad is not None
        self._note("after_backward", state)

    def before_optimizer_step(self, state):
        assert state.grad_norm is not None
        self._note("before_optimizer_step", state)

    def after_optimizer_step(self, state, record):
        self._note("after_optimizer_step", state, record)

    def on_step_end(self, state, record):
        self._note("on_step_end", state, record)

    def on_train_end(self, state, summary):
        self.calls.append(("on_train_end", state.step, summary["status"]))


class StepCounter(Callback):
    """Counts the steps it has seen, across resumes: its count is checkpointed state."""

    name = "step_counter"

    def __init__(self):
        self.seen = 0
        self.at_start = None

    def on_train_start(self, state):
        self.at_start = self.seen

    def on_step_end(self, state, record):
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def _cfg(**overrides):
    cfg = tiny_config("rms", "pre", **{"max_steps": 3, "eval_every": 0, "log_every": 2, **overrides})
    cfg.wandb.mode = "disabled"
    cfg.telemetry.every = 0
    return cfg


def test_an_extra_callback_sees_its_hooks_in_step_order(tmp_path):
    log = HookLog()
    train(_cfg(), tmp_path, callbacks=[log])
    expected = [("on_train_start", 0, None)]
    for step in range(3):
        logged = step in (0, 2)  # log_every=2, and the last training step
        record = step if logged else None
        expected += [
            ("on_step_start", step, None),
            ("after_backward", step, None),
            ("before_optimizer_step", step, None),
            ("after_optimizer_step", step + 1, record),
            ("on_step_end", step + 1, record),
        ]
    expected.append(("on_train_end", 3, "completed"))
    assert log.calls == expected


def test_an_extra_callback_can_add_to_the_record(tmp_path):
    class LossScaled(Callback):
        name = "loss_scaled"

        def after_optimizer_step(self, state, record):
            if record is not None:
                record["loss_x2"] = 2 * record["loss"]

    train(_cfg(), tmp_path, callbacks=[LossScaled()])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [0, 2]
    assert all(r["loss_x2"] == 2 * r["loss"] for r in trained)


def test_callback_state_survives_a_checkpoint(tmp_path):
    first = StepCounter()
    train(_cfg(), tmp_path, callbacks=[first])
    assert first.seen == 3
    resumed = StepCounter()
    summary = train(_cfg(), tmp_path, callbacks=[resumed])  # resume=auto: the final checkpoint, step 3
    assert summary["resumed_from_step"] == 3
    assert resumed.at_start == 3 and resumed.seen == 3


def test_a_checkpoint_without_a_stateful_callbacks_state_is_refused(tmp_path):
    train(_cfg(), tmp_path)
    with pytest.raises(CheckpointError) as err:
        train(_cfg(), tmp_path, callbacks=[StepCounter()])
    message = str(err.value)
    assert message.startswith(str(checkpoint_path(tmp_path, 3))) and "step_counter" in message and "\n" not in message
