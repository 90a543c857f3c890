"""A CPU slot's worker: forked from the forkserver that imported the jobs' modules once (normlab.launch.preload),
with the launching process's environment as it was when the worker started; a GPU slot's is spawned."""

import os
import sys

import pytest

import normlab.launch.workers as workers
from normlab.launch.workers import Workers, start_early, start_method

pytestmark = pytest.mark.skipif("forkserver" not in __import__("multiprocessing").get_all_start_methods(),
                                reason="no forkserver on this platform")


def _state():
    return ("normlab.launch.preload" in sys.modules, "torch._dynamo" in sys.modules,
            os.environ.get("NORMLAB_TEST_SET"), os.environ.get("NORMLAB_TEST_GONE"), os.environ["OMP_NUM_THREADS"])


def test_a_cpu_worker_is_forked_with_the_jobs_modules_imported_and_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("NORMLAB_TEST_GONE", "1")
    workers.start_server()  # as `normlab train -m ... hydra.launcher.cpu_jobs=2` starts it, with this environment
    monkeypatch.setenv("NORMLAB_TEST_SET", "later")  # changed after the forkserver started: a worker sees it
    monkeypatch.delenv("NORMLAB_TEST_GONE")
    pool = Workers([None], threads=1, fraction=1.0, warm=False)
    try:
        # No warm-up ran: what the worker holds, it holds from the forkserver.
        assert pool[0].submit(_state).result(timeout=120) == (True, True, "later", None, "1")
    finally:
        pool.shutdown()


def _write_both():
    os.write(1, b"out from the worker\n")
    os.write(2, b"err from the worker\n")


def test_a_cpu_workers_output_goes_where_the_launchers_goes_when_the_worker_starts(tmp_path):
    workers.start_server()  # its stdout and stderr: this process's now
    saved = os.dup(1), os.dup(2)
    out, err = (os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT) for name in ("out", "err"))
    try:
        os.dup2(out, 1)  # as a command run in this process (a test, a notebook) has its output captured
        os.dup2(err, 2)
        pool = Workers([None], threads=1, fraction=1.0, warm=False)
        try:
            pool[0].submit(_write_both).result(timeout=120)
        finally:
            pool.shutdown()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, out, err):
            os.close(fd)
    assert (tmp_path / "out").read_text() == "out from the worker\n"
    assert (tmp_path / "err").read_text() == "err from the worker\n"


def test_gpu_workers_are_spawned_and_cpu_workers_forked():
    assert start_method("0") == "spawn"  # CUDA state is never forked
    assert start_method(None) == "forkserver"


@pytest.mark.parametrize("multirun, overrides, starts", [
    (True, ["seed=0,1", "hydra.launcher.cpu_jobs=2"], True),
    (True, ["hydra.launcher.cpu_jobs=4", "hydra.launcher.cpu_jobs=1"], False),  # the last one counts
    (True, ["seed=0,1"], False),  # one job at a time, in the launching process: no workers
    (False, ["hydra.launcher.cpu_jobs=2"], False),
    (True, ["hydra.launcher.cpu_jobs=${oc.env:N}"], False),  # not a number on the command line: at set-up
])
def test_the_forkserver_starts_early_only_for_a_sweep_asking_for_several_cpu_jobs(monkeypatch, multirun, overrides,
                                                                                     starts):
    started = []
    monkeypatch.setattr(workers, "start_server", lambda: started.append(True))
    monkeypatch.setattr(workers.Path, "exists", lambda self: False)  # a machine without an NVIDIA driver
    assert start_early(multirun, overrides) is starts
    assert started == ([True] if starts else [])
    monkeypatch.setattr(workers.Path, "exists", lambda self: str(self) == "/proc/driver/nvidia/gpus")
    assert start_early(multirun, overrides) is False  # a GPU machine: its slots' workers are spawned



CLOSED_STDOUT = """
import sys
from normlab.launch.workers import Workers
pool = Workers([None], threads=1, fraction=1.0, warm=False)
try:
    print(pool[0].submit(print, "from the worker").result(timeout=120), file=sys.stderr)
finally:
    pool.shutdown()
"""


def test_a_launcher_started_without_stdout_hands_its_workers_none(tmp_path):
    """Started with stdout closed, the launching process's fd 1 may since name one of its own pipes: a forked worker
    must not take it as its stdout (its lines then failed, or went into that pipe)."""
    import subprocess

    done = subprocess.run(["bash", "-c", f'{sys.executable} -c "$0" >&-', CLOSED_STDOUT], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == "None" and "Error" not in done.stderr, done.stderr[-2000:]
