"""The real command, killed and signalled. SIGKILL after a checkpoint, then resume, must equal the
uninterrupted run. Under hydra-submitit-launcher, submitit's own preemption signal reaches normlab first,
normlab checkpoints, submitit's handler requeues the job, and the job resumes in the same dir to the same
result. (SIGTERM and SIGUSR1 take the same path: test_checkpoint.py sends them in-process.)"""

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_here import normlab_here
from wandb_log import finished_run_records, wandb_records

# Long enough (about a second of training) for the test to act while the run is in flight.
RUN = ["model=tiny", "batch_size=4", "seq_len=16", "max_steps=80", "eval_every=20", "eval_batches=2",
       "log_every=5", "ckpt.every=10", "progress=false", "device=cpu"]
NO_WANDB = "wandb.mode=disabled"  # where wandb is not under test: it costs each process about two seconds
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: bit-exact reductions, and no oversubscribed CPU


def start(run_dir, *extra, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "normlab", "train", *RUN, *extra, f"hydra.run.dir={run_dir}"],
        cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]


def comparable(rows_or_summary):
    drop = ("tokens_per_s", "train_time_s", "wall_time_s", "eval_time_s", "resumed_from_step", "phases", "segments")
    if isinstance(rows_or_summary, dict):
        return {k: v for k, v in rows_or_summary.items() if k not in drop}
    return [{k: v for k, v in r.items() if k not in drop} for r in rows_or_summary]


def checkpoints(run_dir):
    return sorted(int(p.stem.split("-")[1]) for p in (Path(run_dir) / "checkpoints").glob("step-*.pt"))


def wandb_histories(run_dir):
    """{offline-run dir name: [history steps]} read from the runs' .wandb files (LevelDB-style log of protobufs)."""
    histories = {}
    paths = sorted(glob.glob(str(Path(run_dir) / "wandb" / "offline-run-*" / "*.wandb")))
    for path in paths:  # only the last attempt finished; the ones before were killed
        records = finished_run_records(path) if path == paths[-1] else wandb_records(path)
        steps = [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"]
        histories[Path(path).parent.name] = steps
    return histories


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs: one SIGKILLed after its first checkpoint and then resumed (resume=auto, the default), and
    one uninterrupted."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {name: root / name for name in ("whole", "killed")}
    killed = start(dirs["killed"], "wandb.mode=offline", cwd=root)
    try:
        deadline = time.monotonic() + 300
        while not checkpoints(dirs["killed"]):
            assert killed.poll() is None, f"the run ended before its first checkpoint: {killed.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "timed out waiting for the first checkpoint"
            time.sleep(0.005)
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=60)
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    seen = {
        "killed_rc": killed.returncode,
        "killed_rows": rows(dirs["killed"]),
        "killed_checkpoints": checkpoints(dirs["killed"]),
        "killed_summary": (dirs["killed"] / "summary.json").exists(),
    }
    # The resumed and the uninterrupted run in this process: the kill is what needs a process of its own.
    for run_dir, wandb in ((dirs["killed"], "wandb.mode=offline"), (dirs["whole"], NO_WANDB)):
        done = normlab_here("train", *RUN, wandb, f"hydra.run.dir={run_dir}", cwd=root, env={"OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
    return dirs, seen


def test_sigkill_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(runs):
    dirs, seen = runs
    run_dir, uninterrupted = dirs["killed"], dirs["whole"]
    assert seen["killed_rc"] == -signal.SIGKILL and not seen["killed_summary"]
    [k] = seen["killed_checkpoints"]
    killed_rows = seen["killed_rows"]
    assert killed_rows[-1]["step"] < 80  # killed in flight

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == k and summary["status"] == "completed"
    got, want = rows(run_dir), rows(uninterrupted)
    steps = [r["step"] for r in got]
    assert steps == sorted(set(steps)) and steps[-1] == 80  # no step twice
    assert comparable([r for r in got if r["step"] >= k]) == comparable([r for r in want if r["step"] >= k])
    assert comparable(got) == comparable(want)
    assert summary["final_val_loss"] == json.loads((uninterrupted / "summary.json").read_text())["final_val_loss"]
    assert comparable(summary) == comparable(json.loads((uninterrupted / "summary.json").read_text()))

    # wandb: both attempts log to one run id. A killed process may never have handed its last rows to
    # wandb (here, offline, often none at all), so the resumed one replays the run's kept rows from
    # wandb's current step (0 offline); wandb keeps the first value it gets for a step, so merging the
    # attempts in order, as `wandb sync` does, gives every step once.
    histories = wandb_histories(run_dir)
    assert len(histories) == 2 and len({name.rsplit("-", 1)[1] for name in histories}) == 1
    first, second = histories.values()
    assert first == [r["step"] for r in killed_rows][: len(first)]
    assert second == steps
    merged = first + [s for s in second if not first or s > first[-1]]
    assert merged == steps


def _submitit_job_pid(folder: Path) -> int | None:
    """The process submitit's local controller runs the job in (`python -m submitit.core._submit <folder>/...`)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in cmdline and any(str(folder).encode() in part for part in cmdline):
            return int(proc.name)
    return None


def _usr2_once_it_logged(job_dir: Path, sweeps: Path, sent: list) -> None:
    """Sends the submitit job that trains in `job_dir` SIGUSR2 once it logged two rows; `sent` gets its pid,
    or the error that stopped it."""
    try:
        deadline = time.monotonic() + 300
        while not ((job_dir / "metrics.jsonl").exists() and len(rows(job_dir)) >= 2):
            assert time.monotonic() < deadline, "timed out waiting for the job's rows"
            time.sleep(0.005)
        pid = _submitit_job_pid(sweeps)
        os.kill(pid, signal.SIGUSR2)
        sent.append(pid)
    except BaseException as error:  # noqa: BLE001 - reported by the test
        sent.append(error)


def test_submitit_requeue_after_its_signal_resumes_in_the_same_dir(runs, tmp_path, monkeypatch, capsys):
    """hydra-submitit-launcher's local executor: its preemption signal (USR2) reaches normlab first; normlab
    checkpoints, then submitit's handler requeues the job, which reruns in the same dir and resumes. The
    launcher runs in this process (the job, signalled and requeued, runs in submitit's processes)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    dirs, _ = runs
    sweeps = tmp_path / "sweeps"
    job_dir = sweeps / "0_layer-pre-d2-lr3e-3-s0"
    sent = []
    signaller = threading.Thread(target=_usr2_once_it_logged, args=(job_dir, sweeps, sent), daemon=True)
    signaller.start()
    launcher = normlab_here("train", "-m", "hydra/launcher=submitit_local", *RUN, NO_WANDB, f"hydra.sweep.dir={sweeps}",
                            cwd=tmp_path)
    signaller.join(timeout=60)
    assert len(sent) == 1 and isinstance(sent[0], int), sent
    assert launcher.returncode in (0, None), launcher.stderr[-3000:]
    logs = "".join(p.read_text() for p in (sweeps / ".submitit").rglob("*_log.*"))
    assert "Requeued job" in logs
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and 0 < summary["resumed_from_step"] < 80
    assert sorted(p.name for p in sweeps.iterdir() if p.is_dir() and not p.name.startswith(".")) == [job_dir.name]
    assert comparable(rows(job_dir)) == comparable(rows(dirs["whole"]))
