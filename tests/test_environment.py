"""summary.json's `environment`: what a run's numbers depend on besides its config, recorded for
runs that finish, runs that fail, and each member of a pack."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import normlab
from conftest import tiny_config
from normlab.config import DataConfig
from normlab.data import DataError
from normlab.train.environment import git_commit, run_environment
from normlab.train.pack import train_pack
from normlab.train.run import train

KEYS = {"python", "torch", "cuda", "device", "torch_threads", "world_size", "normlab", "git_commit"}
SOURCE_ROOT = Path(normlab.__file__).resolve().parent.parent


def summary(run_dir):
    return json.loads((Path(run_dir) / "summary.json").read_text())


@pytest.fixture
def threads():
    """Set torch's thread count for the test; the previous count comes back after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_a_runs_summary_records_its_environment(tmp_path, threads):
    threads(2)
    train(tiny_config(max_steps=2, sinks=[]), tmp_path / "two")
    threads(1)
    train(tiny_config(max_steps=2, sinks=[]), tmp_path / "one")
    env = summary(tmp_path / "one")["environment"]
    assert set(env) == KEYS
    assert env["python"] == platform.python_version() and env["torch"] == torch.__version__
    assert env["cuda"] is None and env["device"] == "cpu" and env["world_size"] == 1
    assert env["normlab"] == normlab.__version__
    assert env["git_commit"] == git_commit(SOURCE_ROOT)
    if (SOURCE_ROOT / ".git").exists():  # run from a checkout (an editable install, or PYTHONPATH)
        assert len(env["git_commit"]) == 40
    # The thread count the run trained with: the one figure here that changes a CPU run's numbers.
    assert env["torch_threads"] == 1 and summary(tmp_path / "two")["environment"]["torch_threads"] == 2


def test_a_failed_runs_summary_records_its_environment_too(tmp_path):
    cfg = tiny_config(sinks=[], data=DataConfig(source="text", files=[str(tmp_path / "missing.txt")]))
    with pytest.raises(DataError):
        train(cfg, tmp_path / "run")
    done = summary(tmp_path / "run")
    assert done["status"] == "failed" and set(done["environment"]) == KEYS


def test_each_member_of_a_pack_records_its_environment(tmp_path, one_thread):
    cfgs = [tiny_config(lr=lr, max_steps=2, sinks=[]) for lr in (1e-3, 3e-3)]
    summaries = train_pack([(cfg, tmp_path / f"member{i}") for i, cfg in enumerate(cfgs)])
    for i, returned in enumerate(summaries):
        env = summary(tmp_path / f"member{i}")["environment"]
        assert env == returned["environment"] and set(env) == KEYS and env["torch_threads"] == 1


def test_the_git_commit_is_the_source_checkouts_head_and_null_elsewhere(tmp_path, monkeypatch):
    repo = tmp_path / "checkout"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert git_commit(repo) == head
    assert git_commit(tmp_path) is None  # not a checkout
    installed = tmp_path / "venv" / "lib" / "site-packages"
    installed.mkdir(parents=True)
    assert git_commit(installed) is None  # an installed copy, even inside someone's checkout

    git_commit.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    try:
        assert git_commit(repo) is None  # no git: null, never a failure
        assert run_environment("cpu")["git_commit"] is None
    finally:
        git_commit.cache_clear()


def test_the_environment_asks_nothing_it_cannot_answer():
    # device=cuda on a machine without one: the run fails on it; the environment names what was asked.
    env = run_environment("cuda")
    if not torch.cuda.is_available():
        assert env["device"] == "cuda" and env["cuda"] is None
    else:
        assert env["device"] == torch.cuda.get_device_name(0) and env["cuda"] == torch.version.cuda
    assert sys.version.startswith(env["python"])
