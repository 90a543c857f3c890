"""`hydra/launcher=normlab` (conf/hydra/launcher/normlab.yaml): a sweep's jobs run several at once on each GPU, spread over every visible GPU.

normlab's default launcher (conf/config.yaml). On a machine with GPUs it runs `jobs_per_gpu` jobs at
once on each visible GPU: one worker process per slot, pinned to its GPU by CUDA_VISIBLE_DEVICES
(slots are dealt round robin, so a sweep smaller than the slots still spreads over the GPUs), each
worker running its slot's jobs one after another and releasing the GPU's cached memory after each.
The workers start when the sweep is set up and import the training stack while the sweeper composes the
jobs (normlab.launch.workers); the configs composed then are the ones the launch uses (normlab.launch.composed:
each job is composed once in this process, compose_jobs included).
Without a GPU it runs `cpu_jobs` at once, by default 1: the jobs run one after another in this
process, exactly as Hydra's basic launcher runs them (a 2-core CPU gains nothing from more).
In a grid sweep run again in its sweep dir, each job lands in the dir of the run it asks for, wherever it is,
and a job the sweep has no run of gets a dir numbered after the sweep's jobs (normlab.launch.sweep_index).

Every job is composed and run as the basic launcher runs it (same overrides, same job numbers, same seeds), so
results equal a sequential sweep's; concurrent jobs only turn off their progress bars (`progress=false`), since
interleaved bars are unreadable: each job says what it found in one line as it ends (normlab.launch.sweep_log).

Packed arms (`pack=true`, normlab.train.pack): the jobs that differ only in lr and seed train as the members
of one packed model in one process; every other job (pack=false, or alone in its pack) runs as above.
Each member stays an ordinary Hydra job. A pack is run in three passes over its members:
  1. Hydra's `run_job` for each member, with a HydraContext without callbacks and `task.pack_member` as
     the task: Hydra makes the member's dir and writes its .hydra/ (config, hydra, overrides), its job log
     starts, and normlab builds its RunConfig as `task.train_job` does (and finds a run that already ended);
  2. `task.train_members`: normlab.train.pack.train_pack trains the members that have not ended, in this
     process; its log lines go to every member's job log (`<job dir>/normlab.log`) and to the console;
  3. `run_job` for each member again, now with Hydra's callbacks and a task that returns the member's
     result as `task.train_job` would have: on_job_start and on_job_end fire for each job (normlab.launch.sweep_log's line
     per job, then its table), and each job's JobReturn carries its final val loss (a failed member: a
     line on stderr and NaN, as a failed job gives: a FAILED JobReturn would make Hydra's sweeper raise
     after the batch, with no table).
Hydra runs each member's job twice, and only pass 2 between them trains: so the callbacks see each job
once, after it has ended, as they see an unpacked one. Pass 3 rewrites .hydra/ as pass 1 wrote it (not for a member
whose dir went mid-run: task.gone_member answers it without run_job, which would make the dir again). A pack
of one job is no pack: it runs as an unpacked job. Packs are the units: on the CPU they run in this
process one after another (with cpu_jobs > 1, in workers); on a GPU machine each pack, like each
unpacked job, takes one worker slot. Which jobs pack is decided before any job runs, by composing each
job's config as it will run (normlab.config.packing.pack_groups). Imports stay light: torch is imported only
to count GPUs where one may be (normlab.launch.machine.visible_gpus), in the workers, and for a sweep with pack=true.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra._internal.callbacks import Callbacks
from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.basecontainer import BaseContainer

from normlab.config import RunConfig
from normlab.config.packing import pack_groups
from normlab.launch.composed import ComposedOnce
from normlab.launch.machine import visible_gpus
from normlab.launch.mps import MPS, sweep_mps, wants_mps
from normlab.launch.resolvers import task_dict
from normlab.launch.sigterm import Terminated
from normlab.launch.sweep_dirs import job_places
from normlab.launch.sweep_index import BASIC_SWEEPER, Place, recorded_runs
from normlab.launch.task import ended_job, gone_member, member_result, pack_member, thaw_garbage, train_members
from normlab.launch.workers import Workers, apply_setting, in_unit
from normlab.launch.workers import pin_worker as _pin_worker  # noqa: F401  (a worker's start, as the tests call it)
from normlab.train.ending import drain

log = logging.getLogger(__name__)

# Jobs at once on one GPU. Measured: the 8-arm model=medium sweep (300 steps) on an H100
# took 106 s one job at a time and 47 s with 4 at once (joblib); scripts/bench/sweep_throughput.py measures
# 1, 2, 4 and 8 to settle the default on a given GPU. conf/hydra/launcher/normlab.yaml sets the same.
JOBS_PER_GPU = 4


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


def _compose(hydra_context, config, idx: int, overrides: Sequence[str], composed: Optional[DictConfig] = None,
             place: Optional[Place] = None) -> DictConfig:
    """Job `idx`'s config as Hydra's basic launcher composes it (hydra node included), set as HydraConfig's;
    `composed`: the job's config as this function gave it before (compose_jobs'), taken as it is; `place`: where
    the job lands in a sweep run again (sweep_dirs.job_places): its number and dir, for its place's."""
    sweep_config = composed
    if sweep_config is None:
        sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = idx
            sweep_config.hydra.job.num = idx
    if place is not None:  # a config compose_jobs kept was HydraConfig's: its hydra node is read-only
        with read_write(sweep_config.hydra), open_dict(sweep_config):
            sweep_config.hydra.job.id = sweep_config.hydra.job.num = place.num
            sweep_config.hydra.sweep.subdir = place.subdir
    HydraConfig.instance().set_config(sweep_config)
    return sweep_config


