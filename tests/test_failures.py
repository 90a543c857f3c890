"""normlab's failure paths: nothing lost, nothing hung.

A refused resume, a busy run dir or another config's records change no file of the run dir, Hydra's
.hydra/ included; a full disk leaves whole records, a summary and one line; a signal during start-up
stops at once, Ctrl-C at a step boundary as `interrupted`; one job's data or checkpoint error is that
job's failure, and a re-run sweep does not train (or open wandb for) a job that already ended.
"""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import wandb

from cli_here import normlab_here
from conftest import one_error_line, tiny_config
from normlab.cli import main
from normlab.config import RunConfig
from normlab.train import preempt
from normlab.train.callbacks import Callback
from normlab.train.checkpoint import Checkpoint, CheckpointError, checkpoint_path, list_checkpoints
from normlab.train.sinks import MetricsFile, RunDir, RunDirBusy, Sink
from normlab.train.run import train

RUN = ["model=tiny", "batch_size=4", "seq_len=16", "max_steps=10", "eval_every=5", "eval_batches=2",
       "log_every=1", "ckpt.every=5", "ckpt.keep=3", "progress=false", "wandb.mode=disabled"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def start(*args, cwd):
    """`normlab` running in the background. Its SIGINT is the default one, as a terminal's Ctrl-C finds it, even
    when pytest itself runs as a background job (`cmd &` in a script), which starts with SIGINT ignored: normlab
    leaves an ignored signal ignored, so the Ctrl-C test would then see a run that finishes."""
    return subprocess.Popen([sys.executable, "-m", "normlab", *args], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def snapshot(run_dir):
    """{relative path: sha256} of every file under `run_dir`, hidden ones and .hydra/ included."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(run_dir).rglob("*")) if p.is_file()}


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir):
    return json.loads((Path(run_dir) / "summary.json").read_text())


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 10 steps with checkpoints at steps 5 and 10, made once; tests take copies."""
    root = tmp_path_factory.mktemp("finished")
    result = normlab_here("train", *RUN, f"hydra.run.dir={root / 'run'}", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run"


@pytest.fixture
def run_copy(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


# §1 A refused resume changes nothing ----------------------------------------------------------------

def _drop(path, *keys):
    payload = torch.load(path, weights_only=True)
    node = payload
    for key in keys[:-1]:
        node = node[key]
    del node[keys[-1]]
    torch.save(payload, path)


@pytest.mark.parametrize("piece", [("state", "scaler"), ("state", "best_val"), ("callbacks", "throughput"),
                                   ("rng", "numpy"), ("state", "data_sampler")])
def test_a_resume_from_a_checkpoint_lacking_a_piece_changes_nothing(run_copy, piece, monkeypatch, capsys):
    five = checkpoint_path(run_copy, 5)
    _drop(five, *piece)
    before = snapshot(run_copy)
    result = normlab_here("train", *RUN, f"resume={five}", cwd=run_copy.parent)
    assert result.returncode == 2
    one_error_line(result.stderr, str(five), piece[-1])
    assert snapshot(run_copy) == before  # step-000010.pt, metrics.jsonl, summary.json, .hydra/config.yaml


def test_train_refuses_a_checkpoint_lacking_a_piece_before_touching_the_run_dir(run_copy):
    # train() without the Hydra layer: the same guarantee.
    _drop(checkpoint_path(run_copy, 10), "callbacks", "divergence_guard")
    before = snapshot(run_copy)
    cfg = _tiny_cli_config()
    with pytest.raises(CheckpointError, match="divergence_guard"):
        train(cfg, run_copy)
    assert snapshot(run_copy) == before


def _tiny_cli_config(**overrides):
    """The RunConfig `normlab train *RUN` composes."""
    from normlab.launch.resolvers import register_resolvers
    from normlab.launch.rundir import compose_run

    register_resolvers()  # the packaged config uses them
    cfg, _ = compose_run([*RUN, *[f"{k}={v}" for k, v in overrides.items()]], [], "normlab.conf")
    return cfg


def test_a_resume_with_another_config_changes_nothing(run_copy, monkeypatch, capsys):
    before = snapshot(run_copy)
    result = normlab_here("train", *RUN, "lr=1e-2", f"hydra.run.dir={run_copy}", cwd=run_copy.parent)
    assert result.returncode == 2
    one_error_line(result.stderr, "lr=0.003", "lr=0.01")
    assert snapshot(run_copy) == before


def test_a_cut_newest_checkpoint_names_the_newest_readable_one_and_the_command_that_continues_from_it(
        run_copy, monkeypatch, capsys):
    import shlex

    # A run stopped after its checkpoint of step 10, which was then cut in half.
    record, steps = summary(run_copy), [r["step"] for r in rows(run_copy)]
    (run_copy / "summary.json").write_text(json.dumps({**record, "status": "preempted", "preempted_step": 10}))
    newest = checkpoint_path(run_copy, 10)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    before = snapshot(run_copy)
    refused = normlab_here("resume", str(run_copy), cwd=run_copy.parent)
    assert refused.returncode == 2
    line = one_error_line(refused.stderr, str(newest), "unreadable checkpoint", str(checkpoint_path(run_copy, 5)),
                          "(step 5)")
    assert "..." not in line and "miniz" not in line
    assert snapshot(run_copy) == before
    command = shlex.split(line.split("to continue from it: ", 1)[1].split(" (the later")[0])
    assert command[:2] == ["normlab", "resume"]
    resumed = normlab_here(*command[1:], cwd=run_copy.parent)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_copy)["status"] == "completed" and summary(run_copy)["resumed_from_step"] == 5
    assert [r["step"] for r in rows(run_copy)] == steps
    Checkpoint.load(newest)  # written again by the resumed run


# §1 Rows dropped without a word ------------------------------------------------------------------------

@pytest.fixture
def killed_before_a_checkpoint(run_copy):
    """A run dir as a run SIGKILLed before its first checkpoint leaves it: rows, config, no checkpoint, no summary."""
    shutil.rmtree(run_copy / "checkpoints")
    (run_copy / "summary.json").unlink()
    return run_copy


@pytest.mark.parametrize("resume", ["auto", "null"])
def test_another_configs_records_are_refused_by_auto_and_null_alike(killed_before_a_checkpoint, resume, monkeypatch,
                                                                    capsys):
    run_dir = killed_before_a_checkpoint
    before = snapshot(run_dir)
    result = normlab_here("train", *RUN, "lr=1e-2", f"resume={resume}", f"hydra.run.dir={run_dir}", cwd=run_dir.parent)
    assert result.returncode == 2
    one_error_line(result.stderr, str(run_dir), "overwrite=true")
    assert snapshot(run_dir) == before


def test_overwrite_true_starts_over(killed_before_a_checkpoint, monkeypatch, capsys):
    run_dir = killed_before_a_checkpoint
    result = normlab_here("train", *RUN, "lr=1e-2", "overwrite=true", f"hydra.run.dir={run_dir}",
                                cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in rows(run_dir)] == list(range(11))
    assert summary(run_dir)["lr"] == 0.01 and json.loads((run_dir / "config.json").read_text())["lr"] == 0.01


def test_the_same_configs_killed_run_restarts(killed_before_a_checkpoint, monkeypatch, capsys):
    run_dir = killed_before_a_checkpoint
    result = normlab_here("train", *RUN, f"hydra.run.dir={run_dir}", cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in rows(run_dir)] == list(range(11))


# §1 Two runs in one run dir -----------------------------------------------------------------------------

HOLD = "import sys, time; from normlab.train.sinks import RunDir\nwith RunDir(sys.argv[1]).lock():\n    print('held', flush=True); time.sleep(600)"


def test_a_second_run_in_a_locked_run_dir_gets_one_line_and_changes_nothing(run_copy, monkeypatch, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_copy)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(run_copy)
        result = normlab_here("train", *RUN, "resume=auto", f"hydra.run.dir={run_copy}", cwd=run_copy.parent)
        assert result.returncode == 2
        one_error_line(result.stderr, str(run_copy), "in use")
        result = normlab_here("train", *RUN, "resume=null", f"hydra.run.dir={run_copy}", cwd=run_copy.parent)
        assert result.returncode == 2
        one_error_line(result.stderr, str(run_copy), "in use")
        assert snapshot(run_copy) == before
        with pytest.raises(RunDirBusy):
            train(_tiny_cli_config(), run_copy)  # train() itself, without the Hydra layer
        assert snapshot(run_copy) == before
    finally:
        holder.kill()  # SIGKILL: the lock must die with its process
        holder.wait()
    result = normlab_here("train", *RUN, "overwrite=true", f"hydra.run.dir={run_copy}", cwd=run_copy.parent)
    assert result.returncode == 0, result.stderr[-3000:]


HOLD_DIR = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)")  # as RunDir.lock(), without torch


def test_a_sweep_job_whose_dir_another_process_holds_is_busy_on_its_line_and_in_the_table(tmp_path):
    """As when two identical sweeps start in one dir: the job the other process trains is not this sweep's to report."""
    sweep = tmp_path / "sweep"
    held = sweep / "0_layer-pre-d2-lr1e-3-s0"
    held.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_DIR, str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = normlab_here("train", "-m", *SWEEP, "max_steps=2", "lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}",
                              cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("job 0 ")]
    assert line.startswith(f"job 0 layer-pre-d2-lr1e-3-s0: busy: held by PID {holder.pid}, final val loss -"), line
    assert "sweep: 2 jobs (1 busy, 1 completed), best first" in result.stdout
    [row] = [r for r in result.stdout.splitlines() if r.startswith("0 ")]
    assert f"BUSY: held by PID {holder.pid}" in row
    assert line in (sweep / "sweep.log").read_text()
    [refusal] = [e for e in result.stderr.splitlines() if e.startswith("normlab: error: job 0")]
    assert f"another normlab run (PID {holder.pid}) is writing it" in refusal


def test_two_runs_started_together_in_one_dir_do_not_interleave(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    slow = ["max_steps=200", "eval_every=50", "ckpt.every=50"]
    procs = [start("train", *RUN, *slow, f"hydra.run.dir={run_dir}", cwd=tmp_path) for _ in range(2)]
    results = [(p.wait(timeout=600), p.communicate()[1]) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    one_error_line(loser, "in use")
    assert [r["step"] for r in rows(run_dir)] == list(range(201))


# §1 Disk full -------------------------------------------------------------------------------------------

class Finishes(Sink):
    def __init__(self):
        self.finished = None

    def finish(self, summary, exit_code):
        self.finished = (summary["status"], exit_code)


class BrokenFinish(Sink):
    def finish(self, summary, exit_code):
        raise OSError(errno.ENOSPC, "No space left on device")


def _fill_disk_at(monkeypatch, path, after_bytes, torn=True):
    """os.write to `path` accepts `after_bytes` bytes, then writes half of what it is given once (a short
    write, as a disk that fills mid-write does) and refuses with ENOSPC from then on."""
    real, budget = os.write, {"left": after_bytes}

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target != str(path):
            return real(fd, data)
        if budget["left"] >= len(data):
            budget["left"] -= len(data)
            return real(fd, data)
        if torn and budget["left"] >= 0:
            budget["left"] = -1
            return real(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)


def _disk_cfg():
    cfg = tiny_config(max_steps=10, eval_every=5, log_every=1)
    cfg.wandb.mode = "disabled"
    cfg.telemetry.every = 0  # short rows: the full disk comes after a few of them
    cfg.ckpt.every, cfg.ckpt.keep = 3, 3
    return cfg


@pytest.mark.parametrize("torn", [True, False])
def test_a_full_disk_leaves_whole_lines_a_summary_and_finished_sinks(tmp_path, monkeypatch, torn):
    run_dir = RunDir(tmp_path / "run")
    _fill_disk_at(monkeypatch, run_dir.metrics_path.resolve(), after_bytes=700, torn=torn)
    watcher, broken = Finishes(), BrokenFinish()
    with pytest.raises(OSError) as raised:
        train(_disk_cfg(), run_dir, sinks=[broken, MetricsFile(run_dir), watcher])
    assert raised.value.errno == errno.ENOSPC
    text = run_dir.metrics_path.read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == list(range(len(text.splitlines())))
    assert 0 < len(text.splitlines()) < 11
    assert summary(run_dir.path)["status"] == "failed" and "No space left" in summary(run_dir.path)["error"]
    assert watcher.finished == ("failed", 1)  # finished although the sink before it failed to
    assert not [p for p in run_dir.path.rglob("*") if p.name.endswith(".tmp") or p.name.endswith(".reserve")]


def _tmpfs(path, size):
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    return path


@pytest.fixture
def small_disk(tmp_path):
    disk = _tmpfs(tmp_path / "disk", "16m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


class FillDiskAt(Sink):
    """When it sees the record of `step`, fills the disk of `folder` but for `spare` bytes."""

    def __init__(self, folder, step, spare=0):
        self.folder, self.step, self.spare = Path(folder), step, spare

    def log(self, record):
        if record["step"] == self.step:
            fd = os.open(self.folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                for _ in range(100):  # a run beside it can free space meanwhile (an old checkpoint removed): again
                    try:
                        while True:
                            os.write(fd, bytes(4096))
                    except OSError:
                        pass
                    if shutil.disk_usage(self.folder).free < 4096:
                        break
                else:
                    raise AssertionError(f"{self.folder} keeps {shutil.disk_usage(self.folder).free} bytes free")
            finally:
                os.close(fd)


def test_a_checkpoint_that_cannot_be_written_fails_the_run_and_keeps_the_last(small_disk):
    # A real full disk (tmpfs): no metrics sink, so the checkpoint of step 6 is the write that fails.
    run_dir = RunDir(small_disk / "run")
    with pytest.raises(OSError) as raised:
        train(_disk_cfg(), run_dir, sinks=[FillDiskAt(small_disk, step=4)])
    assert raised.value.errno == errno.ENOSPC
    assert [s for s, _ in list_checkpoints(run_dir.path)] == [3]
    assert Checkpoint.load(checkpoint_path(run_dir.path, 3)).step == 3
    done = summary(run_dir.path)
    assert done["status"] == "failed" and "No space left" in done["error"]
    assert not [p for p in run_dir.path.rglob("*") if p.name.endswith(".tmp")]


def test_a_full_disk_is_one_line_from_the_command(small_disk, tmp_path):
    run_dir = small_disk / "run"
    proc = start("train", *RUN, "max_steps=400", "eval_every=100", "ckpt.every=5", "sinks=[jsonl,csv]",
                 f"hydra.run.dir={run_dir}", cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not checkpoint_path(run_dir, 5).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.01)
    FillDiskAt(small_disk, 0).log({"step": 0})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    one_error_line(err, "disk is full")
    assert summary(run_dir)["status"] == "failed"
    assert [r["step"] for r in rows(run_dir)] == list(range(len(rows(run_dir))))
    csv_lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("step,") and all(line.split(",")[0].isdigit() for line in csv_lines[1:])
    assert Checkpoint.load(max(p for _, p in list_checkpoints(run_dir))).step >= 5
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]


# §2 Signals -----------------------------------------------------------------------------------------------

class SignalOnStart(Callback):
    name = "signal_on_start"

    def __init__(self, signum):
        self.signum = signum

    def on_train_start(self, state):
        os.kill(os.getpid(), self.signum)
        time.sleep(30)  # start-up that would go on: the signal must cut it short


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_before_the_first_step_stops_at_once(tmp_path, signum):
    started = time.monotonic()
    with preempt.watch(), pytest.raises(preempt.Preempted) as stopped:
        train(_disk_cfg(), tmp_path, callbacks=[SignalOnStart(signum)])
    assert time.monotonic() - started < 25
    assert stopped.value.signum == signum and stopped.value.step == 0
    assert list_checkpoints(tmp_path) == []
    assert summary(tmp_path)["status"] == "preempted" and summary(tmp_path)["preempted_step"] == 0


def test_a_checkpoint_that_blocks_on_read_does_not_hang_through_sigterm(run_copy):
    fifo = checkpoint_path(run_copy, 20)
    os.mkfifo(fifo)  # reading it blocks until someone writes: a hung network file system, say
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    with preempt.watch(), pytest.raises(preempt.Preempted) as stopped:
        timer.start()
        train(_tiny_cli_config(), run_copy)
    assert time.monotonic() - started < 20 and stopped.value.signum == signal.SIGTERM


def blocked_opening_a_fifo(proc, timeout=120) -> bool:
    """Waits until `proc` sleeps in opening a FIFO for reading (the kernel's wait_for_partner); False if
    it ended first. Skips the test where the kernel never names what a process waits in (gVisor's wchan is 0)."""
    deadline, named = time.monotonic() + timeout, False
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            wchan = Path(f"/proc/{proc.pid}/wchan").read_text()
        except OSError:
            wchan = "0"
        if wchan == "wait_for_partner":
            return True
        named = named or wchan != "0"
        time.sleep(0.05)
    if proc.poll() is None and not named:
        proc.kill()
        pytest.skip("this kernel does not say what a process waits in (/proc/PID/wchan)")
    return False


def test_sigterm_while_the_command_reads_a_blocking_checkpoint_ends_it(run_copy):
    # A stopped run (an ended one is found without reading a checkpoint), whose newest checkpoint blocks.
    (run_copy / "summary.json").write_text(json.dumps({**summary(run_copy), "status": "preempted",
                                                       "preempted_step": 10}))
    os.mkfifo(checkpoint_path(run_copy, 20))
    before = snapshot(run_copy)
    # The Hydra layer reads the checkpoint before Hydra starts; SIGTERM there ends the process at once.
    proc = start("train", *RUN, f"hydra.run.dir={run_copy}", cwd=run_copy.parent)
    assert blocked_opening_a_fifo(proc), proc.communicate()
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert time.monotonic() - started < 30 and proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)
    assert snapshot(run_copy) == before


def test_ctrl_c_during_training_checkpoints_and_exits_interrupted(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    proc = start("train", *RUN, "max_steps=400", "eval_every=100", "ckpt.every=1000", f"hydra.run.dir={run_dir}",
                 cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").exists() and len(rows(run_dir)) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in err
    done = summary(run_dir)
    [(step, _)] = list_checkpoints(run_dir)
    assert done["status"] == "interrupted" and done["preempted_step"] == step
    assert rows(run_dir)[-1]["step"] == step - 1  # the checkpoint sits at the step boundary after the last row
    resumed = normlab_here("train", *RUN, "max_steps=400", "eval_every=100", "ckpt.every=1000",
                                 f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == step
    assert [r["step"] for r in rows(run_dir)] == list(range(401))


def signal_at_second_evaluation(monkeypatch, signum: int) -> None:
    """The training loop's second evaluation (that of step 5) first sends this process `signum`."""
    import normlab.train.loop as loop

    evaluate, calls = loop.evaluate, []

    def signalled_evaluate(*args):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)
        return evaluate(*args)

    monkeypatch.setattr(loop, "evaluate", signalled_evaluate)


def test_ctrl_c_says_so_once_after_the_progress_bar_closed(tmp_path, monkeypatch, capsys):
    import gc

    import normlab.train.run as run
    from normlab.train.callbacks.progress import ProgressBar

    monkeypatch.setattr(run, "progress", ProgressBar)  # the bar a terminal gets
    signal_at_second_evaluation(monkeypatch, signal.SIGINT)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:  # main itself, so that capsys sees what a collected bar would draw
        main(["train", *RUN, "progress=true", f"hydra.run.dir={tmp_path / 'run'}"])
    gc.collect()  # an open bar is drawn again when collected
    out, err = capsys.readouterr()
    assert stopped.value.code == 130
    said = [line for line in (out + err).splitlines() if "stopped by SIGINT" in line]
    assert len(said) == 1 and said[0].startswith("normlab: ") and "step 5" in said[0], out + err
    assert err.rstrip("\n").endswith(said[0]), err[-2000:]  # nothing drawn after it
    assert "interrupted" in (tmp_path / "run" / "normlab.log").read_text()


# §3 Sweeps finish -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("data", ["missing", "empty", "a directory", "hf offline"])
def test_a_single_run_refused_for_its_data_leaves_no_run_dir(tmp_path, data, monkeypatch, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "folder").mkdir()
    given = {"missing": ["data=text", f"data.files=[{tmp_path / 'missing.txt'}]"],
             "empty": ["data=text", f"data.files=[{tmp_path / 'empty.txt'}]"],
             "a directory": ["data=text", f"data.files=[{tmp_path / 'folder'}]"],
             "hf offline": ["data=hf", "data.name=surely/not-cached-xyz", f"data.cache_dir={tmp_path / 'cache'}"]}[data]
    result = normlab_here("train", *RUN, *given, cwd=tmp_path)
    assert result.returncode == 2
    one_error_line(result.stderr)
    runs = tmp_path / "outputs" / "runs"
    assert not runs.exists() or not list(runs.iterdir()), list(runs.rglob("*"))


def test_a_refused_run_in_a_dir_that_existed_keeps_the_dir(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    result = normlab_here("train", *RUN, "data=text", f"data.files=[{tmp_path / 'missing.txt'}]",
                                f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 2 and run_dir.is_dir()


def test_a_data_error_in_one_job_is_that_jobs_failure(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.txt").write_text("too small")
    (tmp_path / "b.txt").write_text("def f(x):\n    return x * 2\n" * 400)
    sweep = tmp_path / "sweep"
    result = normlab_here("train", "-m", *RUN, "data=text",
                                f"data.files=[{tmp_path / 'a.txt'}],[{tmp_path / 'b.txt'}]", f"hydra.sweep.dir={sweep}",
                                cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [summary(job)["status"] for job in jobs] == ["failed", "completed"]
    assert "a.txt" in summary(jobs[0])["error"]
    failures = [line for line in result.stderr.splitlines() if line.startswith("normlab: error:")]
    assert len(failures) == 1 and "job 0" in failures[0] and "a.txt" in failures[0]
    # One line on the terminal; the traceback in the job's own log.
    assert "Traceback" not in result.stdout + result.stderr and "[ERROR]" not in result.stdout + result.stderr
    log = (jobs[0] / "normlab.log").read_text()
    assert "job layer-pre-d2-lr3e-3-s0 failed: DataError" in log and "Traceback (most recent call last)" in log


def test_a_rerun_sweep_records_a_corrupt_checkpoint_and_skips_ended_jobs(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    args = ["train", "-m", *[a for a in RUN if a != "wandb.mode=disabled"], "wandb.mode=offline", "norm=layer,rms",
            f"hydra.sweep.dir={sweep}"]
    first = normlab_here(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    wandb.teardown()  # as the end of a process would: wandb's service stops writing the jobs' wandb/ logs
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    wandb_runs = {job: sorted((job / "wandb").glob("offline-run-*")) for job in jobs}
    # Job 0 as a preemption leaves it, but with its newest checkpoint cut short.
    record = summary(jobs[0])
    (jobs[0] / "summary.json").write_text(json.dumps({**record, "status": "preempted"}))
    newest = checkpoint_path(jobs[0], 10)
    newest.write_bytes(newest.read_bytes()[:100])
    ended = snapshot(jobs[1])

    again = normlab_here(*args, "ckpt.keep=7", cwd=tmp_path)  # bookkeeping: an ended run is still not trained again
    assert again.returncode == 0, again.stderr[-3000:]
    assert summary(jobs[0])["status"] == "failed" and str(newest) in summary(jobs[0])["error"]
    failures = [line for line in again.stderr.splitlines() if line.startswith("normlab: error:")]
    assert len(failures) == 1 and "job 0" in failures[0] and "unreadable checkpoint" in failures[0]
    assert "already completed" in again.stderr
    # The ended job's dir byte for byte, .hydra/ and normlab.log included (Hydra's run_job would rewrite and append
    # to them). Not the job's: wandb/offline-run-*/logs/debug-core.log links to ~/.cache/wandb/logs/core-debug-
    # <second>.log, the log of the wandb service, which every service started in that second on the machine writes.
    linked = {k for k in ended if (jobs[1] / k).is_symlink()}
    assert {k: v for k, v in snapshot(jobs[1]).items() if k not in linked} == {
        k: v for k, v in ended.items() if k not in linked}
    assert any(line.startswith("job 1 ") and ": completed" in line for line in again.stdout.splitlines())  # its line
    assert sorted((jobs[1] / "wandb").glob("offline-run-*")) == wandb_runs[jobs[1]]  # no second wandb run


SWEEP = [a for a in RUN if not a.startswith(("max_steps=", "eval_every=", "ckpt."))] + ["eval_every=2"]


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    """A sweep of two jobs of 4 steps (lr=1e-3,3e-3), run once in its dir; tests take copies."""
    root = tmp_path_factory.mktemp("finished_sweep")
    result = normlab_here("train", "-m", *SWEEP, "max_steps=4", "lr=1e-3,3e-3", f"hydra.sweep.dir={root / 'sweep'}",
                          cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "sweep"


@pytest.mark.parametrize("launcher", [[], ["hydra.launcher.cpu_jobs=2"], ["pack=true"], ["hydra/launcher=basic"],
                                      ["hydra/launcher=submitit_local"]], ids=lambda a: " ".join(a) or "normlab")
def test_a_finished_sweep_run_again_with_another_value_is_refused_whole_and_changes_nothing(finished_sweep, tmp_path,
                                                                                          launcher):
    sweep = tmp_path / "sweep"
    shutil.copytree(finished_sweep, sweep)
    before = snapshot(sweep)
    # One value changed (max_steps), and one more lr: job 2 never started, and does not start either.
    again = normlab_here("train", "-m", *SWEEP, "max_steps=6", "lr=1e-3,3e-3,1e-2", f"hydra.sweep.dir={sweep}",
                         *launcher, cwd=tmp_path)
    assert again.returncode == 2
    line = one_error_line(again.stderr, f"hydra.sweep.dir={sweep}", "jobs 0 (layer-pre-d2-lr1e-3-s0) and "
                          "1 (layer-pre-d2-lr3e-3-s0) ran with max_steps=4", "this command gives max_steps=6",
                          "give max_steps=4 to continue the sweep")
    assert "lr1e-2" not in line
    assert snapshot(sweep) == before  # every file, .hydra/, normlab.log, multirun.yaml and sweep.log included
    assert sorted(p.name for p in sweep.iterdir()) == sorted(p.name for p in finished_sweep.iterdir())  # no job 2


def test_a_search_sweep_run_again_with_another_value_stops_at_its_first_trial_with_records(tmp_path):
    sweep = tmp_path / "sweep"
    search = ["hydra/sweeper=lr_search", "hydra.sweeper.n_trials=1", f"hydra.sweep.dir={sweep}"]
    first = normlab_here("train", "-m", *SWEEP, "max_steps=4", *search, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(sweep)
    again = normlab_here("train", "-m", *SWEEP, "max_steps=6", *search, cwd=tmp_path)
    assert again.returncode == 2
    [line] = [line for line in again.stderr.splitlines() if line.startswith("normlab: error:")]
    assert "job 0 (layer-pre-d2-lr" in line and "ran with max_steps=4 (its config.json), this command gives max_steps=6" in line
    # No traceback of normlab's (optuna's logger, set up by the first command in this process, writes to a stream
    # that command's capture closed: a test artifact, printed as a "Logging error").
    assert again.stderr.count("Traceback") == again.stderr.count("--- Logging error ---\nTraceback")
    assert snapshot(sweep) == before


def test_a_failure_is_not_recorded_over_the_records_of_another_config(run_copy):
    from normlab.launch.rundir import record_failure

    before = snapshot(run_copy)
    cfg = tiny_config(max_steps=12)  # run_copy ran 10 steps
    record_failure(run_copy, cfg, CheckpointError("written by a run with max_steps=10"))
    assert snapshot(run_copy) == before
    own = RunConfig.from_dict(json.loads((run_copy / "config.json").read_text()))
    record_failure(run_copy, own, CheckpointError("unreadable"))  # its own config: the failure is on record
    assert summary(run_copy)["status"] == "failed" and summary(run_copy)["error"] == "CheckpointError: unreadable"


@pytest.mark.usefixtures("one_thread")
def test_a_signal_during_an_evaluation_stops_before_the_next_step_and_resumes_exactly(tmp_path, monkeypatch):
    import normlab.train.loop as loop

    whole, evaluate = train(_disk_cfg(), tmp_path / "whole"), loop.evaluate
    signal_at_second_evaluation(monkeypatch, signal.SIGTERM)
    with preempt.watch(), pytest.raises(preempt.Preempted) as stopped:
        train(_disk_cfg(), tmp_path / "cut")
    assert stopped.value.step == 5 and [s for s, _ in list_checkpoints(tmp_path / "cut")] == [3, 5]
    assert rows(tmp_path / "cut")[-1]["step"] == 4  # no training step after the signal
    monkeypatch.setattr(loop, "evaluate", evaluate)
    resumed = train(_disk_cfg(), tmp_path / "cut")
    timing = ("tokens_per_s", "wall_time_s", "eval_time_s", "resumed_from_step", "phases")
    assert [{k: v for k, v in r.items() if k not in timing} for r in rows(tmp_path / "cut")] == [
        {k: v for k, v in r.items() if k not in timing} for r in rows(tmp_path / "whole")]
    assert resumed["final_val_loss"] == whole["final_val_loss"]
