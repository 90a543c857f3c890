"""`hydra/launcher=normlab` (conf/hydra/launcher/normlab.yaml): a sweep's jobs run several at once on each GPU, spread over every visible GPU.

normlab's default launcher (conf/config.yaml). On a machine with GPUs it runs `jobs_per_gpu` jobs at
once on each visible GPU: one worker process per slot, pinned to its GPU by CUDA_VISIBLE_DEVICES
(slots are dealt round robin, so a sweep smaller than the slots still spreads over the GPUs), each
worker running its slot's jobs one after another and releasing the GPU's cached memory after each.
Without a GPU it runs `cpu_jobs` at once, by default 1: the jobs run one after another in this
process, exactly as Hydra's basic launcher runs them (a 2-core CPU gains nothing from more).

Every job is composed and run as the basic launcher runs it (same overrides, same job numbers, same
seeds), so results equal a sequential sweep's; concurrent jobs only turn off their progress bars
(`progress=false`), since interleaved bars are unreadable: each job says what it found in one
line as it ends (normlab.sweep).

Imports stay light: torch is imported only to count GPUs, and in the workers.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from omegaconf import open_dict

log = logging.getLogger(__name__)

# Jobs at once on one GPU. The measurement: the 8-arm model=medium sweep (300 steps) on an H100
# took 106 s one job at a time and 47 s with 4 at once (joblib); scripts/sweep_bench.py measures
# 1, 2, 4 and 8 to settle the default on a given GPU. conf/hydra/launcher/normlab.yaml sets the same.
JOBS_PER_GPU = 4


def visible_gpus(devices: Optional[Sequence[Any]] = None) -> list[str]:
    """The GPUs a sweep may use, as CUDA_VISIBLE_DEVICES entries: `devices` when given, else the
    entries of CUDA_VISIBLE_DEVICES when it is set, else every GPU torch sees ([] without CUDA)."""
    if devices is not None:
        return [str(d) for d in devices]
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        entries = [e.strip() for e in env.split(",") if e.strip()]
        return [] if entries[:1] == ["-1"] else entries
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_slots(gpus: Sequence[str], jobs_per_gpu: int, cpu_jobs: int) -> list[Optional[str]]:
    """The sweep's worker slots, each the GPU it is pinned to (None: the CPU), dealt round robin:
    [g0, g1, g0, g1, ...] for 2 jobs on each of 2 GPUs, so the first slots cover every GPU."""
    if jobs_per_gpu < 1 or cpu_jobs < 1:
        raise ValueError(f"hydra.launcher: jobs_per_gpu={jobs_per_gpu} and cpu_jobs={cpu_jobs} must be >= 1")
    if not gpus:
        return [None] * cpu_jobs
    return [gpu for _ in range(jobs_per_gpu) for gpu in gpus]


def threads_per_job(concurrent: int) -> int:
    """CPU threads for each of `concurrent` jobs: the cores (or OMP_NUM_THREADS, if lower) shared out,
    so that workers do not oversubscribe the CPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = os.environ.get("OMP_NUM_THREADS", "")
    if limit.isdigit() and int(limit) > 0:
        cores = min(cores, int(limit))
    return max(1, cores // concurrent)


def _pin_worker(gpu: Optional[str], threads: int, memory_fraction: float) -> None:
    """A worker's start: pin it to its GPU and its share of the CPU threads before torch is imported."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["NORMLAB_WORKER_MEMORY_FRACTION"] = str(memory_fraction)


def _run_in_worker(idx: int, overrides: Sequence[str], hydra_context, config, task_function, singleton_state) -> JobReturn:
    """One job in a worker process, composed and run as Hydra's basic launcher runs it; then the
    GPU memory the job cached is handed back, so the slot's next job (and its neighbours) get it."""
    import gc

    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(os.environ["NORMLAB_WORKER_MEMORY_FRACTION"]))
    from omegaconf.basecontainer import BaseContainer

    setup_globals()
    # This process's resolvers: Hydra's (setup_globals) and normlab's (registered on unpickling the task).
    Singleton.set_state({**singleton_state, "omegaconf_resolvers": dict(BaseContainer._resolvers)})
    sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = idx
        sweep_config.hydra.job.num = idx
    HydraConfig.instance().set_config(sweep_config)
    try:
        ret = run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        return _picklable(ret)
    finally:
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def _picklable(ret: JobReturn) -> JobReturn:
    """The job's return, fit to travel back to the launcher: its configs as plain ones (a structured config's
    class, as Hydra's plugin scan loaded it here, is not the one pickle finds by name), and a failed job's
    exception as a RuntimeError with its text if the exception itself does not pickle."""
    import pickle

    from omegaconf import OmegaConf

    for name in ("cfg", "hydra_cfg"):
        value = getattr(ret, name, None)
        if value is not None:
            setattr(ret, name, OmegaConf.create(OmegaConf.to_container(value, resolve=False)))
    if ret.status == JobStatus.FAILED:
        try:
            pickle.dumps(ret._return_value)
        except Exception:
            ret._return_value = RuntimeError(f"{type(ret._return_value).__name__}: {ret._return_value}")
    return ret


