"""Resume by run dir: `normlab train resume=<run dir>` and `normlab resume <run dir>` continue a run
with the config it was launched with, from the run dir's .hydra/overrides.yaml and config.json; beside them
only bookkeeping keys may change, and anything else is refused in one line with nothing changed on disk. The
message of a stopped run names the command that continues it, ready to paste."""

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_here import normlab_here
from normlab.cli import main

# A run long enough (about a second of training) to be stopped in flight, twice.
RUN = ["model=tiny", "batch_size=4", "seq_len=16", "max_steps=120", "eval_every=40", "eval_batches=2",
       "log_every=5", "ckpt.every=10", "lr=1e-3", "progress=false", "wandb.mode=disabled"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: bit-exact reductions, so rows compare equal
TIMING = ("tokens_per_s", "train_time_s", "wall_time_s", "eval_time_s", "resumed_from_step", "phases", "segments")


def start(*args, cwd):
    return subprocess.Popen([sys.executable, "-m", "normlab", *args], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def checkpoint_steps(run_dir):
    return sorted(int(p.stem.split("-")[1]) for p in (Path(run_dir) / "checkpoints").glob("step-*.pt"))


def snapshot(run_dir):
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(run_dir).rglob("*")) if p.is_file()}


def one_error_line(stderr, *words):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("normlab: error: "), stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def sigterm_after_a_checkpoint(proc, run_dir, after=0):
    """SIGTERM `proc` once `run_dir` holds a checkpoint later than step `after`; its stderr once it stopped."""
    deadline = time.monotonic() + 300
    while not [s for s in checkpoint_steps(run_dir) if s > after]:
        assert proc.poll() is None, f"the run ended before a checkpoint: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "timed out waiting for a checkpoint"
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    return err


def continue_command(stderr):
    """The command a stopped run's one line names, as argv."""
    [line] = [line for line in stderr.splitlines() if line.strip()]
    assert "preempted" in line and "to continue it: " in line, line
    return shlex.split(line.split("to continue it: ", 1)[1])


