"""normlab on a real SLURM cluster: one node, brought up on this machine by scripts/slurm_cluster.sh.

The sweeps go through the real `normlab` command and `hydra/launcher=slurm_cpu`, so sbatch, srun,
SLURM's signals and requeue, and submitit's result files are the cluster's own. Needs root and
Debian's `slurm-wlm` and `munge`; without them every test here skips, with one line saying why.
Select or leave out the cluster's tests with `-m slurm` / `-m "not slurm"`.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from normlab.train.checkpoint import list_checkpoints
from normlab.launch import slurm
from normlab.launch.slurm import refusal_message, refusal_reason
from cli_here import normlab_here

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "slurm_cluster.sh"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: bit-exact reductions, so SLURM's runs equal local ones
TINY = ["model=tiny", "batch_size=4", "seq_len=16", "eval_batches=2", "progress=false", "wandb.mode=disabled", "device=cpu"]
SHORT = [*TINY, "max_steps=6", "eval_every=3", "log_every=1"]
# Long enough (several seconds) for the test to signal the job while it trains.
LONG = [*TINY, "max_steps=800", "eval_every=400", "log_every=50", "ckpt.every=50"]
DROP = ("tokens_per_s", "wall_time_s", "eval_time_s", "resumed_from_step", "preempted_step", "phases", "segments")
# One cluster on this machine: under pytest-xdist every test here runs in the same worker.
pytestmark = pytest.mark.xdist_group("slurm")


@pytest.fixture(scope="module")
def cluster():
    """The one-node cluster, up (the script keeps daemons that already run)."""
    if os.geteuid() != 0:
        pytest.skip("SLURM tests need root (they start munged, slurmctld and slurmd)")
    if shutil.which("sbatch") is None or not Path("/usr/sbin/slurmctld").exists():
        pytest.skip("SLURM tests need Debian's packages: apt-get install -y slurm-wlm munge")
    up = subprocess.run(["bash", str(CLUSTER)], capture_output=True, text=True, timeout=120)
    if up.returncode == 3:
        pytest.skip(up.stderr.strip())
    assert up.returncode == 0, up.stderr


def normlab(*args, cwd):
    return subprocess.Popen([sys.executable, "-m", "normlab", "train", *args], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def here(*args, cwd):
    """`normlab train ARGS` through normlab.cli.main in this process (test_cli.normlab_here), for what needs no
    process of its own: the local references (with the `one_thread` fixture, as ENV's one thread) and the
    refusals before sbatch, the two-task job's submission. A subprocess would pay the command's start-up (seconds
    of CPU) again."""
    return normlab_here("train", *args, cwd=cwd, env={"OMP_NUM_THREADS": "1"})


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return err


def rows(run_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in DROP} for line in (Path(run_dir) / "metrics.jsonl").open()]


def summary(run_dir):
    return json.loads((Path(run_dir) / "summary.json").read_text())


def job_dirs(sweep):
    return sorted(p for p in Path(sweep).iterdir() if p.is_dir() and not p.name.startswith("."))


def job_logs(sweep, task):
    """stdout and stderr of the sweep's job `task` (submitit's .submitit/<array>_<task>/ files)."""
    return "".join(p.read_text() for p in Path(sweep, ".submitit").glob(f"*_{task}/*_log.*"))


def world_size_of(state):
    """The `world_size` a checkpoint records, wherever it sits in the saved dict."""
    if isinstance(state, dict):
        if "world_size" in state:
            return state["world_size"]
        found = [w for v in state.values() if (w := world_size_of(v)) is not None]
        return found[0] if found else None
    return None


def release_held_jobs():
    """SLURM holds a requeued job about two minutes before it may start again: let it start now."""
    held = subprocess.run(["squeue", "-h", "-t", "PD", "-o", "%A"], capture_output=True, text=True).stdout.split()
    for job in held:
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], capture_output=True)


@pytest.mark.slurm
def test_sweep_on_slurm_equals_the_local_sweep(cluster, tmp_path, one_thread):
    on_slurm = normlab("-m", "hydra/launcher=slurm_cpu", *SHORT, "lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path / 'slurm'}",
                       cwd=tmp_path)
    local = here("-m", *SHORT, "lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path / 'local'}", cwd=tmp_path)  # while SLURM runs
    assert local.returncode == 0, local.stderr[-3000:]
    err = finish(on_slurm)
    # Accounting is off on this cluster: no sacct noise, one line saying so.
    assert "sacct" not in err and "accounting storage" not in err
    assert err.count("SLURM accounting is disabled") == 1
    slurm_jobs, local_jobs = job_dirs(tmp_path / "slurm"), job_dirs(tmp_path / "local")
    assert [p.name for p in slurm_jobs] == [p.name for p in local_jobs] == ["0_layer-pre-d2-lr1e-3-s0", "1_layer-pre-d2-lr3e-3-s0"]
    for task, (s, l) in enumerate(zip(slurm_jobs, local_jobs)):
        assert "Job completed successfully" in job_logs(tmp_path / "slurm", task)  # submitit ran it on the cluster
        assert summary(s)["status"] == "completed"
        assert rows(s) == rows(l)
        assert summary(s)["final_val_loss"] == summary(l)["final_val_loss"]
    assert summary(slurm_jobs[0])["final_val_loss"] != summary(slurm_jobs[1])["final_val_loss"]


@pytest.mark.slurm
@pytest.mark.parametrize("launcher, reason, key", [
    (["hydra/launcher=slurm"], "Invalid generic resource (gres) specification", "hydra.launcher.gpus_per_node=0"),
    (["hydra/launcher=slurm_cpu", "hydra.launcher.partition=gpu"], "invalid partition specified: gpu",
     "hydra.launcher.partition=cpu"),
])
def test_a_preset_the_cluster_refuses_is_one_line_and_nothing_is_queued(cluster, tmp_path, launcher, reason, key):
    before = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout.split()
    refused = here("-m", *launcher, *SHORT, "lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert refused.returncode == 2
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("normlab: error: SLURM refused the job: ") and reason in line and key in line
    assert not (tmp_path / "sweep").exists()
    after = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout.split()
    assert set(after) <= set(before)  # no new job (earlier tests' jobs may still be leaving the queue)


@pytest.mark.slurm
def test_preempted_job_resumes_after_requeue_and_a_bad_job_fails_alone(cluster, tmp_path, one_thread):
    """Job 0 gets submitit's preemption signal (USR2, what SLURM sends `signal_delay_s` before the time
    limit) through the scheduler, checkpoints, is requeued by submitit and resumes in its dir, to the
    uninterrupted run's result. Job 1's corpus file is missing: it fails with normlab's one line, alone."""
    sweep = tmp_path / "sweep"
    corpus = tmp_path / "corpus.txt"  # some of the standard library's sources: data.files needs data=text
    corpus.write_text("".join(p.read_text() for p in sorted(Path(os.__file__).parent.glob("[a-c]*.py"))))
    on_slurm = normlab("-m", "hydra/launcher=slurm_cpu", *LONG, "data=text", f"data.files=[{corpus}],[/nonexistent/corpus.txt]",
                       f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    job = sweep / "0_layer-pre-d2-lr3e-3-s0"
    deadline = time.monotonic() + 240
    while not ((job / "metrics.jsonl").exists() and len(rows(job)) >= 3):
        assert on_slurm.poll() is None and time.monotonic() < deadline, on_slurm.stderr.read()[-2000:]
        time.sleep(0.05)
    [array] = {p.name.split("_")[0] for p in (sweep / ".submitit").glob("*_0")}
    subprocess.run(["scancel", "--signal=USR2", f"{array}_0"], check=True)
    # The uninterrupted run, in this process while SLURM checkpoints and requeues the job (not before the
    # signal: the job could end first).
    whole = here(*LONG, "data=text", f"data.files=[{corpus}]", f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    while on_slurm.poll() is None:
        assert time.monotonic() < deadline + 120, "the sweep did not end"
        release_held_jobs()
        time.sleep(0.5)
    err = finish(on_slurm)

    logs = job_logs(sweep, 0)
    assert "Requeued job" in logs and "stopped by SIGUSR2 after the checkpoint of step" in logs
    resumed, uninterrupted = summary(job), summary(tmp_path / "whole")
    assert resumed["status"] == "completed" and 0 < resumed["resumed_from_step"] < 800
    steps = [r["step"] for r in rows(job)]
    assert steps == sorted(set(steps))  # no step twice
    assert rows(job) == rows(tmp_path / "whole")
    assert resumed["final_val_loss"] == uninterrupted["final_val_loss"]

    # A data error is that job's failure, on one line and in its summary.json.
    assert "failed: DataError: data.files: /nonexistent/corpus.txt does not exist" in job_logs(sweep, 1)
    assert summary(sweep / "1_layer-pre-d2-lr3e-3-s0")["status"] == "failed"
    assert "Traceback" not in err


@pytest.mark.slurm
def test_one_job_of_two_tasks_trains_with_ddp_like_torchrun(cluster, tmp_path, one_thread):
    """hydra.launcher.tasks_per_node=2: SLURM starts two tasks of one job; normlab joins them into one
    process group (gloo here) from SLURM's variables, as torchrun's two processes would join."""
    # Submitted from this process too: the job's two tasks are SLURM's processes, and nothing here waits on the
    # submitting one (the sweep test keeps a submitting process: it counts its sacct line, said once a process).
    on_slurm = here("-m", "hydra/launcher=slurm_cpu", "hydra.launcher.tasks_per_node=2", *SHORT, "batch_size=8",
                    f"hydra.sweep.dir={tmp_path / 'slurm'}", cwd=tmp_path)
    assert on_slurm.returncode == 0, on_slurm.stderr[-3000:]
    one = here(*SHORT, "batch_size=8", f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    [job] = job_dirs(tmp_path / "slurm")
    # One process group of two: rank 0 alone wrote the rows (two lone processes would write each step twice),
    # and the checkpoint records a world of 2.
    got, want = rows(job), rows(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    [(_, last)] = list_checkpoints(job)
    assert world_size_of(torch.load(last, weights_only=True)) == 2
    # Two processes sum the gradients in another order than one: equal within fp32 rounding (README).
    compared = [(a[k], b[k]) for a, b in zip(got, want) for k in ("loss", "val_loss") if k in a]
    assert len(compared) >= 6 and all(math.isclose(x, y, rel_tol=1e-4) for x, y in compared)
    assert len(list((tmp_path / "slurm" / ".submitit").rglob("*_1_log.out"))) == 1  # task 1's log: two tasks ran


def test_sbatch_refusals_name_the_launcher_key_to_change(monkeypatch):
    # As where sinfo does not answer: an installed sinfo without a controller takes 10 s a call to time out.
    monkeypatch.setattr(slurm, "_sinfo", lambda fields: [])
    gres = "sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification\n"
    assert refusal_reason(gres) == "Invalid generic resource (gres) specification"
    assert refusal_reason("Submitted batch job 12\n") is None
    assert refusal_message(refusal_reason(gres)).endswith(
        ": set hydra.launcher.gpus_per_node=0 (e.g. hydra/launcher=slurm_cpu for a CPU partition)")
    account = refusal_message("Invalid account or account/partition combination specified")
    assert "set hydra.launcher.account=" in account and "partition=" not in account.split("set ")[1]
    assert "set hydra.launcher.timeout_min=" in refusal_message("Requested time limit is invalid (missing or exceeds some limit)")
