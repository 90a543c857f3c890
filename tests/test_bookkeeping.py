"""Bookkeeping config keys: one mark in the schema decides both what a resumed run may change and
what does not split an arm in `normlab compare`."""

import dataclasses
import json

import pytest

from conftest import tiny_config
from normlab import analysis
from normlab.train import checkpoint
from normlab.config import flatten_config
from normlab.train.checkpoint import Checkpoint, CheckpointError, checkpoint_path
from normlab.config import RunConfig, bookkeeping_keys
from normlab.train.run import train

# What neither changes the data nor the arithmetic of training (data.workers and data.batch_bytes: the same token
# ids whatever they are, tests/test_data_prepare.py).
BOOKKEEPING = {
    "name", "progress", "fail_fast", "device", "compile", "compile_mode", "deterministic", "tf32", "log_every",
    "resume", "overwrite", "ckpt", "wandb", "telemetry", "data.cache_dir", "data.workers", "data.batch_bytes", "sinks",
    "pack",
}  # fmt: skip


def test_bookkeeping_keys_come_from_the_schema_marks():
    assert set(bookkeeping_keys()) == BOOKKEEPING
    assert set(checkpoint.MAY_CHANGE_ON_RESUME) == BOOKKEEPING
    assert set(analysis.NOT_ARM_KEYS) == BOOKKEEPING | {"lr", "seed"}
    # every listed key names a real field of the schema: a whole sub-config or a leaf
    flat = flatten_config(RunConfig())
    for key in bookkeeping_keys():
        assert any(k == key or k.startswith(key + ".") for k in flat), key


def test_bookkeeping_fields_keep_their_defaults():
    cfg = RunConfig()
    assert (cfg.name, cfg.resume, cfg.log_every, cfg.ckpt.every, cfg.wandb.mode, cfg.data.cache_dir) == (
        None, "auto", 10, 100, None, None,
    )  # fmt: skip
    assert cfg.wandb is not RunConfig().wandb  # a default factory, not one shared instance


def _checkpoint_of(cfg):
    return Checkpoint(checkpoint_path("run", 4), {"config": flatten_config(cfg)})


@pytest.mark.parametrize(
    "change",
    [
        {"log_every": 7},
        {"name": "renamed"},
        {"pack": True},
        {"resume": "/elsewhere/checkpoints/step-000004.pt"},
        {"ckpt": {"every": 1, "keep": 3}},
        {"telemetry": {"every": 0}},
        {"wandb": {"mode": "disabled", "project": "other"}},
        {"data": {"cache_dir": "/tmp/tokens"}},
    ],
)
def test_a_resume_may_change_a_bookkeeping_key(change):
    saved = RunConfig()
    changed = RunConfig.from_dict(_merge(saved.to_dict(), change))
    _checkpoint_of(saved).check_config(changed)  # accepted: no error


@pytest.mark.parametrize(
    "change, key",
    [
        ({"depth": 6}, "depth"),
        ({"optim": {"warmup_steps": 10}}, "optim.warmup_steps"),
        ({"data": {"source": "text", "files": ["a.txt"]}}, "data.files"),
        ({"norm": {"eps": 1e-6}}, "norm.eps"),
    ],
)
def test_a_resume_may_not_change_a_key_that_changes_the_result(change, key):
    saved = RunConfig()
    changed = RunConfig.from_dict(_merge(saved.to_dict(), change))
    with pytest.raises(CheckpointError, match=f"written by a run with {key}="):
        _checkpoint_of(saved).check_config(changed)


def test_a_runs_identity_is_its_config_but_the_bookkeeping_keys():
    from normlab.config import run_identity

    saved = RunConfig()
    same = RunConfig.from_dict(_merge(saved.to_dict(), {"name": "renamed", "ckpt": {"every": 1}, "pack": True}))
    assert run_identity(flatten_config(same)) == run_identity(flatten_config(saved))
    # config.json read back: lists for tuples, a number as written (lr 0.003 as 3e-3, an int where a float was)
    written = json.loads(json.dumps({**flatten_config(saved), "lr": 3e-3, "optim.betas": [0.9, 0.95], "depth": 4.0}))
    assert run_identity(written) == run_identity(flatten_config(saved))
    for change in ({"lr": 1e-2}, {"seed": 1}, {"max_steps": 30}, {"norm": {"eps": 1e-6}}):
        other = RunConfig.from_dict(_merge(saved.to_dict(), change))
        assert run_identity(flatten_config(other)) != run_identity(flatten_config(saved)), change
    hash(run_identity(flatten_config(saved)))


@pytest.mark.usefixtures("one_thread")  # the same reduction order in both runs, for equal losses
def test_a_run_resumes_from_its_checkpoint_with_other_bookkeeping(tmp_path):
    cfg = tiny_config("rms", "pre", max_steps=4, log_every=1)
    cfg.wandb.mode = "disabled"
    cfg.ckpt.every, cfg.ckpt.keep = 2, 3
    cfg.telemetry.every = 2
    first = train(cfg, tmp_path)
    later = dataclasses.replace(cfg, resume=str(checkpoint_path(tmp_path, 2)), log_every=2, name="again")
    later.ckpt = dataclasses.replace(cfg.ckpt, every=1)
    again = train(later, tmp_path)
    assert again["resumed_from_step"] == 2
    assert again["final_val_loss"] == first["final_val_loss"]


def _merge(tree, change):
    merged = json.loads(json.dumps(tree))
    for key, value in change.items():
        if isinstance(value, dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
