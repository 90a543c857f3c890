"""The Hydra layer's guard of a run dir: refusals before Hydra writes anything, and failures on record.

Hydra writes <run dir>/.hydra/ (config.yaml, which `normlab compare` reads) before normlab's task
runs, so a refusal that only train() found would come after those writes. `claim()` composes a
single run's config as Hydra will and, when its run dir already exists, takes the run dir's lock
(held until Hydra returns) and checks the resume (checkpoint.resolve_resume, then a dry restore, then the
corpus against the checkpoint's): another process's run, a checkpoint that does not fit, data that changed
or cannot be read, and another config's records are all refused while the run dir is as it was. train() checks the same again, for callers without Hydra.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from normlab.config import ConfigError, RunConfig, flatten_config
from normlab.launch.paths import from_launch_dir
from normlab.launch.resume import with_continue_command
from normlab.launch.sweep_dirs import changed_records
from normlab.train.sinks import RunDir, RunDirBusy


def compose_run(overrides: list[str], config_dirs: list[str], config_module: str,
                config_name: str | None = None) -> tuple[RunConfig, Path] | None:
    """The config and run dir Hydra will give the single run `overrides` asks for (as its task builds it:
    task.job_config); None if Hydra cannot compose it or the config is invalid (Hydra and the config check
    then say so in their own words)."""
    search_path = create_config_search_path("pkg://" + config_module)
    for d in config_dirs:
        search_path.prepend("command-line", f"file://{Path(d).absolute()}", anchor=SearchPathQuery(provider="schema"))
    try:
        hydra = Hydra.create_main_hydra2(task_name="normlab", config_search_path=search_path)
        cfg = hydra.compose_config(config_name or "config", overrides, run_mode=RunMode.RUN, from_shell=True)
        run_dir = Path(str(cfg.hydra.run.dir))
        chdir = bool(cfg.hydra.job.chdir)
        with open_dict(cfg):
            del cfg["hydra"]
        raw = OmegaConf.to_container(cfg, resolve=True)
        return RunConfig.from_dict(from_launch_dir(raw, os.getcwd()) if chdir else raw), run_dir
    except Exception:
        return None
    finally:
        GlobalHydra.instance().clear()


# Whether the single run this process launched (claim) trains in a dir Hydra makes for it, one that did not exist.
_new_run_dir = False


def discard_unstarted(run_dir: str | os.PathLike) -> bool:
    """Remove `run_dir` if this process's launch made it (claim) and the run was refused before it recorded
    anything (no metrics row, no checkpoint): what is in it (Hydra's .hydra/ and normlab.log, a failed
    summary.json) was written for a run that never started. A dir that existed before is never removed.
    Returns whether it was removed."""
    from normlab.train.checkpoint import holds_records, list_checkpoints  # torch: not for `normlab train --help`

    path = Path(run_dir)
    if not _new_run_dir or not path.is_dir() or holds_records(path) or list_checkpoints(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not path.exists()


class RunEnded(Exception):
    """The run a single `normlab train` asks for already ended in its run dir: nothing to train, and Hydra
    must not start (it would rewrite the dir's .hydra/). The message is the line that says so."""


@contextlib.contextmanager
def claim(overrides: list[str], config_dirs: list[str], config_module: str, config_name: str | None = None):
    """For a single run whose run dir exists: hold its lock for the duration, after checking that the
    run may start there. Raises ConfigError (one line) for what would refuse it, and RunEnded for a run
    that already ended there, both before Hydra writes. For the duration, discard_unstarted knows whether
    the run dir is one Hydra makes for this run."""
    global _new_run_dir
    with _claimed(overrides, config_dirs, config_module, config_name) as new:
        _new_run_dir = new
        try:
            yield
        finally:
            _new_run_dir = False


@contextlib.contextmanager
def _claimed(overrides: list[str], config_dirs: list[str], config_module: str, config_name: str | None):
    """claim(), yielding whether the run dir is a new one."""
    # torch: not for `normlab train --help`, which imports this module
    from normlab.data import DataError
    from normlab.train.checkpoint import CheckpointError, ended_run, resolve_resume
    from normlab.train.run import check_resumable, check_same_corpus

    if not config_dirs and not any(o.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for o in overrides):
        yield True  # the packaged config names each run's dir by its launch time and id: a new dir
        return
    composed = compose_run(overrides, config_dirs, config_module, config_name)
    if composed is None or not composed[1].is_dir():
        yield composed is not None  # a new run dir: nothing in it to protect (where Hydra puts it, if it can)
        return
    cfg, path = composed
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(RunDir(path).lock())
            ended = ended_run(cfg, path)
            if ended is not None:
                raise RunEnded(ended_line(cfg, path, ended, not_applied(overrides, cfg, path)))
            checkpoint = resolve_resume(cfg, path)
            if checkpoint is not None:
                check_resumable(cfg, checkpoint)
                check_same_corpus(cfg, checkpoint)
        except (RunDirBusy, CheckpointError, DataError) as err:
            raise ConfigError(str(with_continue_command(err))) from None
        yield False


def ended_line(cfg: RunConfig, run_dir: str | os.PathLike, ended: dict[str, Any], ignored: list[str] = ()) -> str:
    """The line for a run that already ended in `run_dir` (its summary `ended`): not trained again, and the
    command line's overrides that were therefore not applied (`ignored`)."""
    from normlab.train.checkpoint import ended_message  # torch: not for `normlab train --help`

    return ended_message(cfg, run_dir, ended) + (f"; not applied: {' '.join(ignored)}" if ignored else "")


def not_applied(overrides: list[str], cfg: RunConfig, run_dir: Path) -> list[str]:
    """The overrides of `overrides` that would change the config the run in `run_dir` ended with (its
    config.json): bookkeeping keys only, since anything else is another run. How it was started
    (resume=, overwrite=) and Hydra's own settings are left out."""
    try:
        saved = flatten_config(json.loads((run_dir / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return []
    now = flatten_config(cfg)
    changed = {k for k in set(saved) | set(now) if saved.get(k) != now.get(k)}
    ignored = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra.") or key in ("resume", "overwrite", "wandb.overrides"):
            continue
        if any(k == key or k.startswith(key + ".") for k in changed):
            ignored.append(override)
    return ignored


def record_failure(run_dir: str | os.PathLike, cfg: RunConfig, err: BaseException) -> None:
    """summary.json of a sweep job that could not start (status failed, with the error), so the sweep's
    records say what happened to it; metrics and checkpoints stay as they were. Not where `run_dir` holds the
    records of another config (sweep_dirs.changed_records): its summary.json is that run's, and stays."""
    from normlab.train.run import summary_head  # torch: not for `normlab train --help`, which imports this module

    if changed_records(cfg, run_dir):
        return
    RunDir(run_dir).write_summary({**summary_head(cfg), "status": "failed", "error": f"{type(err).__name__}: {err}"})


def final_loss(summary: dict[str, Any]) -> float:
    """A summary's final validation loss for a sweeper (NaN where it has none: diverged, or failed)."""
    value = summary.get("final_val_loss")
    return float(value) if isinstance(value, (int, float)) else math.nan