class NormlabLauncher(BasicLauncher):
    """Runs a sweep's jobs concurrently over GPU slots (see the module's docstring); one slot: sequentially."""

    def __init__(self, jobs_per_gpu: int = JOBS_PER_GPU, cpu_jobs: int = 1, devices: Optional[List[str]] = None) -> None:
        super().__init__()
        self.jobs_per_gpu, self.cpu_jobs, self.devices = jobs_per_gpu, cpu_jobs, devices

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        slots = plan_slots(visible_gpus(self.devices), self.jobs_per_gpu, self.cpu_jobs)[: len(job_overrides)]
        if len(slots) <= 1:
            return super().launch(job_overrides, initial_job_idx)
        return self._launch_concurrently(job_overrides, initial_job_idx, slots)

    def _launch_concurrently(self, job_overrides, initial_job_idx: int, slots: list) -> list[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        where = "the CPU" if slots[0] is None else f"GPU {', '.join(sorted(set(slots)))} (CUDA_VISIBLE_DEVICES)"
        log.info(f"Launching {len(job_overrides)} jobs, {len(slots)} at once on {where}")
        threads = threads_per_job(len(slots))
        fraction = 0.95 / max(1, slots.count(slots[0]))  # each job's share of its GPU's memory
        context = get_context("spawn")  # a fresh interpreter per worker: CUDA state is never forked
        workers = [ProcessPoolExecutor(1, context, initializer=_pin_worker, initargs=(gpu, threads, fraction)) for gpu in slots]
        pending = list(enumerate(job_overrides, start=initial_job_idx))[::-1]
        running: dict = {}
        returns: dict[int, JobReturn] = {}
        stop: Optional[BaseException] = None
        # Resolvers are local functions, which do not pickle: a worker registers normlab's own when it
        # unpickles the task (normlab.app), and the sweep dir, the one value that names the launch
        # (${launch_time:}, ${uid:}), is resolved here, so every job lands in this sweep's dir.
        state = {k: v for k, v in Singleton.get_state().items() if k != "omegaconf_resolvers"}
        config = self.config.copy()
        with open_dict(config):
            config.hydra.sweep.dir = str(self.config.hydra.sweep.dir)
        try:
            while pending or running:
                for slot in [s for s in range(len(slots)) if s not in {s for s, _ in running.values()}]:
                    if not pending or stop is not None:
                        break
                    idx, overrides = pending.pop()
                    overrides = [*overrides, "progress=false"]  # one line per job, no interleaved bars
                    place = "CPU" if slots[slot] is None else f"GPU {slots[slot]}"
                    log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}  [{place}]")
                    future = workers[slot].submit(_run_in_worker, idx, overrides, self.hydra_context, config,
                                                  self.task_function, state)
                    running[future] = (slot, idx)
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    slot, idx = running.pop(future)
                    try:
                        returns[idx] = future.result()
                    except (SystemExit, KeyboardInterrupt) as err:  # fail_fast or a bad config: no new job starts
                        stop = stop or err
                    except Exception as err:  # the worker died (killed, out of memory): the job failed
                        returns[idx] = _failed(idx, err)
                        workers[slot].shutdown(wait=False)  # a broken pool takes no more jobs: a fresh worker
                        workers[slot] = ProcessPoolExecutor(1, context, initializer=_pin_worker,
                                                            initargs=(slots[slot], threads, fraction))
        finally:
            for worker in workers:
                worker.shutdown(wait=True, cancel_futures=True)
        if stop is not None:
            raise stop
        return [returns[i] for i in sorted(returns)]


def _failed(idx: int, err: BaseException) -> JobReturn:
    log.error(f"job {idx} failed in its worker: {type(err).__name__}: {err}")
    ret = JobReturn()
    ret.status = JobStatus.FAILED
    ret.return_value = err
    return ret
