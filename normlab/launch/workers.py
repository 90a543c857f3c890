"""The worker processes of normlab's launcher (normlab.launch.launcher): one per slot, pinned to its slot's GPU
before CUDA starts.

A GPU slot's worker is a fresh interpreter (spawned: CUDA state is never forked). A CPU slot's worker is forked
from multiprocessing's forkserver, which imports what every job imports (normlab.launch.preload: torch,
normlab's training stack, matplotlib, wandb; 1.9 s of one core) once for all the workers, where
each spawned worker imported it again: on a CPU the workers share the cores with the launching process, so
each import run once is CPU the jobs get back. A CPU sweep asking for more than one job at once
(`hydra.launcher.cpu_jobs=N` on the command line) starts the forkserver as the command starts (start_early), so
its imports run beside the launching process's own; else it starts with the first worker. A forked worker takes
the launching process's environment as it was when the worker started, as a spawned one does.

Workers start as the sweep is set up (NormlabLauncher.setup), not when its first job is handed out: each first
imports what every job imports, and does so while the launching process composes and validates the sweep's
jobs, which takes about 0.1 s a job (Hydra composing each one). The settings that depend on the launch (threads,
the share of GPU memory, the MPS daemon's environment) travel with each unit of jobs and are applied before the
worker first touches CUDA (launcher._run_in_worker).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import forkserver, get_context, reduction
from multiprocessing.connection import wait
from pathlib import Path
from typing import Iterable, Optional, Sequence

PRELOAD = "normlab.launch.preload"  # the forkserver's preload: what every job imports


def start_method(gpu: Optional[str]) -> str:
    """How a slot's worker starts: spawned for a GPU, forked from the preloaded forkserver for the CPU (where the
    platform has one)."""
    return "forkserver" if gpu is None and "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start_server() -> None:
    """Start the CPU workers' forkserver now, if it is not running: it imports PRELOAD in its own process, and a
    worker forked from it starts at once when that is done."""
    multiprocessing.set_forkserver_preload([PRELOAD])
    forkserver.ensure_running()


def start_early(multirun: bool, overrides: Sequence[str]) -> bool:
    """Start the forkserver as a command starts (and say True) if it is a sweep whose command line asks for more
    than one CPU job at once on a machine without an NVIDIA GPU: its imports then run while this process imports
    and composes its own."""
    asked = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == "hydra.launcher.cpu_jobs" and "=" in o]
    if not multirun or not asked or not asked[-1].strip().isdigit() or int(asked[-1]) < 2:
        return False
    if Path("/proc/driver/nvidia/gpus").exists() or start_method(None) != "forkserver":
        return False
    start_server()
    return True


class _Inherited:
    """A file descriptor of the launching process as it is now, handed to a worker when it starts (a forked worker's
    own are its forkserver's, as they were when the forkserver started): pickled for the worker, it is sent to it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)  # called as the worker starts, when the fd can be sent


def _received(dup) -> int:
    return dup.detach()


def pin_worker(gpu: Optional[str], threads: int, memory_fraction: float, env: Optional[dict] = None,
               environ: Optional[dict] = None, outputs: Sequence[tuple] = ()) -> None:
    """A worker's start: take the launching process's environment (`environ`) and its stdout and stderr (`outputs`:
    (1 or 2, the fd received for it, or None: the launching process started without it, and the worker's goes to
    /dev/null, its fd left as it is)): a forked worker has its forkserver's. Then pin it to its GPU and its share of
    the CPU threads, and point it to the sweep's MPS daemon (`env`), before CUDA starts."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    for target, fd in outputs:
        if fd is None:  # the launching process started without it: what the worker writes there goes nowhere
            setattr(sys, "stdout" if target == 1 else "stderr", open(os.devnull, "w"))
            continue
        os.dup2(fd, target)
        os.close(fd)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    apply_setting(threads, memory_fraction, env)
    threading.Thread(target=end_with_parent, name="normlab-parent-watch", daemon=True).start()


def apply_setting(threads: int, memory_fraction: float, env: Optional[dict] = None) -> None:
    """A launch's setting in this worker's environment: its share of the CPU threads and of the GPU's memory, and
    the sweep's MPS daemon (`env`); read when the job starts torch and CUDA."""
    os.environ.update(env or {})
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["NORMLAB_WORKER_MEMORY_FRACTION"] = str(memory_fraction)


def end_with_parent() -> None:
    """Wait for the launching process to end, then SIGTERM this worker. A launching process killed (SIGTERM,
    SIGKILL) before it ends its workers would leave them waiting for jobs for ever, warm since the sweep's set-up:
    an idle worker ends at once, and a job running in it takes the signal as a preemption (its checkpoint, then
    its status), as from the launching process; then, its unit at hand ended and its runs' ends done, so does the
    worker (no one is left to send it another unit)."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)
        with _unit:
            from normlab.train.ending import drain

            drain()
            os._exit(128 + signal.SIGTERM)


# Held while this worker runs a unit of jobs (in_unit): end_with_parent waits for it.
_unit = threading.Lock()


def in_unit(fn, *args):
    """`fn(*args)`, a unit of jobs in this worker (launcher._run_in_worker), which end_with_parent waits for."""
    with _unit:
        return fn(*args)


def warm_up() -> None:
    """A started worker's first task: import what every job imports (a forked worker has them from its forkserver),
    without touching CUDA (whose start must see the launch's MPS environment): not torch._dynamo, which the optimizer's
    first call imports, nor matplotlib, which its end imports, whose imports were never checked on a GPU machine for
    that."""
    import torch  # noqa: F401  (heavy: seconds; the reason for warming up)

    import normlab.launch.task  # noqa: F401
    import normlab.train.pack  # noqa: F401
    import normlab.train.run  # noqa: F401

    try:
        import wandb  # noqa: F401  (the sinks import it for wandb.mode online or offline, the default)
    except ImportError:
        pass


def _warm_up(pools: Sequence[ProcessPoolExecutor]) -> None:
    for pool in pools:
        try:
            pool.submit(warm_up)
        except RuntimeError:  # shut down meanwhile (Workers.keep): nothing to warm up
            pass


class _Starts:
    """A start method's context that keeps the processes it starts: a pool's worker, to signal (Workers.terminate)."""

    def __init__(self, method: str) -> None:
        self.context, self.processes = get_context(method), []

    def Process(self, *args, **kwargs):  # noqa: N802  (the name ProcessPoolExecutor calls)
        process = self.context.Process(*args, **kwargs)
        self.processes.append(process)
        return process

    def __getattr__(self, name: str):
        return getattr(self.context, name)


class Workers:
    """One single-process pool per slot (`slots`: the GPU each is pinned to, None for the CPU), started at once;
    with `warm`, each first imports the jobs' modules (warm_up)."""

    def __init__(self, slots: Sequence[Optional[str]], threads: int, fraction: float, env: Optional[dict] = None,
                 warm: bool = True) -> None:
        self.slots, self.threads, self.fraction, self.env = list(slots), threads, fraction, env or {}
        self.processes: dict[ProcessPoolExecutor, list] = {}  # each pool's worker processes (_Starts)
        self.pools = [self._pool(gpu) for gpu in self.slots]
        if warm:  # from a thread: a forked worker starts once its forkserver has imported PRELOAD, seconds later
            threading.Thread(target=_warm_up, args=(list(self.pools),), name="normlab-warm-up", daemon=True).start()

    def _pool(self, gpu: Optional[str]) -> ProcessPoolExecutor:
        method = start_method(gpu)
        if method == "forkserver":
            start_server()
        # A stream the process started without (closed: `>&-`) is not sent: its fd may since name a pipe of its own.
        started = ((1, sys.__stdout__), (2, sys.__stderr__)) if method == "forkserver" else ()
        outputs = tuple((target, None if stream is None else _Inherited(target)) for target, stream in started)
        starts = _Starts(method)
        pool = ProcessPoolExecutor(1, starts, initializer=pin_worker,
                                   initargs=(gpu, self.threads, self.fraction, self.env, dict(os.environ), outputs))
        self.processes[pool] = starts.processes
        return pool

    def __len__(self) -> int:
        return len(self.pools)

    def __getitem__(self, slot: int) -> ProcessPoolExecutor:
        return self.pools[slot]

    def restart(self, slot: int) -> None:
        """A fresh worker for `slot`, whose worker died (a broken pool takes no more jobs)."""
        self.pools[slot].shutdown(wait=False)
        self.processes.pop(self.pools[slot], None)
        self.pools[slot] = self._pool(self.slots[slot])

    def keep(self, n: int) -> None:
        """Only the first `n` slots are used: the others' workers go (once warmed up: a spawned interpreter is not cut
        off halfway through its imports)."""
        for pool in self.pools[n:]:
            pool.shutdown(wait=False, cancel_futures=True)
        del self.pools[n:], self.slots[n:]

    def release(self, slot: int) -> None:
        """`slot` takes no more units: its worker ends, without waiting for it (shutdown does)."""
        self.pools[slot].shutdown(wait=False)

    def terminate(self, slots: Iterable[int]) -> None:
        """SIGTERM to the workers of `slots` (those running a unit): each job running takes it as a preemption, as
        from the process group. The launching process alone may get SIGTERM (`kill PID`); an idle worker needs none
        (shutdown ends it)."""
        for slot in slots:
            for process in self.processes.get(self.pools[slot], []):
                if process.is_alive():
                    with contextlib.suppress(OSError):
                        os.kill(process.pid, signal.SIGTERM)

    def shutdown(self) -> None:
        """Every worker ends, after its unit at hand; the units not started are dropped."""
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)
