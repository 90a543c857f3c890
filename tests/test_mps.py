"""NVIDIA MPS for sweeps (normlab.launch.mps): the daemon's command lines and environment, the fallback to plain
processes, and the clean-up, with a stand-in nvidia-cuda-mps-control on PATH (no GPU needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from normlab.launch import mps as mps_module
from normlab.launch.launcher import _pin_worker
from normlab.launch.mps import Mps, daemon_alive, daemon_dirs, running_daemon, sweep_mps, wants_mps

# A stand-in control program: `-d` starts a "daemon" (a sleeping process) whose control pipe and pid file are in
# $CUDA_MPS_PIPE_DIRECTORY, as the real one's are; "get_server_list" lists no server; "quit" on stdin ends it
# (unless FAKE_MPS_STUCK is set: a daemon that never lets go; after FAKE_MPS_QUIT_S seconds). Every call is logged with its arguments, stdin
# and the two MPS variables.
FAKE = textwrap.dedent("""\
    #!/usr/bin/env bash
    input=$(cat)
    echo "args=$* stdin=${input} pipe=${CUDA_MPS_PIPE_DIRECTORY} log=${CUDA_MPS_LOG_DIRECTORY}" >> "$FAKE_MPS_LOG"
    if [ "$1" = "-d" ]; then
        [ -n "$FAKE_MPS_REFUSE" ] && { echo "refused: $FAKE_MPS_REFUSE" >&2; exit 1; }
        mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"
        sleep 300 </dev/null >/dev/null 2>&1 &
        echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    elif [ "$input" = "quit" ] && [ -z "$FAKE_MPS_STUCK" ]; then
        sleep "${FAKE_MPS_QUIT_S:-0}"
        kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"
        rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    fi
""")


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """The stand-in on PATH; returns the log of its calls (a list of lines, read when called)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-cuda-mps-control").write_text(FAKE)
    (bin_dir / "nvidia-cuda-mps-control").chmod(0o755)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps_module, "DEFAULT_PIPE_DIR", tmp_path / "no-default-daemon")
    return lambda: log.read_text().splitlines() if log.exists() else []


def test_the_sweeps_own_daemon_runs_with_its_dirs_under_the_sweep_dir_and_stops_at_the_end(tmp_path, fake_control, monkeypatch):
    monkeypatch.setattr(mps_module, "client_check", lambda env: None)  # a client reaches the daemon
    monkeypatch.setattr(mps_module, "MAX_PIPE_DIR", 4096)  # pytest's tmp_path may be long (a long one: a test below)
    sweep = tmp_path / "s"
    with sweep_mps(sweep, wanted=True) as mps:
        pipe, logs = sweep.resolve() / ".mps" / "pipe", sweep.resolve() / ".mps" / "log"
        assert mps.active and mps.env == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
        assert daemon_alive(pipe) and logs.is_dir()
        assert mps.line.startswith("MPS: a control daemon for this sweep")
    assert not daemon_alive(pipe)
    assert fake_control() == [f"args=-d stdin= pipe={pipe} log={logs}", f"args= stdin=get_server_list pipe={pipe} log={logs}",
                              f"args= stdin=quit pipe={pipe} log={logs}"]


