"""The Hydra task of `normlab train`: one job, from its composed config to its final validation loss.

`train_job` is the task function Hydra runs for each job (and submitit unpickles in a SLURM job): it
builds the job's RunConfig (job_config), skips a run that already ended (ended_loss), trains it under
the preemption handlers and applies the failure policy: bad input stops a single run with one line
(_stop); a failed sweep job says so in one line and the sweep goes on unless fail_fast (_job_failed).
Once a preempted job's checkpoint is saved, the signal is handed on (to submitit's requeue, when there
is one).

The pack-member protocol (PackMember, pack_member, train_members, member_result) is the same task split
in three, for normlab's launcher to train a pack's jobs as one packed model (normlab.launch.launcher).

The training stack (torch) is imported inside the functions that train: `normlab train --help` imports
this module and must answer at once.
"""

from __future__ import annotations

import atexit
import copy
import functools
import gc
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

import normlab.train.preempt as preempt
from normlab.launch import job_outcome
from normlab.config import ConfigError, RunConfig
from normlab.launch.paths import from_launch_dir
from normlab.launch.resolvers import register_resolvers
from normlab.launch.resume import continue_command, with_continue_command
from normlab.launch.rundir import discard_unstarted, ended_line, final_loss, record_failure
from normlab.launch.sweep_dirs import changed_records, refusal
from normlab.launch.sweep_log import read_summary
from normlab.train.sinks import RunDirBusy, RunDirGone, WandbUnavailable, disk_full
from normlab.util.errors import PREFIX, fail

log = logging.getLogger("normlab")

# A submitit job (and a launcher's worker process) unpickles `train_job` from this module and resolves
# the job's config here, without `normlab train`'s app, which registers them in the launching process.
register_resolvers()


def train_job(cfg: DictConfig) -> float:
    """One Hydra job. Returns the final validation loss (NaN when diverged or failed) for sweepers to optimize."""
    # The training stack imports torch: `normlab train --help` imports this module and must answer at once.
    import normlab.train.distributed as distributed
    from normlab.data import DataError
    from normlab.train.checkpoint import CheckpointError
    from normlab.train.run import train

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun:
        settle_garbage()
    if not distributed.is_active() and distributed.init_from_env():  # a SLURM job of several tasks
        atexit.register(distributed.shutdown)
    try:
        run_cfg = job_config(cfg)
    except ConfigError as err:
        return _stop(err, None if multirun else hc.runtime.output_dir)
    name, output_dir = run_cfg.run_name, hc.runtime.output_dir
    ended = ended_loss(run_cfg, output_dir)
    if ended is not None:
        return ended
    try:
        with preempt.watch() as previous_handlers:
            summary = train(run_cfg, output_dir, defer_end=multirun and ends_in_background(run_cfg))
    except RunDirBusy as err:
        return _stop(err) if not multirun else _job_failed(hc, run_cfg, err, recorded=True)
    except (DataError, CheckpointError, ConfigError, WandbUnavailable) as err:  # bad input, like a bad config value: one line, not a traceback
        err = with_continue_command(err)
        if not multirun:
            return _stop(err, output_dir)
        # train() has recorded a data error; a refused checkpoint left the job's dir as it was until now.
        return _job_failed(hc, run_cfg, err, recorded=isinstance(err, DataError))
    except preempt.Preempted as stop:
        # A job's dir is <sweep dir>/<subdir>.
        again = continue_command(output_dir, multirun, str(Path(output_dir).parent))
        said(f"normlab: {name} {stop.status}: {stop}; to continue it: {again}")
        preempt.chain(stop.signum, previous_handlers)
    except Exception as err:
        if not multirun and not disk_full(err) and not isinstance(err, RunDirGone):
            raise
        return _job_failed(hc, run_cfg, err, recorded=True)
    return summary["final_val_loss"]


def ends_in_background(run_cfg: RunConfig) -> bool:
    """Whether a sweep's job hands its end (products, the sinks' finish) to the end thread so the next job starts at
    once (normlab.train.ending): on a GPU, whose next job's work waits on the device. Not on the CPU, where the end
    thread and the next job's training take turns at the same cores and Python's lock: on the 2-core CPU, 8 tiny
    jobs took 19.5 s with it and 19.4 s without (two workers), 23.9 s and 20.2 s one after another (two torch
    threads a job), the end's time moving into the next job's training loop (scripts/bench/overhead.py's sweep)."""
    import torch  # not for `normlab train --help`

    return run_cfg.device.startswith("cuda") or (run_cfg.device == "auto" and torch.cuda.is_available())


