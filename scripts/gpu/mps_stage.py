"""Does a sweep under NVIDIA MPS end when SIGTERM stops it? On an H100 one did not, for about 170 s, and what held it
was not found; so hydra.launcher.mps=auto starts no daemon (docs/speed.md). This stage runs such a sweep
(hydra.launcher.mps=true, the 8-arm medium sweep at 4 jobs on the GPU, eager, as there) and stops it mid-training
with SIGTERM to its process group, as `timeout` stops a command. It times the end the way a shell sees it: until the
sweep's output closes, that is, until every process holding it (the launching process, its workers, whatever they
started) has ended. Then whether the sweep's own MPS daemon was left running. Where the output is still open after
WAIT seconds, mps-sigterm.txt beside the JSON names each process still holding it (command line, state, where it
waits, its kernel stack where readable) before the stage ends them all. With smoke: two jobs at once on the CPU
(hydra.launcher.cpu_jobs=2), where no daemon can start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from gpu_stage import Context, normlab_env

SWEEP = {"norm": "none,layer,rms,batch", "placement": "pre,post", "model": "medium", "max_steps": 100000,
         "hydra.launcher.jobs_per_gpu": 4, "hydra.launcher.mps": "true"}
SMOKE = {"norm": "layer,rms", "placement": "pre", "max_steps": 100000, "hydra.launcher.cpu_jobs": 2}
WAIT = 45  # seconds after the SIGTERM before the processes still holding the output are named and killed


def mps_sigterm(ctx: Context) -> None:
    from startup import normlab_command

    sweep_dir, out = ctx.workdir / "sweep", ctx.out / "mps-sigterm.txt"
    overrides = ctx.run_overrides(SWEEP, smoke=SMOKE)
    command = f"normlab train -m {' '.join(overrides)}; SIGTERM to its process group once {running_target(ctx)} jobs log"
    read, write = os.pipe()
    proc = subprocess.Popen([*normlab_command(), "train", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
                            stdout=write, stderr=write, env=normlab_env(ctx), start_new_session=True)
    os.close(write)
    closed = threading.Event()
    output: list[bytes] = []
    holders: list[dict] = []
    threading.Thread(target=drain, args=(read, output, closed), daemon=True).start()
    # The sweep is in a session of its own (so that the signal below reaches it alone): a stop of this stage must
    # end it too.
    signal.signal(signal.SIGTERM, lambda signum, frame: (kill_session(proc.pid), os._exit(128 + signum)))
    try:
        running = wait_for_training(sweep_dir, running_target(ctx), ctx.timeout(WAIT + 10) or 300, proc)
        if proc.poll() is not None:
            raise RuntimeError(f"the sweep ended (exit code {proc.returncode}) before it was stopped: "
                               + b"".join(output).decode(errors="replace")[-300:])
        before = session_processes(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        stopped = time.monotonic()
        ended = closed.wait(WAIT)
        seconds = time.monotonic() - stopped
        holders[:] = [] if ended else pipe_holders(read)
        daemon = own_daemon(sweep_dir)
        text = b"".join(output).decode(errors="replace")
        out.write_text(describe(running, before, proc.poll(), seconds if ended else None, holders, daemon, text))
        mps_line = next((line for line in text.splitlines() if "MPS:" in line), "no MPS line (no daemon asked for)")
        detail = (f"{running} jobs training when stopped; launching process exit code {proc.poll()}; "
                  f"{mps_line.split('MPS:', 1)[-1].strip()}; " + (f"output closed after {seconds:.1f} s" if ended else
                  f"output still open after {WAIT} s, held by {len(holders)} processes: "
                  + ", ".join(sorted({h['comm'] for h in holders})) + f" (details: {out.name})"))
        ctx.report("mps_sigterm_exit_s", round(seconds, 2) if ended else None, detail, None, command)
        ctx.report("mps_daemon_left", daemon is not None and alive(daemon),
                   f"the sweep's own daemon: {'none started' if daemon is None else f'pid {daemon}'}", None, command)
    finally:
        kill_session(proc.pid)
        for holder in holders:  # a process that left the session (a daemon of its own) and still held the output
            kill(holder["pid"])
        stop_daemon(sweep_dir)


def running_target(ctx: Context) -> int:
    return 2 if ctx.smoke else 4


def drain(fd: int, output: list[bytes], closed: threading.Event) -> None:
    """Read `fd` to its end (every writer closed it), then set `closed`."""
    while chunk := os.read(fd, 65536):
        output.append(chunk)
    closed.set()


def wait_for_training(sweep_dir: Path, jobs: int, timeout: float, proc: subprocess.Popen) -> int:
    """Wait until `jobs` runs have logged a training step past their first (or `timeout`, or the sweep's end);
    return how many had."""
    deadline = time.monotonic() + timeout
    while True:
        running = sum(1 for path in sweep_dir.glob("*/metrics.jsonl") if len(path.read_bytes().splitlines()) >= 2)
        if running >= jobs or time.monotonic() > deadline or proc.poll() is not None:
            return running
        time.sleep(0.2)


def read_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command's name, which may hold spaces: state, ppid, pgrp, session, ..."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def session_processes(session: int) -> list[dict]:
    """The processes of `session`: pid, command name, state."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            fields = read_stat(pid)
            if int(fields[3]) == session:
                found.append({"pid": pid, "comm": Path(f"/proc/{pid}/comm").read_text().strip(), "state": fields[0]})
        except (OSError, ValueError, IndexError):
            continue
    return found


def pipe_holders(fd: int) -> list[dict]:
    """Every process with the write end of `fd`'s pipe open: pid, command name and line, state, parent, session,
    where it waits (wchan), and its kernel stack where this user may read it."""
    inode = f"pipe:[{os.fstat(fd).st_ino}]"
    holders = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            if not any(os.readlink(f"/proc/{pid}/fd/{f}") == inode for f in os.listdir(f"/proc/{pid}/fd")):
                continue
            fields = read_stat(pid)
            holders.append({"pid": pid, "comm": Path(f"/proc/{pid}/comm").read_text().strip(), "state": fields[0],
                            "ppid": fields[1], "session": fields[3],
                            "cmdline": Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:300],
                            "wchan": readable(f"/proc/{pid}/wchan"), "stack": readable(f"/proc/{pid}/stack")})
        except (OSError, ValueError, IndexError):
            continue
    return holders


