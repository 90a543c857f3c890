"""The real command, killed and signalled: SIGKILL after a checkpoint, then resume, must equal the
uninterrupted run; SIGUSR1 with a handler already installed (as submitit installs one) checkpoints and
then runs that handler. SIGTERM takes the same path, tested in-process in test_checkpoint.py."""

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Long enough (about a second of training) for the test to act while the run is in flight.
RUN = ["model=tiny", "batch_size=4", "seq_len=16", "max_steps=80", "eval_every=20", "eval_batches=2",
       "log_every=5", "ckpt.every=10", "progress=false"]
NO_WANDB = "wandb.mode=disabled"  # where wandb is not under test: it costs each process about two seconds
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: bit-exact reductions, and no oversubscribed CPU


def start(run_dir, *extra, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "normlab", "train", *RUN, *extra, f"hydra.run.dir={run_dir}"],
        cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]


def comparable(rows_or_summary):
    drop = ("tokens_per_s", "wall_time_s", "resumed_from_step")
    if isinstance(rows_or_summary, dict):
        return {k: v for k, v in rows_or_summary.items() if k not in drop}
    return [{k: v for k, v in r.items() if k not in drop} for r in rows_or_summary]


def checkpoints(run_dir):
    return sorted(int(p.stem.split("-")[1]) for p in (Path(run_dir) / "checkpoints").glob("step-*.pt"))


def wandb_histories(run_dir):
    """{offline-run dir name: [history steps]} read from the runs' .wandb files (LevelDB-style log of protobufs)."""
    from wandb.proto import wandb_internal_pb2

    histories = {}
    for path in sorted(glob.glob(str(Path(run_dir) / "wandb" / "offline-run-*" / "*.wandb"))):
        data, pos, pending, steps = Path(path).read_bytes(), 7, b"", []
        while pos + 7 <= len(data):
            room = 32768 - pos % 32768
            if room < 7:
                pos += room
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0 and length == 0:
                pos += room
                continue
            pending += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last fragment of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    steps.append(record.history.step.num)
        histories[Path(path).parent.name] = steps
    return histories


WRAPPER = """
import json, pathlib, signal, sys
def requeue(signum, frame):  # stands in for submitit's handler: it looks at what normlab saved first
    saw = sorted(p.name for p in pathlib.Path(sys.argv[-1].split("=", 1)[1], "checkpoints").glob("step-*.pt"))
    pathlib.Path(sys.argv[-1].split("=", 1)[1] + ".handler.json").write_text(json.dumps(saw))
    sys.exit(42)
signal.signal(signal.SIGUSR1, requeue)
from normlab.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs side by side: uninterrupted; SIGKILLed after its first checkpoint, then resumed
    (resume=auto, the default); sent SIGUSR1 with a previous handler installed."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {name: root / name for name in ("whole", "killed", "signalled")}
    whole = start(dirs["whole"], NO_WANDB, cwd=root)
    killed = start(dirs["killed"], "wandb.mode=offline", cwd=root)
    signalled = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, "train", *RUN, NO_WANDB, f"hydra.run.dir={dirs['signalled']}"],
        cwd=root, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        seen = {}
        metrics = dirs["signalled"] / "metrics.jsonl"
        # Act on each run as soon as it is ready: SIGKILL after the first checkpoint, SIGUSR1 mid-training.
        triggers = {
            killed: (lambda: checkpoints(dirs["killed"]), signal.SIGKILL),
            signalled: (lambda: metrics.exists() and len(rows(dirs["signalled"])) >= 2, signal.SIGUSR1),
        }
        deadline = time.monotonic() + 300
        while triggers:
            for proc, (ready, signum) in list(triggers.items()):
                assert proc.poll() is None, f"a run ended before it was interrupted: {proc.stderr.read()[-2000:]}"
                if ready():
                    proc.send_signal(signum)
                    del triggers[proc]
            assert time.monotonic() < deadline, "timed out waiting for the runs to train"
            time.sleep(0.005)
        killed.communicate(timeout=60)
        seen["killed_rc"], seen["killed_rows"] = killed.returncode, rows(dirs["killed"])
        seen["killed_checkpoints"] = checkpoints(dirs["killed"])
        seen["killed_summary"] = (dirs["killed"] / "summary.json").exists()

        _, err = signalled.communicate(timeout=120)
        assert signalled.returncode == 42, err[-2000:]
        seen["signalled_summary"] = json.loads((dirs["signalled"] / "summary.json").read_text())
        seen["signalled_rows"] = rows(dirs["signalled"])
        seen["signalled_checkpoints"] = checkpoints(dirs["signalled"])
        seen["handler_saw"] = json.loads(Path(str(dirs["signalled"]) + ".handler.json").read_text())

        resumed = start(dirs["killed"], "wandb.mode=offline", cwd=root)
        for proc in (whole, resumed):
            finish(proc)
    finally:
        for proc in (whole, killed, signalled):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
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


def test_sigusr1_checkpoints_then_runs_the_previous_handler(runs):
    """A launcher's own handler (submitit's requeue) still runs, after normlab's checkpoint is on disk.
    (Resuming after a signal is exact: test_checkpoint.py, in-process, for SIGTERM and SIGUSR1.)"""
    dirs, seen = runs
    summary = seen["signalled_summary"]
    assert summary["status"] == "preempted"
    step = summary["preempted_step"]
    assert seen["handler_saw"][-1] == f"step-{step:06d}.pt"
    assert seen["signalled_checkpoints"][-1] == step
    assert [r["step"] for r in seen["signalled_rows"]] == [r["step"] for r in rows(dirs["whole"]) if r["step"] < step]