def said(line: str) -> None:
    """`line` on stderr, once, and in the log files of the job (its normlab.log), but not again on the terminal
    through the log's console handler."""
    print(line, file=sys.stderr)
    to_job_log(logging.WARNING, line)


def to_job_log(level: int, line: str, err: BaseException | None = None) -> None:
    """`line` (with `err`'s traceback, if given) in the log files of the job (its normlab.log) only, not on the
    terminal: there, the job's one line says it."""
    exc_info = (type(err), err, err.__traceback__) if err is not None else None
    record = log.makeRecord(log.name, level, __file__, 0, line, None, exc_info)
    for handler in {*logging.getLogger().handlers, *log.handlers}:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def job_config(cfg: DictConfig) -> RunConfig:
    """The RunConfig of the Hydra job running now (HydraConfig is set): `cfg` resolved and validated (its
    relative paths read from the launch dir under hydra.job.chdir=true: normlab.launch.paths), with the job's
    overrides for wandb's config and, in a multirun, the sweep's wandb group unless one is set. Raises
    ConfigError (one line) for a config that cannot be trained."""
    import normlab.train.distributed as distributed  # torch: not for `normlab train --help`

    hc = HydraConfig.get()
    raw = OmegaConf.to_container(cfg, resolve=True)
    if hc.job.chdir:  # the job runs in its run dir: paths typed on the command line are the launch dir's
        from_launch_dir(raw, hc.runtime.cwd)
    run_cfg = RunConfig.from_dict(raw)
    distributed.check_batch_split(run_cfg)
    run_cfg.wandb.overrides = list(hc.overrides.task)
    if hc.mode == RunMode.MULTIRUN and run_cfg.wandb.group is None:
        run_cfg.wandb.group = sweep_group(hc)
    return run_cfg


def ended_loss(run_cfg: RunConfig, output_dir: str) -> float | None:
    """For a job whose run already ended in `output_dir` with this config (checkpoint.ended_run): one line
    on stderr saying it is not trained again, and its final validation loss (NaN if it has none); else None."""
    from normlab.train.checkpoint import ended_run  # torch: not for `normlab train --help`

    ended = ended_run(run_cfg, output_dir)
    if ended is None:
        return None
    # A re-run sweep: the job is done, and a second wandb run would only confuse its records.
    print(ended_line(run_cfg, output_dir, ended), file=sys.stderr)
    return final_loss(ended)