def test_a_stopped_run_continues_from_its_dir_alone_and_equals_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "my runs" / "stopped"  # a space: the command in the message must quote it
    first = start("train", *RUN, f"hydra.run.dir='{run_dir}'", cwd=tmp_path)
    err = sigterm_after_a_checkpoint(first, run_dir)
    stopped_at = json.loads((run_dir / "summary.json").read_text())["preempted_step"]
    assert 0 < stopped_at < 120

    # The command the message names, pasted as it is (from another dir), with no override of its own.
    command = continue_command(err)
    assert command[:2] == ["normlab", "resume"] and Path(command[2]) == run_dir
    again = start(*command[1:], cwd=tmp_path / "my runs")
    sigterm_after_a_checkpoint(again, run_dir, after=stopped_at)
    # Then as `normlab train resume=<its dir>`, again alone: the replayed overrides were saved once more.
    last = normlab_here("train", f"resume={run_dir}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert last.returncode == 0, last.stderr[-3000:]
    whole = normlab_here("train", *RUN, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path,
                         env={"OMP_NUM_THREADS": "1"})
    assert whole.returncode == 0, whole.stderr[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from_step"] > stopped_at
    got = rows(run_dir)
    assert [r["step"] for r in got] == [r["step"] for r in rows(tmp_path / "whole")]
    assert comparable(got) == comparable(rows(tmp_path / "whole"))
    assert summary["final_val_loss"] == json.loads((tmp_path / "whole" / "summary.json").read_text())["final_val_loss"]
    assert len(list((tmp_path / "my runs").iterdir())) == 1  # no new run dir beside it


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run of 10 steps with checkpoints at 5 and 10, made once; tests take copies."""
    root = tmp_path_factory.mktemp("finished")
    short = [a for a in RUN if not a.startswith(("max_steps", "eval_every", "log_every", "ckpt.every"))]
    result = normlab_here("train", *short, "max_steps=10", "eval_every=5", "log_every=1", "ckpt.every=5", "ckpt.keep=3",
                     f"hydra.run.dir={root / 'run'}", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run"


@pytest.fixture
def run_copy(finished, tmp_path):
    import shutil

    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("change, words", [
    (["lr=1e-2"], ["lr=0.001", "lr=0.01", "drop lr=1e-2"]),
    (["model=small"], ["the run has depth=2", "depth=4", "drop model=small"]),
    (["max_steps=20", "ckpt.keep=1"], ["max_steps=10", "max_steps=20", "drop max_steps=20"]),
])
def test_a_change_beside_resume_is_refused_in_one_line_and_changes_nothing(run_copy, change, words, monkeypatch,
                                                                            capsys):
    before = snapshot(run_copy)
    for resume in (f"resume={run_copy}", f"resume={run_copy / 'checkpoints' / 'step-000005.pt'}"):
        result = normlab_here("train", resume, *change, cwd=run_copy.parent)
        assert result.returncode == 2
        one_error_line(result.stderr, *words)
        assert snapshot(run_copy) == before  # .hydra/ included: Hydra never started


def test_a_bookkeeping_change_beside_resume_is_taken(run_copy, monkeypatch, capsys):
    # From the checkpoint of step 5, with other checkpointing and sinks: the rows after it equal the first run's.
    first = rows(run_copy)
    result = normlab_here("train", f"resume={run_copy / 'checkpoints' / 'step-000005.pt'}", "ckpt.keep=1",
                          "sinks=[jsonl,csv]", cwd=run_copy.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_copy / "summary.json").read_text())["resumed_from_step"] == 5
    assert comparable(rows(run_copy)) == comparable(first)
    assert checkpoint_steps(run_copy) == [10] and (run_copy / "metrics.csv").is_file()


def test_resume_of_an_ended_run_by_its_dir_trains_nothing_and_changes_no_byte(run_copy, monkeypatch, capsys):
    before = snapshot(run_copy)
    result = normlab_here("resume", str(run_copy), cwd=run_copy.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = result.stderr.splitlines()
    assert "already completed" in line and "not trained again" in line and "not applied" not in line
    assert snapshot(run_copy) == before  # .hydra/ and normlab.log included: Hydra never started


def test_an_ended_run_launched_again_in_its_dir_keeps_its_record_and_names_what_was_not_applied(run_copy, monkeypatch,
                                                                                                 capsys):
    # The launch had ckpt.keep=3: a second launch without it must not replace the saved overrides.
    before = snapshot(run_copy)
    short = [a for a in RUN if not a.startswith(("max_steps", "eval_every", "log_every", "ckpt.every"))]
    again = normlab_here("train", *short, "max_steps=10", "eval_every=5", "log_every=1", "ckpt.every=5",
                         f"hydra.run.dir={run_copy}", cwd=run_copy.parent)
    assert again.returncode == 0 and "already completed" in again.stderr, again.stderr[-3000:]
    resumed = normlab_here("resume", str(run_copy), "log_every=5", "ckpt.every=20", cwd=run_copy.parent)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [line] = resumed.stderr.splitlines()
    assert "already completed" in line and line.endswith("not applied: log_every=5 ckpt.every=20"), line
    assert snapshot(run_copy) == before


PRESET = """# @package _global_
defaults:
  - override /model: tiny
max_steps: 2
eval_every: 2
eval_batches: 1
batch_size: 4
seq_len: 16
hydra:
  sweeper:
    params:
      norm: rms,layer
"""


def test_a_resume_refused_because_the_corpus_changed_changes_nothing(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x * 2\n" * 400)
    run_dir = tmp_path / "run"
    short = [a for a in RUN if not a.startswith(("max_steps", "eval_every", "ckpt.every"))]
    first = normlab_here("train", *short, "data=text", f"data.files=[{corpus}]", "max_steps=4", "eval_every=2",
                         "ckpt.every=2", "ckpt.keep=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    # As a preemption after the checkpoint of step 2 leaves it; then the corpus changes.
    (run_dir / "checkpoints" / "step-000004.pt").unlink()
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "preempted", "preempted_step": 2}))
    corpus.write_text("class A:\n    pass\n" * 600)
    before = snapshot(run_dir)
    again = normlab_here("resume", str(run_dir), cwd=tmp_path)
    assert again.returncode == 2
    one_error_line(again.stderr, "step-000002.pt", "the data changed")
    assert snapshot(run_dir) == before  # .hydra/hydra.yaml and overrides.yaml included


def test_a_sweep_jobs_dir_resumes_with_its_config_dir_and_preset(tmp_path, monkeypatch, capsys):
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "tiny_grid.yaml").write_text(PRESET)
    sweep = tmp_path / "sweep"
    result = normlab_here("train", "-m", "--config-dir", "conf", "experiment=tiny_grid", "progress=false",
                          "wandb.mode=disabled", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # A job's dir, from elsewhere: its saved overrides (the preset's norm=rms among them) and its --config-dir.
    job = sweep / "0_rms-pre-d2-lr3e-3-s0"
    again = normlab_here("resume", str(job), cwd=tmp_path / "conf")
    assert again.returncode == 0 and "already completed" in again.stderr, again.stderr[-3000:]
    # The sweep dir itself: the command that runs the sweep again there, --config-dir included.
    result = normlab_here("resume", str(sweep), cwd=tmp_path)
    assert result.returncode == 2
    one_error_line(result.stderr, f"normlab train -m --config-dir {tmp_path / 'conf'} experiment=tiny_grid")


def test_a_sweep_dir_given_to_resume_names_the_command_that_continues_it(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra:\n  overrides:\n    task:\n    - norm=rms,layer\n    - lr=1e-3\n")
    result = normlab_here("resume", str(sweep), cwd=tmp_path)
    assert result.returncode == 2
    one_error_line(result.stderr, "a sweep dir", f"normlab train -m norm=rms,layer lr=1e-3 hydra.sweep.dir={sweep}")


def test_resume_without_a_run_dir_says_how_to_call_it(tmp_path, monkeypatch, capsys):
    result = normlab_here("resume", cwd=tmp_path)
    assert result.returncode == 2
    one_error_line(result.stderr, "normlab resume RUN_DIR")
    assert main(["--help"]) == 0 and "normlab resume RUN_DIR" in capsys.readouterr().out


def test_a_sweep_jobs_message_names_the_sweeps_own_command_again(monkeypatch, tmp_path):
    from normlab.launch.resume import continue_command as command_for

    sweep = tmp_path / "sweep dir"
    monkeypatch.setattr(sys, "argv", ["normlab train", "-m", "norm=rms,layer", "lr=1e-3", f"hydra.sweep.dir={sweep}"])
    command = shlex.split(command_for(str(sweep / "0_rms-pre"), True, str(sweep)))
    assert command == ["normlab", "train", "-m", "norm=rms,layer", "lr=1e-3", f"hydra.sweep.dir={sweep}"]
    single = shlex.split(command_for(str(tmp_path / "it's"), False, str(tmp_path)))
    assert single == ["normlab", "resume", str(tmp_path / "it's")]


@pytest.mark.parametrize("path", ["/runs/plain-1_2.3", "/my runs/x", "/it's/x", "/a,b/x", "/1e-3", "/back\\slash'/x\\"])
def test_a_path_is_written_as_an_override_hydra_reads_back_as_written(path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from normlab.launch.overrides import quoted_value

    [override] = OverridesParser.create().parse_overrides([f"resume={quoted_value(path)}"])
    assert override.value() == path
    assert quoted_value("/runs/plain-1_2.3") == "/runs/plain-1_2.3"  # unquoted where Hydra reads it as it is