def test_the_daemon_stops_when_the_sweep_fails_or_is_interrupted(tmp_path, fake_control, monkeypatch):
    monkeypatch.setattr(mps_module, "client_check", lambda env: None)
    for error in (RuntimeError("a job's worker died"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with sweep_mps(tmp_path / type(error).__name__, wanted=True) as mps:
                pipe = mps.pipe_dir
                raise error
        assert not daemon_alive(pipe)
    assert [line.split(" ")[1] for line in fake_control()] == ["stdin=", "stdin=get_server_list", "stdin=quit"] * 2


def test_a_daemon_whose_client_cannot_connect_is_stopped_and_the_sweep_runs_plain(tmp_path, fake_control, monkeypatch):
    monkeypatch.setattr(mps_module, "client_check", lambda env: "cuInit returned CUDA error 805")
    with sweep_mps(tmp_path / "s", wanted=True) as mps:
        assert not mps.active and mps.env == {}
        assert mps.line == "MPS: could not start (cuInit returned CUDA error 805); the jobs share each GPU time-sliced"
    assert [line.split(" ")[1] for line in fake_control()] == ["stdin=", "stdin=get_server_list", "stdin=quit"]
    assert not daemon_alive(tmp_path / "s" / ".mps" / "pipe")


def test_the_client_check_itself_fails_without_a_cuda_driver(tmp_path, monkeypatch):
    """The real check (ctypes, libcuda): where no driver can be loaded it names why instead of passing."""
    if Path("/dev/nvidiactl").exists():
        pytest.skip("a CUDA driver is present here")
    why = mps_module.client_check({})
    assert why is not None and "libcuda" in why


def test_a_refused_start_or_no_control_program_falls_back_with_one_line(tmp_path, fake_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_REFUSE", "not supported on this system")
    with sweep_mps(tmp_path / "a", wanted=True) as mps:
        assert not mps.active and mps.line == ("MPS: could not start (refused: not supported on this system); "
                                               "the jobs share each GPU time-sliced")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with sweep_mps(tmp_path / "b", wanted=True) as mps:
        assert not mps.active
        assert mps.line == "MPS: nvidia-cuda-mps-control is not on PATH; the jobs share each GPU time-sliced"


def test_a_daemon_already_running_is_used_and_left_running(tmp_path, fake_control, monkeypatch):
    monkeypatch.setattr(mps_module, "client_check", lambda env: None)
    with sweep_mps(tmp_path / "first", wanted=True) as first:
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(first.pipe_dir))
        assert running_daemon() == first.pipe_dir
        with sweep_mps(tmp_path / "second", wanted=True) as second:
            assert second.env == {"CUDA_MPS_PIPE_DIRECTORY": str(first.pipe_dir)}
            assert second.line == f"MPS: the jobs use the control daemon already running ({first.pipe_dir})"
        assert daemon_alive(first.pipe_dir)  # the second sweep did not stop the first's daemon
        assert len(fake_control()) == 1


def test_a_long_sweep_dir_gets_a_short_temporary_pipe_dir_removed_at_the_end(tmp_path, fake_control, monkeypatch):
    monkeypatch.setattr(mps_module, "client_check", lambda env: None)
    sweep = tmp_path / ("x" * 90)
    pipe, logs, temporary = daemon_dirs(sweep)
    assert temporary and len(str(pipe)) <= mps_module.MAX_PIPE_DIR and logs == sweep.resolve() / ".mps" / "log"
    pipe.rmdir()
    with sweep_mps(sweep, wanted=True) as mps:
        assert mps.active and len(mps.env["CUDA_MPS_PIPE_DIRECTORY"]) <= mps_module.MAX_PIPE_DIR
        made = mps.pipe_dir
    assert not made.exists()


def test_not_wanted_means_no_daemon(tmp_path, fake_control):
    with sweep_mps(tmp_path / "s", wanted=False) as mps:
        assert mps == Mps() and not mps.active
    assert fake_control() == [] and not (tmp_path / "s").exists()


def test_a_daemon_that_does_not_quit_is_killed(tmp_path, fake_control, monkeypatch):
    monkeypatch.setattr(mps_module, "client_check", lambda env: None)
    monkeypatch.setenv("FAKE_MPS_STUCK", "1")
    mps = mps_module.start_daemon(tmp_path / "s")
    pid = int((mps.pipe_dir / "nvidia-cuda-mps-control.pid").read_text())
    mps.stop(timeout=0.3)

    def state() -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "gone"

    deadline = time.monotonic() + 5
    while state() not in ("Z", "gone") and time.monotonic() < deadline:  # SIGKILL lands when it is next scheduled
        time.sleep(0.01)
    assert state() in ("Z", "gone")  # killed (a zombie until its new parent reaps it)


def test_which_sweeps_want_mps():
    assert wants_mps(True, ["0", "0"]) and wants_mps("true", ["1", "1"]) and wants_mps("true", ["0", "1", "0", "1"])
    assert not wants_mps("true", ["0"]) and not wants_mps("true", ["0", "1"])  # one job on each GPU: nothing to share
    assert not wants_mps("true", [None, None])  # the CPU's slots
    # auto: no daemon, eager or CUDA graphs, until a GPU run shows a sweep's daemon stopped by SIGTERM (docs/speed.md)
    assert not wants_mps("auto", ["0", "0"]) and not wants_mps(False, ["0", "0"]) and not wants_mps("false", ["0", "0"])
    with pytest.raises(ValueError, match="hydra.launcher.mps='sometimes': must be auto, true or false"):
        wants_mps("sometimes", ["0", "0"])


def test_a_worker_gets_the_daemons_environment_before_torch(monkeypatch):
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NORMLAB_WORKER_MEMORY_FRACTION"):
        monkeypatch.setenv(key, "")  # recorded, so the test's end puts back what was there (or removes it)
        monkeypatch.delenv(key)
    _pin_worker("1", 3, 0.25, {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/p"})
    assert (os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_VISIBLE_DEVICES"], os.environ["OMP_NUM_THREADS"]) == \
        ("/tmp/p", "1", "3")



# A launching process in short: a block under sweep_mps that waits for its jobs as the launcher does
# (concurrent.futures.wait, here on a future never done), with the stand-in's daemon counted as reaching a client.
LAUNCHING = """
import concurrent.futures, signal, sys
from pathlib import Path
from normlab.launch import mps
mps.client_check, mps.DEFAULT_PIPE_DIR, mps.MAX_PIPE_DIR = (lambda env: None), Path(sys.argv[2]), 4096
with mps.sweep_mps(Path(sys.argv[1]), wanted=sys.argv[3] == "wanted") as used:
    print(used.pipe_dir, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    concurrent.futures.wait([concurrent.futures.Future()])
print("the block ended", flush=True)
"""


def _launching(tmp_path, wanted: str) -> tuple[subprocess.Popen, str, bool]:
    """LAUNCHING started, with the pipe dir of its own daemon ("None" for none) and whether SIGTERM's handler is
    still the default one within its block."""
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHING, str(tmp_path / "s"), str(tmp_path / "no-default"), wanted],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    pipe, default = proc.stdout.readline().split()
    return proc, pipe, default == "True"


def _ended(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        return proc.wait(timeout=30), proc.stdout.read()
    finally:
        proc.kill()
        proc.stdout.close()


@pytest.mark.parametrize("again", [False, True])
def test_sigterm_stops_the_sweeps_own_daemon_then_ends_the_process_by_sigterm(tmp_path, fake_control, monkeypatch, again):
    """SIGTERM's default action would end the launching process with no clean-up, its daemon left running. Under
    its own daemon, SIGTERM interrupts the wait for the jobs, the daemon quits, and the process ends by SIGTERM; a
    second SIGTERM while the daemon quits does not cut its stop short."""
    monkeypatch.setenv("FAKE_MPS_QUIT_S", "1" if again else "0")
    proc, pipe, default = _launching(tmp_path, "wanted")
    daemon = int((Path(pipe) / "nvidia-cuda-mps-control.pid").read_text())
    try:
        assert not default and daemon_alive(Path(pipe))
        proc.send_signal(signal.SIGTERM)
        if again:
            deadline = time.monotonic() + 20
            while not any("stdin=quit" in line for line in fake_control()) and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)  # within the stand-in's quit, which takes 1 s
        returncode, output = _ended(proc)
        assert returncode == -signal.SIGTERM and "the block ended" not in output
        assert [line.split(" ")[1] for line in fake_control()] == ["stdin=", "stdin=get_server_list", "stdin=quit"]
        assert not daemon_alive(Path(pipe))
    finally:
        if daemon_alive(Path(pipe)):  # left running (the failure this test looks for)
            os.kill(daemon, signal.SIGKILL)


def test_a_sweep_without_a_daemon_of_its_own_keeps_sigterms_default_action(tmp_path, fake_control, monkeypatch):
    proc, pipe, default = _launching(tmp_path, "not wanted")
    assert pipe == "None" and default
    proc.send_signal(signal.SIGTERM)
    assert _ended(proc) == (-signal.SIGTERM, "") and fake_control() == []
    monkeypatch.setattr(mps_module, "client_check", lambda env: None)
    with sweep_mps(tmp_path / "first", wanted=True) as first:  # the handler is installed only around its block
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(first.pipe_dir))
        with sweep_mps(tmp_path / "second", wanted=True) as second:  # a daemon already running: the handler as before
            assert second.pipe_dir is None and signal.getsignal(signal.SIGTERM) is mps_module.sigterm._handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.setenv("FAKE_MPS_REFUSE", "no")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    with sweep_mps(tmp_path / "refused", wanted=True) as refused:  # plain processes: the default action
        assert not refused.active and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