def ended_job(hydra_context, sweep_config: DictConfig) -> JobReturn | None:
    """A sweep job whose run already ended in its dir with this config, answered without Hydra's run_job, which
    would rewrite the dir's .hydra/ and append to its normlab.log: ended_loss's line, the callbacks' on_job_end
    (the sweep's line for the job) and a JobReturn as run_job gives it, so the dir stays byte for byte as it was.
    A job whose dir holds the records of another config (a search sweeper's trial: a grid sweep's jobs are checked
    before any runs, by sweep_dirs.check_sweep_dirs) stops the command with that check's line, exit code 2, its dir
    untouched. None for any other job (a bad config too: run_job reports it)."""
    hydra = sweep_config.hydra
    output_dir = os.path.abspath(os.path.join(str(hydra.sweep.dir), str(hydra.sweep.subdir)))
    if not any(os.path.isfile(os.path.join(output_dir, name)) for name in ("summary.json", "config.json")):
        return None
    with read_write(hydra.runtime), open_dict(hydra.runtime):
        hydra.runtime.output_dir = output_dir  # as run_job sets it
    HydraConfig.instance().set_config(sweep_config)
    task_cfg = copy.deepcopy(sweep_config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    try:
        run_cfg = job_config(task_cfg)
    except ConfigError:
        return None
    changed = changed_records(run_cfg, output_dir)
    if changed:
        sys.exit(fail(refusal(Path(str(hydra.sweep.dir)).absolute(), [(int(hydra.job.num), run_cfg.run_name, changed)])))
    loss = ended_loss(run_cfg, output_dir)
    if loss is None:
        return None
    return _answered(hydra_context, sweep_config, task_cfg, loss)


def gone_member(hydra_context, sweep_config: DictConfig, member: PackMember) -> JobReturn | None:
    """A pack's member whose run dir went mid-run, answered after the pack trained without Hydra's run_job, which
    would make its dir again at its path and write .hydra/ and normlab.log into it: member_result's one line (the
    job's failure), the callbacks' on_job_end (the sweep's line for it) and a JobReturn. None for any other member."""
    if not isinstance(member.error, RunDirGone):
        return None
    hydra = sweep_config.hydra
    with read_write(hydra.runtime), open_dict(hydra.runtime):
        hydra.runtime.output_dir = member.run_dir  # as run_job sets it
    HydraConfig.instance().set_config(sweep_config)
    task_cfg = copy.deepcopy(sweep_config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    return _answered(hydra_context, sweep_config, task_cfg, member_result(member))


def _answered(hydra_context, sweep_config: DictConfig, task_cfg: DictConfig, value: float) -> JobReturn:
    """The JobReturn of a sweep job answered without Hydra's run_job (HydraConfig set to `sweep_config`), as run_job
    gives it, after the callbacks' on_job_end."""
    hydra = sweep_config.hydra
    ret = JobReturn(overrides=list(hydra.overrides.task), cfg=task_cfg, status=JobStatus.COMPLETED,
                    hydra_cfg=copy.deepcopy(HydraConfig.instance().cfg), _return_value=value,
                    working_dir=str(hydra.runtime.output_dir) if hydra.job.chdir else os.getcwd(),
                    task_name=str(hydra.job.name))
    hydra_context.callbacks.on_job_end(config=sweep_config, job_return=ret)
    return ret


def settle_garbage() -> None:
    """Before a sweep's job: collect what the jobs before it left; before the process's first job and its second,
    also exempt everything then alive from later collections. A sweep's process holds some 370k objects of
    torch and Hydra before its first job and more of what that job imported (wandb, matplotlib, and torch._dynamo
    where it compiled), and each job allocates enough to set off about one full collection, which walks them all
    (0.4 s on a 2-core CPU; 0.17 s for the first job's imports alone); frozen, they are walked no more, neither
    by the collections nor at the process's exit. Frozen twice, not at every job, so what a job leaves is still
    collected and the frozen set does not grow with the sweep; normlab's launcher unfreezes it when the sweep
    ends (thaw_garbage). Which job this is, is counted here, not asked of gc.get_freeze_count(), which counts the
    frozen objects one by one: 0.037 s of CPU a job in a sweep's worker."""
    global _jobs_since_frozen
    gc.collect()
    if _jobs_since_frozen < 2:  # the first job, and the second: the first one's imports too
        gc.freeze()
    _jobs_since_frozen += 1


def thaw_garbage() -> None:
    """The end of a launch (normlab's launcher): what settle_garbage froze for its jobs is collectable again, and the
    next sweep's first jobs freeze afresh."""
    global _jobs_since_frozen
    gc.unfreeze()
    _jobs_since_frozen = 0


# The jobs settle_garbage saw since thaw_garbage (or the process's start).
_jobs_since_frozen = 0


def sweep_group(hc) -> str:
    """A sweep's readable name, its jobs' wandb group: the experiment preset, else the swept keys, then the
    sweep dir's time stamp and id, e.g. 'norm+placement_2026-11-22_14-05-40_a81b2e'."""
    stamp = Path(hc.sweep.dir).name
    preset = hc.runtime.choices.get("experiment")
    if preset:
        return f"{preset}_{stamp}"
    swept = list((hc.sweeper.get("params") or {}).keys())
    launched = Path(hc.sweep.dir) / "multirun.yaml"  # the sweep's own command line, as Hydra saved it
    if launched.exists():
        swept += _swept_on_command_line(str(launched), launched.stat().st_mtime_ns)
    return "+".join(dict.fromkeys(swept) or ["sweep"]) + f"_{stamp}"


@functools.lru_cache(maxsize=8)
def _swept_on_command_line(multirun_yaml: str, mtime_ns: int) -> tuple[str, ...]:
    """The keys a sweep's command line sweeps, read from its multirun.yaml; once per sweep (and version of
    the file, `mtime_ns`), not once per job: loading the YAML costs a job 0.05 s."""
    task = OmegaConf.load(multirun_yaml).hydra.overrides.task
    return tuple(o.get_key_element() for o in OverridesParser.create().parse_overrides(list(task)) if o.is_sweep_override())


def _stop(err, unstarted: str | None = None) -> float:
    """Bad input found by a job: one line, then exit code 2. In a submitit job (one task of a SLURM array)
    the job stops alone and the sweep goes on: it returns NaN, as a failed arm does, since submitit
    records no result for a job that exits, and its launcher would wait for one. `unstarted`: the run dir
    of a single run refused before it started, removed if this launch made it (rundir.discard_unstarted)."""
    code = fail(err)
    if unstarted is not None:
        discard_unstarted(unstarted)
    if os.environ.get("SUBMITIT_EXECUTOR"):
        log.error("%s", err)
        return math.nan
    sys.exit(code)


def _job_failed(hc, run_cfg, err: BaseException, recorded: bool) -> float:
    """A job that failed: one line on stderr (and, in the job's normlab.log only, the traceback), its summary.json
    recorded unless `recorded` already; the sweep goes on (NaN for the sweeper) unless fail_fast, and
    a single run exits 1."""
    if not recorded:
        record_failure(hc.runtime.output_dir, run_cfg, err)
    name, multirun = run_cfg.run_name, hc.mode == RunMode.MULTIRUN
    if status := job_outcome.status_of(err):  # its dir went, or is another process's: the sweep's line must say so
        job_outcome.note(hc.runtime.output_dir, status)
    what = f"the disk is full ({err})" if disk_full(err) else f"{type(err).__name__}: {err}"
    if isinstance(err, RunDirGone):
        what = str(err)  # its normlab.log went with the dir: the line below is the whole account
    else:
        to_job_log(logging.ERROR, f"job {name} failed: {what}", None if disk_full(err) else err)
    print(f"{PREFIX}job {hc.job.num} ({name}) failed: {what}" if multirun else f"{PREFIX}{name} failed: {what}",
          file=sys.stderr)
    if not multirun or run_cfg.fail_fast:
        # SystemExit passes through Hydra's per-job exception capture, so no further job starts.
        sys.exit(1)
    return math.nan  # one failed arm must not end the sweep


@dataclass
class PackMember:
    """One job of a pack, as the launcher hands it from Hydra to the packed trainer and back: its RunConfig
    and run dir; the result it already has if its run ended before (ended_loss); else, once the pack has
    trained, its summary or the pack's error (`recorded`: that error is on record in its summary.json)."""

    cfg: RunConfig
    run_dir: str
    ended: float | None = None
    summary: dict | None = None
    error: BaseException | None = None
    recorded: bool = False


def pack_member(cfg: DictConfig) -> PackMember:
    """A pack's job as Hydra runs it before the pack trains (a task function: Hydra has made its dir): its
    RunConfig, as `train_job` builds it, and whether its run already ended. A bad config stops as in
    `train_job`."""
    output_dir = HydraConfig.get().runtime.output_dir
    try:
        run_cfg = job_config(cfg)
    except ConfigError as err:
        _stop(err)
        raise
    return PackMember(run_cfg, output_dir, ended_loss(run_cfg, output_dir))


def train_members(members: list[PackMember]) -> None:
    """Train the `members` whose runs have not ended as one pack (normlab.train.pack.train_pack), and give
    each its summary, or the error that stopped the pack. A preemption stops the pack as it stops a job
    (`train_job`)."""
    from normlab.train.pack import train_pack  # torch: not for `normlab train --help`

    training = [m for m in members if m.ended is None]
    if not training:
        return
    try:
        with preempt.watch() as previous_handlers:
            summaries = train_pack([(m.cfg, m.run_dir) for m in training])
    except preempt.Preempted as stop:
        names = ", ".join(m.cfg.run_name for m in training)
        again = continue_command(training[0].run_dir, True, str(Path(training[0].run_dir).parent))
        said(f"normlab: pack of {names} {stop.status}: {stop}; to continue it: {again}")
        preempt.chain(stop.signum, previous_handlers)
        raise
    except Exception as err:
        for m in training:
            # train_pack records its failure in every summary.json; a busy run dir is another process's to write.
            recorded = (read_summary(Path(m.run_dir)) or {}).get("error") == f"{type(err).__name__}: {err}"
            m.error, m.recorded = err, recorded or isinstance(err, RunDirBusy)
        return
    for m, summary in zip(training, summaries):
        if isinstance(summary, RunDirGone):  # its dir went mid-run: nothing is on record, nor may be written
            m.error, m.recorded = summary, True
        else:
            m.summary = summary


def member_result(member: PackMember) -> float:
    """A pack's job as Hydra runs it after the pack trained (inside a task function): what `train_job`
    returns for it, the final validation loss (NaN if diverged), or for a failed pack what a failed job gives
    (`_job_failed`: one line, NaN, or the end of the sweep under fail_fast)."""
    if member.ended is not None:
        return member.ended
    if member.error is not None:
        return _job_failed(HydraConfig.get(), member.cfg, member.error, recorded=member.recorded)
    return member.summary["final_val_loss"]
