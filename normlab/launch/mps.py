"""NVIDIA MPS for a sweep: one control daemon, so that the jobs sharing a GPU run their kernels side by side.

Processes that share a GPU without MPS are time-sliced: the GPU runs one process's kernels at a time, so
several small, launch-bound jobs hardly overlap. Under the Multi-Process Service their kernels share the
GPU's multiprocessors at once. For a sweep that asks for it (hydra.launcher.mps=true; see MPS for auto),
`sweep_mps` starts a control daemon of the sweep's own (its pipe and log dirs under the sweep dir), hands the
workers the environment that points them to it, and stops it when the sweep ends, on Ctrl-C or a failure too.
While it owns such a daemon, SIGTERM unwinds the launching process instead of ending it outright
(normlab.launch.sigterm): the jobs running stop at their checkpoint (the launcher sends them SIGTERM, since
`kill PID` reaches the launching process alone), the workers are waited for, the daemon is stopped, and then
the process ends by SIGTERM as before. Where a daemon already runs (CUDA_MPS_PIPE_DIRECTORY names
a live one, or the default /tmp/nvidia-mps does), the jobs use that one and it is left alone. Where none
can start (no nvidia-cuda-mps-control, a refusal, a client that cannot connect), the sweep runs as plain
processes and says why in one line.

Nothing here touches the GPU's settings (compute mode, clocks): MPS works in the default compute mode.
Imports stay light: no torch (the launcher process never makes a CUDA context).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from normlab.launch import sigterm

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = Path("/tmp/nvidia-mps")
# A Unix socket's path is at most 107 bytes; MPS puts sockets in its pipe dir, so a longer sweep dir gets a
# short pipe dir under the system's temporary dir instead (the log dir stays under the sweep dir).
MAX_PIPE_DIR = 80
# Whether a sweep with several jobs on a GPU runs them under NVIDIA MPS (normlab.launch.mps): "auto" starts no
# daemon, true starts a daemon of the sweep's own when more than one job shares a GPU (or uses the one running),
# false never. Measured on an H100 (docs/speed.md), 4 medium models at once: eager, 4.02x one model's throughput
# without MPS and 3.91x with it (eager steps are bound by the CPU's launches, which separate processes overlap
# anyway); replaying CUDA graphs, 5.92x without and 8.61x with. auto would take that gain for CUDA graphs. On an
# H200 a sweep under a daemon of its own, stopped by SIGTERM, closed its output after 0.3 s
# (docs/benchmarks/h200-2026-11-28-gpu-acceptance.md); that SIGTERM stops its daemon (sweep_mps) is tested on the
# CPU with a stand-in control program, not yet on a GPU. So auto leaves MPS off until a GPU run shows the daemon
# stopped (scripts/gpu/acceptance.py --stage mps_sigterm: mps_daemon_left false).
MPS = "auto"


def wants_mps(setting: Any, slots: Sequence[Optional[str]]) -> bool:
    """Whether the sweep's worker `slots` should run under MPS: only for `setting` (hydra.launcher.mps) true, where
    more than one slot is on one GPU; auto and false never."""
    if setting is None or str(setting).lower() not in ("auto", "true", "false"):
        raise ValueError(f"hydra.launcher.mps={setting!r}: must be auto, true or false")
    on_gpu = [slot for slot in slots if slot is not None]
    return str(setting).lower() == "true" and len(on_gpu) > len(set(on_gpu))


# A client's start, checked once before the jobs: CUDA's driver API through ctypes (no torch: 0.2 s, not 2 s).
CLIENT_CHECK = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
ctx, dev = ctypes.c_void_p(), ctypes.c_int()
for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), 0)),
                   ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev))):
    code = getattr(cuda, call)(*args)
    if code:
        sys.exit(f"{call} returned CUDA error {code}")
cuda.cuDevicePrimaryCtxRelease(dev)
"""


