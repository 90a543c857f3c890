"""A sweep's job dirs, checked before any job runs (prechecks.check_jobs): each inside the sweep dir, each its own,
and, in a sweep run again in its dir (hydra.sweep.dir=S), each job where its run is (normlab.launch.sweep_index).

A sweep dir is one experiment. A sweep run again continues each run it asks for as that run ran: one that ended is
not trained again, a stopped one resumes, wherever its dir is (normlab's launcher lands each job there: job_places).
A key that neither the sweep (its runs' config.json) nor the command sweeps keeps the sweep's value in every job, new
ones included: a command that gives it another (max_steps=30 in a sweep of max_steps=20) is refused whole, in one
line naming the jobs and the keys, before Hydra writes anything, since a sweep whose arms ran with two values of a
key it does not sweep compares nothing. So is a command that would land a job in a dir holding another config's
records (`changed_records`, the same test for one run dir), and, under a launcher that puts each job in the dir of
its place in the command line, one whose jobs would not land where their runs are.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Sequence

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from normlab.config import ConfigError, RunConfig, bookkeeping_keys, flatten_config, is_bookkeeping, run_identity
from normlab.config.parse import override_text
from normlab.launch.paths import from_launch_dir
from normlab.launch.sweep_index import AskedJob, Place, RecordedRun, place_jobs, recorded_runs

NAMED_JOBS = 3  # jobs named in a refusal; the rest are counted


def job_dir(cfg: DictConfig, num: int) -> Path:
    """The absolute dir Hydra's run_job gives job `num` of a sweep whose composed config (hydra node included) is
    `cfg`: hydra.sweep.dir joined with hydra.sweep.subdir, resolved with hydra.job.num (and id) set to `num`."""
    before = HydraConfig.instance().cfg
    with read_write(cfg.hydra.job), open_dict(cfg.hydra.job):
        saved = {key: "???" if OmegaConf.is_missing(cfg.hydra.job, key) else cfg.hydra.job[key] for key in ("num", "id")}
        cfg.hydra.job.num = cfg.hydra.job.id = num
    try:
        HydraConfig.instance().set_config(cfg)  # for ${hydra:job.num} and the like
        sweep_dir, subdir = (str(OmegaConf.select(cfg, f"hydra.sweep.{key}")) for key in ("dir", "subdir"))
        return Path(os.path.abspath(os.path.join(sweep_dir, subdir)))
    finally:
        HydraConfig.instance().cfg = before
        with read_write(cfg.hydra.job), open_dict(cfg.hydra.job):
            for key, value in saved.items():
                cfg.hydra.job[key] = value


def job_config(cfg: DictConfig, run_cfg: RunConfig) -> RunConfig:
    """`run_cfg`, the job's validated config, as its task builds it (task.job_config): under hydra.job.chdir=true
    its relative paths read from the launch dir, as the job's config.json holds them."""
    if not cfg.hydra.job.chdir:
        return run_cfg
    return RunConfig.from_dict(from_launch_dir(run_cfg.to_dict(), os.getcwd()))


