"""The worker processes of normlab's launcher (normlab.launch.launcher): one per slot, each a fresh interpreter
(spawned: CUDA state is never forked) pinned to its slot's GPU before torch is imported.

They start as the sweep is set up (NormlabLauncher.setup), not when its first job is handed out: each first
imports what every job imports (torch, normlab's training stack, wandb: seconds), and does so while the launching
process composes and validates the sweep's jobs, which takes about 0.1 s a job (Hydra composing each one). The
settings that depend on the launch (threads, the share of GPU memory, the MPS daemon's environment) travel with
each unit of jobs and are applied before the worker first touches CUDA (launcher._run_in_worker).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from multiprocessing.connection import wait
from typing import Optional, Sequence


def pin_worker(gpu: Optional[str], threads: int, memory_fraction: float, env: Optional[dict] = None) -> None:
    """A worker's start: pin it to its GPU and its share of the CPU threads, and point it to the sweep's MPS
    daemon (`env`), before torch is imported."""
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
    its status), as from the launching process."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)


def warm_up() -> None:
    """A started worker's first task: import what every job imports, without touching CUDA (whose start must see
    the launch's MPS environment)."""
    import torch  # noqa: F401  (heavy: seconds; the reason for warming up)

    import normlab.launch.task  # noqa: F401
    import normlab.train.pack  # noqa: F401
    import normlab.train.run  # noqa: F401

    try:
        import wandb  # noqa: F401  (the sinks import it for wandb.mode online or offline, the default)
    except ImportError:
        pass


class Workers:
    """One single-process pool per slot (`slots`: the GPU each is pinned to, None for the CPU), started at once;
    with `warm`, each first imports the jobs' modules (warm_up)."""

    def __init__(self, slots: Sequence[Optional[str]], threads: int, fraction: float, env: Optional[dict] = None,
                 warm: bool = True) -> None:
        self.slots, self.threads, self.fraction, self.env = list(slots), threads, fraction, env or {}
        self.pools = [self._pool(gpu) for gpu in self.slots]
        if warm:
            for pool in self.pools:
                pool.submit(warm_up)

    def _pool(self, gpu: Optional[str]) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, get_context("spawn"), initializer=pin_worker,
                                   initargs=(gpu, self.threads, self.fraction, self.env))

    def __len__(self) -> int:
        return len(self.pools)

    def __getitem__(self, slot: int) -> ProcessPoolExecutor:
        return self.pools[slot]

    def restart(self, slot: int) -> None:
        """A fresh worker for `slot`, whose worker died (a broken pool takes no more jobs)."""
        self.pools[slot].shutdown(wait=False)
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

    def shutdown(self) -> None:
        """Every worker ends, after its unit at hand; the units not started are dropped."""
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)