@dataclass
class Mps:
    """What a sweep runs under: `env` for its workers ({} for plain processes), the line that says so, and the
    daemon's dirs when the sweep started its own (stopped by `stop`)."""

    env: dict[str, str] = field(default_factory=dict)
    line: str = ""
    pipe_dir: Optional[Path] = None
    log_dir: Optional[Path] = None
    made_pipe_dir: bool = False

    @property
    def active(self) -> bool:
        return bool(self.env)

    def stop(self, timeout: float = 10.0) -> None:
        """Quit the daemon this sweep started (it ends its servers) and wait for it; if it has not ended after
        `timeout` seconds (a client that never let go), end it and its servers with SIGKILL."""
        if self.pipe_dir is None:
            return
        with sigterm.deferred():  # a second SIGTERM must not leave the daemon: this stop is bounded in time
            servers = _server_pids(self.env)
            try:
                control(["quit"], self.env, timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
            deadline = time.monotonic() + timeout
            while daemon_alive(self.pipe_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
            if daemon_alive(self.pipe_dir):
                for pid in [*servers, _pid(self.pipe_dir / "nvidia-cuda-mps-control.pid")]:
                    with contextlib.suppress(OSError, TypeError):
                        os.kill(pid, signal.SIGKILL)
            if self.made_pipe_dir:
                shutil.rmtree(self.pipe_dir, ignore_errors=True)
            self.pipe_dir = None


def _server_pids(env: dict[str, str]) -> list[int]:
    """The daemon's MPS servers (`get_server_list`), [] when it cannot tell."""
    try:
        listed = control(["get_server_list"], env, 5.0)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(word) for word in listed.stdout.split() if word.isdigit()]


def _pid(pid_file: Path) -> Optional[int]:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def daemon_alive(pipe_dir: Path) -> bool:
    """Whether a control daemon listens in `pipe_dir` (its control pipe and its pid file are there)."""
    return (pipe_dir / "control").exists() and _pid_alive(pipe_dir / "nvidia-cuda-mps-control.pid")


def _pid_alive(pid_file: Path) -> bool:
    pid = _pid(pid_file)
    try:
        os.kill(pid, 0)
    except (OSError, TypeError):
        return False
    return True


def running_daemon(environ: Optional[dict[str, str]] = None) -> Optional[Path]:
    """The pipe dir of a daemon already running for this user's processes: CUDA_MPS_PIPE_DIRECTORY's, else the
    default one; None when neither holds a live daemon."""
    environ = os.environ if environ is None else environ
    named = environ.get("CUDA_MPS_PIPE_DIRECTORY")
    for pipe_dir in ([Path(named)] if named else []) + [DEFAULT_PIPE_DIR]:
        if daemon_alive(pipe_dir):
            return pipe_dir
    return None


def daemon_dirs(sweep_dir: Path) -> tuple[Path, Path, bool]:
    """The pipe and log dirs of the sweep's own daemon, and whether the pipe dir is a temporary one (a sweep dir
    too long for a socket path): both under `sweep_dir`/.mps otherwise."""
    root = Path(sweep_dir).resolve() / ".mps"
    pipe = root / "pipe"
    if len(str(pipe)) > MAX_PIPE_DIR:
        return Path(tempfile.mkdtemp(prefix="normlab-mps-")), root / "log", True
    return pipe, root / "log", False


def control(command: list[str], env: dict[str, str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    """`nvidia-cuda-mps-control` with `command` on its standard input (empty: start the daemon, `-d`)."""
    args = [CONTROL] if command else [CONTROL, "-d"]
    return subprocess.run(args, input="\n".join(command) + ("\n" if command else ""), env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def client_check(env: dict[str, str], timeout: float = 60.0) -> Optional[str]:
    """None if a CUDA client started with `env` reaches the GPU, else why not (one line)."""
    try:
        proc = subprocess.run([sys.executable, "-c", CLIENT_CHECK], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"a CUDA client did not start within {timeout:g} s"
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"a CUDA client exited {proc.returncode}"


def _started(env: dict[str, str]) -> Optional[str]:
    """Start a control daemon with `env`: None, else why it did not start (one line)."""
    try:
        started = control([], env)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{CONTROL} -d: {err}"
    if started.returncode == 0:
        return None
    return (started.stderr or started.stdout).strip()[:200] or f"{CONTROL} -d exited {started.returncode}"


def start_daemon(sweep_dir: Path) -> Mps:
    """Start the sweep's own daemon and check that a client reaches it; on any failure, plain processes and why."""
    if shutil.which(CONTROL) is None:
        return Mps(line=f"MPS: {CONTROL} is not on PATH; the jobs share each GPU time-sliced")
    pipe, logs, temporary = daemon_dirs(sweep_dir)
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    mps = Mps(env=env, pipe_dir=pipe, log_dir=logs, made_pipe_dir=temporary)
    try:
        why = _started(env) or client_check(env)
    except BaseException:  # SIGTERM or Ctrl-C during the start: the daemon may run already
        mps.stop()
        raise
    if why:
        mps.stop()
        return Mps(line=f"MPS: could not start ({why}); the jobs share each GPU time-sliced")
    mps.line = f"MPS: a control daemon for this sweep runs the jobs' kernels side by side (logs: {logs})"
    return mps


@contextlib.contextmanager
def sweep_mps(sweep_dir: Path, wanted: bool) -> Iterator[Mps]:
    """The MPS a sweep's workers use: none when not `wanted`; a daemon already running; else the sweep's own,
    stopped when the block ends, however it ends: SIGTERM meanwhile unwinds the block (raising
    sigterm.Terminated), then ends the process by SIGTERM."""
    if not wanted:
        yield Mps()
        return
    existing = running_daemon()
    if existing is not None:
        yield Mps(env={"CUDA_MPS_PIPE_DIRECTORY": str(existing)},
                  line=f"MPS: the jobs use the control daemon already running ({existing})")
        return
    with sigterm.unwinding() as release:
        mps = start_daemon(sweep_dir)
        if mps.pipe_dir is None:  # no daemon of the sweep's own: SIGTERM ends the process as before
            release()
        try:
            yield mps
        finally:
            mps.stop()