def _run(hydra_context, task_function, sweep_config: DictConfig) -> JobReturn:
    return run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


def run_unit(unit: Sequence[tuple[int, Sequence[str]]], hydra_context, config, task_function,
             composed: Optional[dict] = None, places: Optional[dict] = None) -> list[JobReturn]:
    """A unit of the sweep, as (job number, overrides) pairs: one job, run as Hydra's basic launcher runs it,
    or a pack's jobs (run_pack). `composed`: configs compose_jobs composed, by job number (those used are taken
    out); `places`: where the jobs land (sweep_dirs.job_places), by job number. Returns their JobReturns in order."""
    composed, places = {} if composed is None else composed, places or {}
    if len(unit) > 1:
        return run_pack(unit, hydra_context, config, composed, places)
    [(idx, overrides)] = unit
    sweep_config = _compose(hydra_context, config, idx, overrides, composed.pop(idx, None), places.get(idx))
    return [ended_job(hydra_context, sweep_config) or _run(hydra_context, task_function, sweep_config)]


def run_pack(unit: Sequence[tuple[int, Sequence[str]]], hydra_context, config, composed: Optional[dict] = None,
             places: Optional[dict] = None) -> list[JobReturn]:
    """A pack's jobs, each an ordinary Hydra job, trained together (the module's docstring: three passes).
    `composed`, `places`: as run_unit's. Returns their JobReturns in order."""
    quiet = HydraContext(config_loader=hydra_context.config_loader, callbacks=Callbacks())
    composed, places = {} if composed is None else composed, places or {}
    configs, members, logs = [], [], []
    for idx, overrides in unit:  # pass 1: dirs, .hydra/, job logs, RunConfigs
        configs.append(_compose(hydra_context, config, idx, overrides, composed.pop(idx, None), places.get(idx)))
        member, files = _run(quiet, _prepare_member, configs[-1]).return_value
        members.append(member)
        logs += files
    configure_log(configs[0].hydra.job_logging, configs[0].hydra.verbose)
    with _also_logged_to(logs):  # pass 2: train
        training = [f"#{idx}" for (idx, _), member in zip(unit, members) if member.ended is None]
        if training:
            log.info(f"pack of {len(training)} jobs ({', '.join(training)}) trains as one packed model; "
                     "this log is in each of their job logs")
        train_members(members)
    returns = []
    for sweep_config, member in zip(configs, members):  # pass 3: callbacks and returns
        returns.append(gone_member(hydra_context, sweep_config, member)
                       or _run(hydra_context, lambda cfg, member=member: member_result(member), sweep_config))
    return returns