def changed_records(cfg: RunConfig, run_dir: str | os.PathLike) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, `cfg`'s value) for each key, bookkeeping keys aside, in which the run `run_dir` holds
    records of (its config.json) differs from `cfg`; [] where it holds none (or unreadable ones) or `cfg` asks for
    overwrite=true, which trains afresh."""
    from normlab.train.checkpoint import config_differences  # torch: not for `normlab train --help`

    if cfg.overwrite:
        return []
    try:
        saved = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    return config_differences(flatten_config(saved), cfg) if isinstance(saved, dict) else []


def check_sweep_dirs(composed: list[DictConfig], cfgs: list[RunConfig], launcher: str | None = None) -> None:
    """ConfigError (one line) unless every job of a grid sweep (`composed`: their configs in Hydra's order, hydra
    node included; `cfgs`: their RunConfigs) has a dir of its own inside the sweep dir, and, where the sweep dir
    holds jobs already: the jobs give the sweep's value of each key neither sweeps (check_unswept), none lands in a
    dir holding the records of another config (changed_records), and under `launcher` (the hydra/launcher choice,
    given when it is not normlab's) each lands in the dir of its place in the command line only where its run is."""
    if not composed:
        return
    sweep_dir = Path(os.path.abspath(str(OmegaConf.select(composed[0], "hydra.sweep.dir"))))
    positional = [job_dir(cfg, num) for num, cfg in enumerate(composed)]
    _check_inside(sweep_dir, positional, composed[0])
    runs = recorded_runs(sweep_dir)
    if not runs:
        return  # a new sweep: nothing recorded yet
    run_cfgs = [job_config(cfg, run_cfg) for cfg, run_cfg in zip(composed, cfgs)]
    check_unswept(sweep_dir, runs, run_cfgs)
    places = place_jobs(sweep_dir, asked_jobs(composed, run_cfgs), runs)
    dirs = [sweep_dir / place.subdir for place in places]
    if launcher is not None:
        _check_in_place(sweep_dir, launcher, dirs, positional, run_cfgs)
    _check_inside(sweep_dir, dirs, composed[0])
    changed = []
    for place, path, run_cfg in zip(places, dirs, run_cfgs):
        differ = changed_records(run_cfg, path) if path.is_dir() else []
        if differ:
            changed.append((place.num, run_cfg.run_name, differ))
    if changed:
        raise ConfigError(refusal(sweep_dir, changed))


def asked_jobs(composed: Sequence[DictConfig], run_cfgs: Sequence[RunConfig], nums: Sequence[int] | None = None) -> list[AskedJob]:
    """The jobs of a command as sweep_index.place_jobs takes them: `composed`, their configs (hydra node included);
    `run_cfgs`, their configs as their tasks build them (job_config); `nums`, their places (by default 0, 1, ...)."""
    nums = range(len(composed)) if nums is None else nums
    return [AskedJob(run_identity(flatten_config(run_cfg)), [str(o) for o in cfg.hydra.overrides.task], num,
                     job_dir(cfg, num), functools.partial(job_dir, cfg))
            for num, cfg, run_cfg in zip(nums, composed, run_cfgs)]


def job_places(sweep_dir: str | os.PathLike, composed: dict[int, DictConfig], cfgs: dict[int, RunConfig | None]) -> dict[int, Place]:
    """Where normlab's launcher puts each job of a grid sweep run again in `sweep_dir` (sweep_index.place_jobs), by
    job number: `composed`, the jobs' configs as the launcher composed them; `cfgs`, their RunConfigs (None for a job
    whose config cannot be built: it lands in the dir of its place, and says why as it runs). {} for a new sweep."""
    runs = recorded_runs(sweep_dir)
    if not runs:
        return {}
    nums = [num for num in sorted(composed) if cfgs.get(num) is not None]
    before = HydraConfig.instance().cfg
    try:
        run_cfgs = [job_config(composed[num], cfgs[num]) for num in nums]
        jobs = asked_jobs([composed[num] for num in nums], run_cfgs, nums)
    finally:
        HydraConfig.instance().cfg = before
    return dict(zip(nums, place_jobs(sweep_dir, jobs, runs)))


def check_unswept(sweep_dir: Path, runs: Sequence[RecordedRun], run_cfgs: Sequence[RunConfig]) -> None:
    """ConfigError (one line) if a key that changes results and that neither the sweep's runs (`runs`' config.json)
    nor the command's jobs (`run_cfgs`) vary has one value in the sweep and another in the command."""
    recorded = [run for run in runs if run.flat is not None]
    flats = [flatten_config(cfg) for cfg in run_cfgs]
    if not recorded or not flats:
        return
    differ = []
    for key in sorted({key for flat in [*flats, *(r.flat for r in recorded)] for key in flat}):
        if is_bookkeeping(key):
            continue
        was = {run_identity({key: run.flat.get(key, ABSENT)}) for run in recorded}
        now = {run_identity({key: flat.get(key, ABSENT)}) for flat in flats}
        if len(was) == 1 and len(now) == 1 and was != now:
            differ.append((key, recorded[0].flat.get(key, ABSENT), flats[0].get(key, ABSENT)))
    if differ:
        changed = [(run.num if run.num is not None else "?", run.run_name, differ) for run in recorded]
        raise ConfigError(refusal(sweep_dir, changed, swept=True))


ABSENT = "<absent>"  # a key one side lacks (a config.json of an older normlab)


def _check_in_place(sweep_dir: Path, launcher: str, dirs: list[Path], positional: list[Path], run_cfgs: list[RunConfig]) -> None:
    """ConfigError (one line) unless each job lands, by its place in the command line (`positional`), where its run is
    (`dirs`): the one way `launcher` puts a job in a dir."""
    for num, (planned, placed, run_cfg) in enumerate(zip(dirs, positional, run_cfgs)):
        if planned == placed:
            continue
        if planned.is_dir():
            where = f"its run is the sweep's {planned.name}, but hydra/launcher={launcher} would train it in {placed.name}"
        else:
            where = f"it is new to the sweep, but hydra/launcher={launcher} would train it in {placed.name}, beside the sweep's jobs"
        raise ConfigError(f"hydra.sweep.dir={sweep_dir}: job {num} ({run_cfg.run_name}): {where}: that launcher puts each "
                          "job in the dir of its place in the command line; run this command with normlab's launcher (the "
                          f"default: drop hydra/launcher={launcher}), which finds each run wherever its dir is, or give the "
                          "sweep's jobs in the order they ran")


def _check_inside(sweep_dir: Path, dirs: list[Path], cfg: DictConfig) -> None:
    """ConfigError unless each of `dirs` lies below `sweep_dir` and no two are one."""
    subdir = f"hydra.sweep.subdir={cfg.hydra.sweep._get_node('subdir')._value()}"  # as typed, unresolved
    for num, path in enumerate(dirs):
        if sweep_dir not in path.parents:
            raise ConfigError(f"{subdir}: job {num}'s dir {path} is not inside the sweep dir {sweep_dir}: a sweep's "
                              "jobs are written, listed (normlab ls) and compared (normlab compare) there; give a "
                              "subdir below it, such as the default ${hydra.job.num}_${run_name:}")
    seen: dict[Path, int] = {}
    for num, path in enumerate(dirs):
        if path in seen:
            raise ConfigError(f"{subdir}: jobs {seen[path]} and {num} would share the dir {path}: each job needs "
                              "a dir of its own; put ${hydra.job.num} in the subdir, as the default "
                              "${hydra.job.num}_${run_name:} does")
        seen[path] = num


def refusal(sweep_dir: Path, changed: list[tuple[Any, str, list]], swept: bool = False) -> str:
    """The one line refusing a re-run sweep whose jobs `changed` ((number, run name, differences)) hold records of
    another config: the jobs, each key with its recorded value and the new one, and what to do instead. `swept`: the
    keys are ones neither the sweep nor the command sweeps (check_unswept), whose value a sweep keeps in every job."""
    named = [f"{num} ({name})" for num, name, _ in changed[:NAMED_JOBS]]
    if len(changed) > NAMED_JOBS:
        named.append(f"{len(changed) - NAMED_JOBS} more")
    differ: dict[str, tuple[Any, Any]] = {}
    for _, _, differences in changed:
        for key, was, now in differences:
            differ.setdefault(key, (was, now))
    recorded = " ".join(f"{key}={override_text(was)}" for key, (was, _) in differ.items())
    given = " ".join(f"{key}={override_text(now)}" for key, (_, now) in differ.items())
    jobs, their = ("job", "its") if len(changed) == 1 else ("jobs", "their")
    if swept:
        both = " ".join(f"{key}={override_text(was)},{override_text(now)}" for key, (was, now) in differ.items())
        keys = "key" if len(differ) == 1 else "keys"
        instead = (f"another hydra.sweep.dir for the new values (to add them to this sweep beside its own, sweep the "
                   f"{keys}: {both})")
    else:
        instead = f"another hydra.sweep.dir for the new values (overwrite=true trains the {jobs} afresh, deleting {their} records)"
    return (f"hydra.sweep.dir={sweep_dir}: {jobs} {_joined(named)} ran with {recorded} ({their} config.json), this "
            f"command gives {given}; a sweep run again continues each job as it ran, changing only bookkeeping keys "
            f"({', '.join(_bookkeeping_shown())}), so no job was run: give {recorded} to continue the sweep, or {instead}")


def _joined(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _bookkeeping_shown() -> list[str]:
    """The bookkeeping keys as a user writes them: a sub-config's as `ckpt.*`."""
    flat = flatten_config(RunConfig())
    return [f"{k}.*" if any(key.startswith(k + ".") for key in flat) else k for k in bookkeeping_keys()]
