"""A sweep's job dirs, checked before any job runs (prechecks.check_jobs): each inside the sweep dir, each its own,
and, in a sweep run again in its dir (hydra.sweep.dir=S), none holding the records of another config.

A re-run sweep continues each job as it ran: a job whose run ended is not trained again, a stopped one resumes.
A command that would give a job with records (its config.json) another value of a key that changes results
(any key but the schema's bookkeeping ones) is refused whole, in one line naming the jobs and the keys, before
Hydra writes anything: the jobs that never started do not run either, since a sweep whose arms ran with two
values of a key it does not sweep compares nothing. `changed_records` is the same test for one run dir.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from normlab.config import ConfigError, RunConfig, bookkeeping_keys, flatten_config
from normlab.config.parse import override_text
from normlab.launch.paths import from_launch_dir

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


def check_sweep_dirs(composed: list[DictConfig], cfgs: list[RunConfig]) -> None:
    """ConfigError (one line) unless every job of a grid sweep (`composed`: their configs in Hydra's order, hydra
    node included; `cfgs`: their RunConfigs) has a dir of its own inside the sweep dir, and none of those dirs
    holds the records of another config (changed_records)."""
    if not composed:
        return
    sweep_dir = Path(os.path.abspath(str(OmegaConf.select(composed[0], "hydra.sweep.dir"))))
    dirs = [job_dir(cfg, num) for num, cfg in enumerate(composed)]
    _check_inside(sweep_dir, dirs, composed[0])
    if not sweep_dir.is_dir():
        return  # a new sweep: nothing recorded yet
    changed = []
    for num, (path, cfg, run_cfg) in enumerate(zip(dirs, composed, cfgs)):
        differ = changed_records(job_config(cfg, run_cfg), path) if path.is_dir() else []
        if differ:
            changed.append((num, run_cfg.run_name, differ))
    if changed:
        raise ConfigError(refusal(sweep_dir, changed))


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


def refusal(sweep_dir: Path, changed: list[tuple[int, str, list]]) -> str:
    """The one line refusing a re-run sweep whose jobs `changed` ((number, run name, differences)) hold records of
    another config: the jobs, each key with its recorded value and the new one, and what to do instead."""
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
    return (f"hydra.sweep.dir={sweep_dir}: {jobs} {_joined(named)} ran with {recorded} ({their} config.json), this "
            f"command gives {given}; a sweep run again continues each job as it ran, changing only bookkeeping keys "
            f"({', '.join(_bookkeeping_shown())}), so no job was run: give {recorded} to continue the sweep, or "
            f"another hydra.sweep.dir for the new values (overwrite=true trains the {jobs} afresh, deleting "
            f"{their} records)")


def _joined(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _bookkeeping_shown() -> list[str]:
    """The bookkeeping keys as a user writes them: a sub-config's as `ckpt.*`."""
    flat = flatten_config(RunConfig())
    return [f"{k}.*" if any(key.startswith(k + ".") for key in flat) else k for k in bookkeeping_keys()]