def _prepare_member(cfg: DictConfig):
    """Pass 1's task: the member (normlab.launch.task.pack_member) and its job log's files as Hydra opened them."""
    files = [(h.baseFilename, h.formatter, h.level) for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    return pack_member(cfg), files


@contextlib.contextmanager
def _also_logged_to(files: Sequence[tuple[str, Any, int]]):
    """Log records also go to `files` (path, formatter, level) for the duration: a pack's members' job logs."""
    root = logging.getLogger()
    open_paths = {getattr(h, "baseFilename", None) for h in root.handlers}
    added = []
    for path, formatter, level in files:
        if path not in open_paths:
            open_paths.add(path)
            added.append(logging.FileHandler(path))
            added[-1].setFormatter(formatter)
            added[-1].setLevel(level)
            root.addHandler(added[-1])
    try:
        yield
    finally:
        for handler in added:
            root.removeHandler(handler)
            handler.close()


def compose_jobs(hydra_context, config, jobs: Sequence[tuple[int, Sequence[str]]], keep: dict) -> list[Optional[RunConfig]]:
    """The RunConfigs of the sweep's `jobs` ((job number, overrides) pairs), each composed as it will run and kept in
    `keep` by job number, for run_unit; None for a job whose config cannot be built (it says why as it runs)."""
    cfgs = []
    before = HydraConfig.instance().cfg
    try:
        for idx, overrides in jobs:
            keep[idx] = sweep_config = _compose(hydra_context, config, idx, overrides)
            try:
                cfgs.append(RunConfig.from_dict(task_dict(sweep_config)))
            except Exception:
                cfgs.append(None)
    finally:
        HydraConfig.instance().cfg = before
    return cfgs


def asks_for_packs(config: DictConfig, job_overrides: Sequence[Sequence[str]]) -> bool:
    """Whether any job may have pack=true: the sweep's config has it, or a job's overrides set it. (Cheap:
    composing every job's config to find out would cost every sweep a second or more.)"""
    return bool(config.get("pack")) or any(o.split("=", 1)[0].lstrip("+~") == "pack" for job in job_overrides for o in job)


def _run_in_worker(unit: Sequence[tuple[int, Sequence[str]]], hydra_context, config, task_function, singleton_state,
                   setting: tuple[int, float, dict], places: dict) -> list[JobReturn]:
    """A unit of jobs (run_unit, its jobs landing at `places`) in a worker process, under the launch's `setting`
    (threads, share of the GPU's memory, the MPS daemon's environment: applied before CUDA starts); then the GPU memory
    it cached is handed back, so the slot's next unit (and its neighbours) get it."""
    apply_setting(*setting)
    import torch  # heavy: only a worker, pinned to its GPU, loads it (Hydra's plugin scan imports this module)

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(os.environ["NORMLAB_WORKER_MEMORY_FRACTION"]))
    setup_globals()
    _set_singletons(singleton_state)
    try:
        return [_picklable(ret) for ret in run_unit(unit, hydra_context, config, task_function, places=places)]
    finally:
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def _set_singletons(state: dict) -> None:
    """The launching process's Hydra singletons, with this process's resolvers and its plugins (set_state re-scans: 0.02 s)."""
    instances = {**state["instances"], **{k: v for k, v in Singleton._instances.items() if k is Plugins}}
    Singleton.set_state({**state, "instances": instances, "omegaconf_resolvers": dict(BaseContainer._resolvers)})