def readable(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as err:
        return f"({err.strerror})"


def own_daemon(sweep_dir: Path) -> int | None:
    """The pid of the control daemon the sweep started for itself, None if it started none."""
    from normlab.launch.mps import daemon_dirs

    pid_file = daemon_dirs(sweep_dir)[0] / "nvidia-cuda-mps-control.pid"
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def kill_session(session: int) -> None:
    for process in session_processes(session):
        kill(process["pid"])


def stop_daemon(sweep_dir: Path) -> None:
    """A daemon the sweep left running, quit (its servers with it), so that the stages after run without it."""
    from normlab.launch.mps import Mps, daemon_dirs, daemon_alive

    pipe, logs, _ = daemon_dirs(sweep_dir)
    if daemon_alive(pipe):
        Mps(env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}, pipe_dir=pipe).stop()


def describe(running: int, before: list[dict], code: int | None, seconds: float | None, holders: list[dict],
             daemon: int | None, output: str) -> str:
    lines = [f"{running} jobs training when the sweep's process group got SIGTERM; its session's processes then:",
             *(f"  {p['pid']} {p['comm']} {p['state']}" for p in before),
             f"launching process exit code: {code}",
             f"output closed after {seconds:.1f} s" if seconds is not None else f"output still open after {WAIT} s, held by:"]
    for h in holders:
        lines += [f"  pid {h['pid']} ({h['comm']}, state {h['state']}, parent {h['ppid']}, session {h['session']}): "
                  f"{h['cmdline']}", f"    wchan: {h['wchan']}", *(f"    {line}" for line in h["stack"].splitlines())]
    lines += [f"the sweep's own MPS daemon: {'none' if daemon is None else f'pid {daemon}, alive {alive(daemon)}'}",
              "", "the sweep's output:", output[-20000:]]
    return "\n".join(lines) + "\n"