def _picklable(ret: JobReturn) -> JobReturn:
    """The job's return, fit to travel back to the launcher: its configs as plain ones (a structured config's
    class, as Hydra's plugin scan loaded it here, is not the one pickle finds by name), and a failed job's
    exception as a RuntimeError with its text if the exception itself does not pickle."""
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

    def __init__(self, jobs_per_gpu: int = JOBS_PER_GPU, cpu_jobs: int = 1, devices: Optional[List[str]] = None,
                 mps: Any = MPS) -> None:
        super().__init__()
        self.jobs_per_gpu, self.cpu_jobs, self.devices, self.mps = jobs_per_gpu, cpu_jobs, devices, mps
        self.workers: Optional[Workers] = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        loader = hydra_context.config_loader
        # The launcher takes the configs the sweeper composed to validate them (a worker gets the loader as it was).
        if not isinstance(loader.load_sweep_config, ComposedOnce):
            loader.load_sweep_config = ComposedOnce(loader.load_sweep_config)
        slots = plan_slots(visible_gpus(self.devices), self.jobs_per_gpu, self.cpu_jobs)
        if len(slots) > 1 and self.workers is None:  # they import while the sweeper composes the jobs
            self.workers = Workers(slots, threads_per_job(len(slots)), _memory_share(slots))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        composed = self.hydra_context.config_loader.load_sweep_config
        try:
            with composed.launch() if isinstance(composed, ComposedOnce) else contextlib.nullcontext():
                return self._launch(job_overrides, initial_job_idx)
        finally:
            drain()  # the jobs' ends (normlab.train.ending) are done before the sweep's table reads their summaries
            thaw_garbage()  # what normlab.launch.task.settle_garbage froze for the sweep's jobs

    def _launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        jobs = list(enumerate(job_overrides, start=initial_job_idx))
        units, composed, places = [[job] for job in jobs], {}, {}
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        # A grid sweep run again in its dir: each job lands where its run is (a search sweeper's trials, where Hydra puts them).
        rerun = self.config.hydra.sweeper.get("_target_") == BASIC_SWEEPER and bool(recorded_runs(sweep_dir))
        if rerun or asks_for_packs(self.config, job_overrides):
            setup_globals()
            cfgs = compose_jobs(self.hydra_context, self.config, jobs, keep=composed)
            places = job_places(sweep_dir, composed, dict(zip(composed, cfgs))) if rerun else {}
            units = [[jobs[i] for i in group] for group in pack_groups(cfgs)]
        slots = plan_slots(visible_gpus(self.devices), self.jobs_per_gpu, self.cpu_jobs)[: len(units)]
        if len(slots) <= 1 and self.workers is not None:  # one slot: the jobs run here
            self.workers.keep(0)
            self.workers = None
        if len(slots) > 1:
            with sweep_mps(sweep_dir, wants_mps(self.mps, slots)) as mps:
                if mps.line:
                    log.info(mps.line)
                return self._launch_concurrently(units, slots, mps.env, places)
        return self._launch_in_turn(units, composed, places)

    def _launch_in_turn(self, units: list, composed: dict, places: dict) -> list[JobReturn]:
        """The units one after another in this process, as Hydra's basic launcher runs its jobs (and says so), but
        through run_unit: a job whose run already ended is answered without Hydra's run_job (task.ended_job)."""
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        packs = sum(len(unit) > 1 for unit in units)
        log.info(f"Launching {sum(len(u) for u in units)} jobs " + (f"({packs} packs among them), one after another in this process" if packs else "locally"))
        returns = []
        for unit in units:
            for idx, overrides in unit:
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}" + (f"  [pack of {len(unit)}]" if len(unit) > 1 else ""))
            returns += zip([idx for idx, _ in unit],
                           run_unit(unit, self.hydra_context, self.config, self.task_function, composed, places))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return [ret for _, ret in sorted(returns, key=lambda pair: pair[0])]

    def _launch_concurrently(self, units: list, slots: list, env: dict, places: dict) -> list[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        where = "the CPU" if slots[0] is None else f"GPU {', '.join(sorted(set(slots)))} (CUDA_VISIBLE_DEVICES)"
        packs = sum(len(unit) > 1 for unit in units)
        log.info(f"Launching {sum(len(u) for u in units)} jobs" + (f" ({packs} packs among them)" if packs else "")
                 + f", {len(slots)} at once on {where}")
        setting = (threads_per_job(len(slots)), _memory_share(slots), env)
        workers, self.workers = self.workers, None  # started by setup, or, for a later launch, now
        if workers is None or len(workers) < len(slots):
            workers = Workers(slots, *setting, warm=False)
        workers.keep(len(slots))
        pending = units[::-1]
        running: dict = {}
        returns: dict[int, JobReturn] = {}
        stop: Optional[BaseException] = None
        # Resolvers are local functions, which do not pickle: a worker registers normlab's own when it
        # unpickles the task (normlab.launch.task), and the sweep dir, the one value that names the launch
        # (${launch_time:}, ${uid:}), is resolved here, so every job lands in this sweep's dir.
        state = {k: v for k, v in Singleton.get_state().items() if k != "omegaconf_resolvers"}
        config = self.config.copy()
        with open_dict(config):
            config.hydra.sweep.dir = str(self.config.hydra.sweep.dir)
        try:
            while pending or running:
                for slot in [s for s in range(len(slots)) if s not in {s for s, _ in running.values()}]:
                    if not pending or stop is not None:  # an idle worker ends now, beside the last units
                        workers.release(slot)
                        continue
                    # One line per job, no interleaved bars.
                    unit = [(idx, [*overrides, "progress=false"]) for idx, overrides in pending.pop()]
                    place = "CPU" if slots[slot] is None else f"GPU {slots[slot]}"
                    for idx, overrides in unit:
                        packed = f", pack of {len(unit)}" if len(unit) > 1 else ""
                        log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}  [{place}{packed}]")
                    future = workers[slot].submit(in_unit, _run_in_worker, unit, self.hydra_context, config,
                                                  self.task_function, state, setting,
                                                  {idx: places[idx] for idx, _ in unit if idx in places})
                    running[future] = (slot, [idx for idx, _ in unit])
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    slot, idxs = running.pop(future)
                    try:
                        returns.update(zip(idxs, future.result()))
                    except (SystemExit, KeyboardInterrupt) as err:  # fail_fast or a bad config: no new job starts
                        stop = stop or err
                    except Exception as err:  # the worker died (killed, out of memory): its jobs failed
                        returns.update((idx, _failed(idx, err)) for idx in idxs)
                        workers.restart(slot)  # a broken pool takes no more jobs: a fresh worker
        except Terminated:  # SIGTERM under the sweep's own MPS daemon (normlab.launch.mps): the running jobs stop
            workers.terminate({slot for slot, _ in running.values()})
            raise
        finally:
            workers.shutdown()
        if stop is not None:
            raise stop
        return [returns[i] for i in sorted(returns)]


def _memory_share(slots: Sequence[Optional[str]]) -> float:
    """Each job's share of its GPU's memory, the GPU shared by the slots pinned to it."""
    return 0.95 / max(1, slots.count(slots[0]))


def _failed(idx: int, err: BaseException) -> JobReturn:
    log.error(f"job {idx} failed in its worker: {type(err).__name__}: {err}")
    ret = JobReturn()
    ret.status = JobStatus.FAILED
    ret.return_value = err
    return ret
