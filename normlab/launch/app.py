"""The thin Hydra layer around `train(cfg, run_dir)`.

It composes the config from normlab's packaged conf/ (plus any --config-dir),
checks the command line before Hydra starts, validates each job's config, and
hands the run dir Hydra made to the training loop.

Under torchrun it joins the process group before Hydra starts and pins the run
dir's time stamp and id to rank 0's, so every rank uses one dir. It installs the
preemption handlers around each job and, once a preempted job's checkpoint is
saved, hands the signal on (to submitit's requeue, when there is one).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from normlab.launch import machine, overrides, rundir
from normlab.config import NORM_TRAITS, NORMS, PLACEMENTS, ConfigError, RunConfig, check_norm_knob, format_lr
from normlab.config.packing import pack_groups
from normlab.train.sinks import disk_full
from normlab.util.errors import PREFIX, fail

log = logging.getLogger("normlab")

CONFIG_MODULE = "normlab.conf"
CONFIG_GROUPS = ("model", "norm", "data", "tokenizer", "optim", "experiment")


def register_resolvers(stamp: tuple[float, str] | None = None) -> None:
    """Resolvers the packaged config uses: ${launch_time:FORMAT} and ${uid:} (the launch's time and
    id, which name its output dirs), ${lr_label:${lr}} and ${run_name:}.

    `stamp` = (unix time, id) pins the first two (torchrun ranks pass rank 0's); without it each
    process draws its own once. Both are cached, and Hydra copies the cache into every sweep job
    (and submitit pickles it with the launcher), so one launch, and a requeued job, keeps its dirs.
    """
    if stamp is not None or not OmegaConf.has_resolver("uid"):
        launched, uid = stamp or (time.time(), secrets.token_hex(3))
        OmegaConf.register_new_resolver("uid", lambda: uid, use_cache=True, replace=True)
        OmegaConf.register_new_resolver(
            "launch_time", lambda fmt: datetime.fromtimestamp(launched).strftime(fmt), use_cache=True, replace=True
        )
    if not OmegaConf.has_resolver("lr_label"):
        OmegaConf.register_new_resolver("lr_label", lambda lr: format_lr(float(lr)))
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", _run_name)


def _run_name(*, _root_: DictConfig) -> str:
    """${run_name:}: the job's run name (RunConfig.run_name), so run dirs and wandb runs share it."""
    raw = {
        key: OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        for key, value in _root_.items()
        if key != "hydra"  # the hydra node holds the dir being named
    }
    try:
        return RunConfig.from_dict(raw, validate=False).run_name
    except ConfigError:
        return "invalid-config"  # the job itself then stops with the one-line error


# A submitit job unpickles `_task` from this module and resolves the config there: it needs the resolvers too.
register_resolvers()


def group_options(group: str, config_dirs: list[str]) -> set[str]:
    """Option names of config group `group` in the packaged conf/ and in user config dirs."""
    names: set[str] = set()
    packaged = resources.files(CONFIG_MODULE) / group
    if packaged.is_dir():
        names |= {p.name[:-5] for p in packaged.iterdir() if p.name.endswith(".yaml")}
    for d in config_dirs:
        names |= {p.stem for p in (Path(d) / group).glob("*.yaml")}
    return names


def _check_value(key: str, value) -> None:
    if key == "placement" and value not in PLACEMENTS:
        raise ConfigError(f"placement={value!r} is not allowed: choose one of {', '.join(PLACEMENTS)}")
    if key == "norm.name" and value not in NORMS:
        raise ConfigError(f"norm.name={value!r} is not allowed: choose one of {', '.join(NORMS)}")
    if key == "lr" and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ConfigError(f"lr={value!r}: must be a positive number")
    if key == "depth" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ConfigError(f"depth={value!r}: must be an integer >= 1")
    if key == "telemetry.every" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ConfigError(f"telemetry.every={value!r}: must be an integer >= 0 (0 turns telemetry off)")


def _plain_values(override) -> list:
    """The values one override sets without a config loader: its value, or a choice/range sweep's values.
    Sweeps that need the sweeper (glob, interval) give none here: check_jobs checks their jobs."""
    if not override.is_sweep_override():
        return [override.value()]
    try:
        return list(override.sweep_iterator())
    except Exception:  # glob() lists a group's options through the config loader; interval() is not a list
        return []


def check_values(overrides, config_dirs: list[str]) -> None:
    """Reject unknown config-group options and bad top-level values among parsed `overrides`
    (their plain values; see _plain_values). Raises ConfigError naming the value and what is allowed."""
    for override in overrides:
        key = override.key_or_group
        if override.is_delete() or key == "resume":
            continue
        for value in _plain_values(override):
            if key in CONFIG_GROUPS:
                known = group_options(key, config_dirs)
                if value not in known:
                    raise ConfigError(f"{key}={value!r} is not a known option: choose one of {', '.join(sorted(known))}")
            else:
                _check_value(key, value)


def precheck(overrides: list[str], config_dirs: list[str], multirun: bool = False) -> list[str]:
    """Reject unknown group options, bad values and bad resume paths on the command line before Hydra starts.

    Sweep values that only Hydra's sweeper can list (glob, interval) are checked per job by check_jobs.
    Returns overrides to add: `resume=PATH` continues that checkpoint's run in its own dir, so
    unless `hydra.run.dir` is given, one pointing there.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from normlab.train.checkpoint import Checkpoint, CheckpointError, find_checkpoint, run_dir_of

    parsed = OverridesParser.create().parse_overrides(overrides)
    check_values(parsed, config_dirs)
    extra: list[str] = []
    for override in (o for o in parsed if o.key_or_group == "resume" and not o.is_delete()):
        values = _plain_values(override)
        paths = [v for v in values if v is not None and v != "auto"]
        if paths and (multirun or len(values) > 1):
            raise ConfigError(f"resume={paths[0]}: a checkpoint path resumes one run, not a sweep: use resume=auto")
        for path in paths:
            if not isinstance(path, str) or not path.strip():
                raise ConfigError(f"resume={path!r}: choose null, auto or a checkpoint path")
            try:
                checkpoint = find_checkpoint(path)
                Checkpoint.load(checkpoint)  # a bad file stops here, before Hydra makes a run dir
            except CheckpointError as err:
                raise ConfigError(str(err)) from None
            run_dir = run_dir_of(checkpoint)
            if run_dir is not None and not any(o.key_or_group == "hydra.run.dir" for o in parsed):
                extra.append("hydra.run.dir=" + _quoted(str(run_dir)))
    return extra


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_jobs(overrides: list[str], config_loader=None) -> list[list[str]]:
    """The override lists of the jobs Hydra's BasicSweeper launches for `overrides` (its sweeper params
    first), expanded by the sweeper's own split logic: choice, range and, given the config loader, glob.
    Raises ConfigError for a sweep the basic sweeper cannot expand (interval: a search sweeper's)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(overrides)
    try:
        [jobs] = BasicSweeper.split_arguments(parsed, None)
    except HydraException as err:
        swept = next(o for o in parsed if o.is_sweep_override() and not o.is_discrete_sweep())
        raise ConfigError(f"{swept.input_line}: {err}; a search sweeper expands it (hydra/sweeper=lr_search or optuna)") from None
    return jobs


def _search_sweep_checks(parser, overrides: list[str], config_dirs: list[str]) -> list[list[str]]:
    """For a search sweeper (Optuna), which draws its trials as it goes: check each listed value of the
    discrete sweeps on its own, and return the one job of the fixed part to compose. Each trial's whole
    config is checked as the trial starts (_task), before anything heavy."""
    parsed = parser.parse_overrides(overrides)
    for override in parsed:
        if override.is_discrete_sweep():
            for value in override.sweep_string_iterator():
                check_values(parser.parse_overrides([f"{override.get_key_element()}={value}"]), config_dirs)
    return [[o.input_line for o in parsed if not o.is_sweep_override()]]


def check_jobs(overrides: list[str], config_dirs: list[str], multirun: bool, composed: dict | None = None) -> None:
    """Compose every job the command line asks for and validate its whole config.

    So a bad value in a sweep list, or a combination that makes no sense (placement=deepnorm with
    norm=none, ...), stops the command before any job runs, instead of aborting a sweep halfway.
    A multirun's jobs are those the configured sweeper makes: the basic sweeper's are expanded by its
    own split logic (with the sweeps a preset puts in hydra.sweeper.params); a search sweeper's fixed
    part is checked here and each trial as it starts. A `norm.KNOB=...` override must name a knob that
    each job's norm reads. Jobs with pack=true must be packable (check_packing). Raises ConfigError
    naming the first bad job. A config Hydra itself cannot compose is left for Hydra to report when it runs.
    `composed`: configs already composed (overrides.check_composition's `by_job`), reused for the jobs they match.
    """
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    # The search path `normlab train` gets: the packaged conf/, then any --config-dir, as Hydra adds it.
    search_path = create_config_search_path("pkg://" + CONFIG_MODULE)
    for d in config_dirs:
        search_path.prepend("command-line", f"file://{Path(d).absolute()}", anchor=SearchPathQuery(provider="schema"))
    plugins: dict[str, str] = {}  # a multirun's hydra/launcher and hydra/sweeper: choice, _target_
    try:
        hydra = Hydra.create_main_hydra2(task_name="normlab", config_search_path=search_path)
        jobs = [list(overrides)]
        if multirun:
            forced = _norm_knob_overrides(list(overrides))[1]
            sweep_cfg = hydra.compose_config("config", forced, run_mode=RunMode.MULTIRUN, from_shell=True)
            for plugin in ("launcher", "sweeper"):
                plugins[plugin] = sweep_cfg.hydra.runtime.choices.get(f"hydra/{plugin}")
                plugins[plugin + "_target"] = sweep_cfg.hydra[plugin].get("_target_")
            params = [f"{k}={v}" for k, v in (sweep_cfg.hydra.sweeper.get("params") or {}).items()]
            if sweep_cfg.hydra.sweeper.get("_target_") == BASIC_SWEEPER:
                jobs = sweep_jobs(params + list(overrides), hydra.config_loader)
            else:
                jobs = _search_sweep_checks(OverridesParser.create(config_loader=hydra.config_loader), list(overrides), config_dirs)
        cfgs = [_check_job(hydra, job, config_dirs, multirun, RunConfig, composed or {}) for job in jobs]
    except ConfigError:
        raise
    except Exception:
        return  # Hydra reports what it cannot compose in its own words when it runs
    finally:
        GlobalHydra.instance().clear()
    check_packing(cfgs, plugins)


NORMLAB_LAUNCHER = "hydra_plugins.normlab_launcher.normlab_launcher.NormlabLauncher"


def check_packing(cfgs: list, plugins: dict[str, str]) -> None:
    """ConfigError (one line) unless the jobs `cfgs` (RunConfigs) that ask for pack=true can train as packs:
    in a multirun only normlab's launcher packs (another would train them unpacked, silently) and only a
    grid sweep's jobs (Hydra's basic sweeper; a search sweeper launches a trial or two at a time), and each
    pack must be one that normlab.train.pack.check_pack accepts (it refuses torchrun, fp16, compile=true, ...).
    `plugins` holds a multirun's launcher and sweeper (check_jobs); {} for a single run."""
    if not any(cfg.pack for cfg in cfgs):
        return
    if plugins and plugins["launcher_target"] != NORMLAB_LAUNCHER:
        raise ConfigError(f"pack=true with hydra/launcher={plugins['launcher']}: only normlab's launcher "
                          "(hydra/launcher=normlab, the default) packs a sweep's jobs; drop pack=true to run them unpacked")
    if plugins and plugins["sweeper_target"] != BASIC_SWEEPER:
        raise ConfigError(f"pack=true with hydra/sweeper={plugins['sweeper']}: only a grid sweep's jobs (Hydra's basic "
                          "sweeper) are packed, a search sweeper launches its trials one batch at a time; drop pack=true")
    from normlab.train.pack import check_pack

    for group in pack_groups(cfgs):
        if cfgs[group[0]].pack:
            check_pack([cfgs[i] for i in group])


def _norm_knob_overrides(job: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """The `norm.KNOB=VALUE` overrides of `job` as (knob, value), and `job` with them forced (`++`).

    Forced, they compose even where the chosen norm's file lacks the knob (Hydra would stop with its
    own multi-line error), so `check_jobs` can say in one line which knobs that norm has.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    knobs, forced = [], []
    for text, override in zip(job, OverridesParser.create().parse_overrides(job)):
        key = override.key_or_group
        if key.startswith("norm.") and key != "norm.name" and not override.is_delete() and override.package is None:
            value = text.split("=", 1)[1]  # as typed: norm.weight=false, not False
            knobs.append((key[len("norm.") :], value))
            text = f"++{key}={value}"
        forced.append(text)
    return knobs, forced


def _check_job(hydra, job: list[str], config_dirs: list[str], multirun: bool, run_config, composed: dict):
    """Check one job's values, compose its config (or take it from `composed`, by the overrides it was
    composed with) and validate it; returns its RunConfig. ConfigError names the job in a sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    where = f" (in the sweep's job {' '.join(job)})" if multirun else ""
    try:
        check_values(OverridesParser.create().parse_overrides(job), config_dirs)
        knobs, forced = _norm_knob_overrides(job)
        cfg = composed.get(tuple(forced)) or hydra.compose_config("config", forced, run_mode=RunMode.RUN, from_shell=True)
        raw = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]), resolve=True)
        if raw.get("norm", {}).get("name") in NORM_TRAITS:
            for knob, value in knobs:
                check_norm_knob(raw["norm"]["name"], knob, value)
        return run_config.from_dict(raw)
    except ConfigError as err:
        raise ConfigError(f"{err}{where}") from None


def run_train(argv: list[str]) -> int:
    """`normlab train ARGS`: run Hydra with ARGS; returns the process exit code."""
    from hydra._internal.utils import get_args_parser

    argv = [_experiment_override(arg) for arg in argv]
    if "--version" in argv:  # Hydra's own --version would print Hydra's
        from normlab import __version__

        print(f"normlab {__version__}")
        return 0
    parser = get_args_parser()
    parser.error = _refuse_arguments
    args = parser.parse_args(argv)
    if args.shell_completion:
        return _shell_completion(argv)
    if args.help or args.hydra_help:
        # Help needs Hydra alone: importing torch (through distributed) would cost seconds.
        sys.argv = ["normlab train", *argv]
        _hydra_main()
        return 0

    config_dirs = [args.config_dir] if args.config_dir else []
    try:
        overrides.check_command_line(args.overrides, config_dirs, args.multirun, CONFIG_MODULE, args.config_name)
        added = precheck(args.overrides, config_dirs, multirun=args.multirun)
        argv = [*argv, *added]
        by_job: dict = {}
        composed = overrides.check_composition(
            [*args.overrides, *added], config_dirs, CONFIG_MODULE, args.config_name, sweep_jobs if args.multirun else None,
            by_job=by_job,
        )
        check_jobs(args.overrides, config_dirs, args.multirun, composed=by_job if args.config_name in (None, "config") else None)
        machine.check_machine(composed, args.multirun, local=not _on_cluster(args.overrides), units_of=pack_groups)
    except ConfigError as err:
        return fail(err)
    except Exception as err:  # Hydra's override grammar: one line is enough
        return fail(f"could not parse the overrides: {str(err).splitlines()[0]}")
    if args.multirun and any(o.startswith("hydra/launcher=") for o in args.overrides):
        refusal = _slurm_preflight(args.overrides, config_dirs)
        if refusal:
            return fail(refusal)

    from normlab.train import distributed

    if distributed.init_from_env():
        # Ranks may start seconds apart: all take rank 0's time stamp and id, hence its dirs.
        register_resolvers(distributed.broadcast_object((time.time(), secrets.token_hex(3))))
        if not distributed.is_main():
            argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]  # rank 0 writes the run dir's files
    sys.argv = ["normlab train", *argv]
    _register_launcher()
    try:
        # A single run's dir is locked and its resume checked before Hydra writes into it (normlab.launch.rundir).
        guard = rundir.claim([*args.overrides, *added], config_dirs, CONFIG_MODULE)
        with guard if not args.multirun and distributed.is_main() else contextlib.nullcontext():
            _hydra_main()
    except ConfigError as err:
        return fail(err)
    finally:
        distributed.shutdown()
    return 0


def _refuse_arguments(message: str) -> None:
    """Hydra's argument parser refuses the command line: one line instead of its usage text."""
    stray = message.partition("unrecognized arguments:")[2].split()
    if stray and all("=" in arg for arg in stray):  # overrides after an option: argparse takes overrides only once
        hint = ": put -m and other options before the overrides (normlab train -m lr=1e-3,3e-3 norm=rms)"
    else:
        hint = ": `normlab train --help` lists the options"
    sys.exit(fail(f"train: {message}{hint}"))


def _on_cluster(overrides: list[str]) -> bool:
    """Whether the jobs run elsewhere, through a SLURM launcher: this machine's device and memory are not theirs."""
    return any(o.startswith("hydra/launcher=") and "slurm" in o for o in overrides)


COMMANDS = ("train", "compare", "sample")


def _shell_completion(argv: list[str]) -> int:
    """`normlab train -sc install=bash` (or `normlab -sc ...`): Hydra's completion, installed for the
    `normlab` command. The shell then asks `normlab -sc query=bash` with its line, 'normlab train
    norm=r': Hydra completes the line after 'train'; on the command's own word it offers the commands."""
    line = os.environ.get("COMP_LINE")
    if line is not None:
        words = line.split()
        if len(words) < 2 or (len(words) == 2 and not line.endswith(" ")):
            print(" ".join(COMMANDS))
            return 0
        if words[1] != "train":
            return 0  # compare and sample take paths: the shell's own file completion applies
        os.environ["COMP_LINE"] = line.replace(" train", "", 1)
    sys.argv = ["normlab", *argv]
    _hydra_main()
    return 0


def _slurm_preflight(overrides: list[str], config_dirs: list[str]) -> str | None:
    """For a sweep on submitit's SLURM launcher: SLURM's refusal of its settings as one line, else None
    (and submitit's repeated sacct warnings shown once)."""
    from normlab.launch import slurm

    launcher = slurm.launcher_config(CONFIG_MODULE, overrides, config_dirs)
    if launcher is None:
        return None
    refusal = slurm.preflight(launcher)
    if refusal is None:
        slurm.quiet_sacct()
    return refusal


def _register_launcher() -> None:
    """Make normlab's launcher (hydra/launcher=normlab, the default) known to Hydra. Hydra finds plugins by
    walking the hydra_plugins package, which misses one in an editable install (`pip install -e .`)."""
    from hydra.core.plugins import Plugins
    from hydra_plugins.normlab_launcher.normlab_launcher import NormlabLauncher

    Plugins.instance().register(NormlabLauncher)


def _experiment_override(arg: str) -> str:
    """`+experiment=NAME` as `experiment=NAME`: the defaults list has an experiment slot (null), so Hydra
    would refuse to append one; lightning-hydra-template users type it either way."""
    return arg[1:] if arg.startswith("+experiment=") else arg


def _stop(err) -> float:
    """Bad input found by a job: one line, then exit code 2. In a submitit job (one task of a SLURM array)
    the job stops alone and the sweep goes on: it returns NaN, as a failed arm does, since submitit
    records no result for a job that exits, and its launcher would wait for one."""
    code = fail(err)
    if os.environ.get("SUBMITIT_EXECUTOR"):
        log.error("%s", err)
        return math.nan
    sys.exit(code)


def _task(cfg: DictConfig) -> float:
    """One Hydra job. Returns the final validation loss (NaN when diverged or failed) for sweepers to optimize."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from normlab.train import distributed, preempt

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun:
        settle_garbage()
    if not distributed.is_active() and distributed.init_from_env():  # a SLURM job of several tasks
        atexit.register(distributed.shutdown)
    try:
        run_cfg = job_config(cfg)
    except ConfigError as err:
        return _stop(err)

    from normlab.train.checkpoint import CheckpointError
    from normlab.data import DataError
    from normlab.train.sinks import RunDirBusy, WandbUnavailable
    from normlab.train.run import run_name, train

    name, output_dir = run_name(run_cfg), hc.runtime.output_dir
    ended = ended_loss(run_cfg, output_dir)
    if ended is not None:
        return ended
    try:
        with preempt.watch() as previous_handlers:
            summary = train(run_cfg, output_dir)
    except RunDirBusy as err:
        return _stop(err) if not multirun else _job_failed(hc, run_cfg, err, recorded=True)
    except (DataError, CheckpointError, ConfigError, WandbUnavailable) as err:  # bad input, like a bad config value: one line, not a traceback
        if not multirun:
            return _stop(err)
        # train() has recorded a data error; a refused checkpoint left the job's dir as it was until now.
        return _job_failed(hc, run_cfg, err, recorded=isinstance(err, DataError))
    except preempt.Preempted as stop:
        log.warning("%s: %s; resume=auto in this run dir continues it", name, stop)
        print(f"normlab: {name} {stop.status}: {stop}; resume=auto in {output_dir} continues it", file=sys.stderr)
        preempt.chain(stop.signum, previous_handlers)
    except Exception as err:
        if not multirun and not disk_full(err):
            raise
        return _job_failed(hc, run_cfg, err, recorded=True)
    return summary["final_val_loss"]


def settle_garbage() -> None:
    """Before a sweep's job: collect what the jobs before it left; before the process's first, also exempt
    everything then alive from later collections. A sweep's process holds some 370k objects of torch,
    wandb, Hydra and matplotlib, and each job allocates enough to set off about one full collection, which
    walks them all (0.4 s on a 2-core CPU); frozen, they are walked no more. Frozen once, not at every job,
    so what a job leaves is still collected and the frozen set does not grow with the sweep; normlab's
    launcher unfreezes it when the sweep ends."""
    gc.collect()
    if not gc.get_freeze_count():
        gc.freeze()


def job_config(cfg: DictConfig) -> RunConfig:
    """The RunConfig of the Hydra job running now (HydraConfig is set): `cfg` resolved and validated, with
    the job's overrides for wandb's config and, in a multirun, the sweep's wandb group unless one is set.
    Raises ConfigError (one line) for a config that cannot be trained."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from normlab.train import distributed

    hc = HydraConfig.get()
    run_cfg = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    distributed.check_batch_split(run_cfg)
    run_cfg.wandb.overrides = list(hc.overrides.task)
    if hc.mode == RunMode.MULTIRUN and run_cfg.wandb.group is None:
        run_cfg.wandb.group = sweep_group(hc)
    return run_cfg


def ended_loss(run_cfg: RunConfig, output_dir: str) -> float | None:
    """For a job whose run already ended in `output_dir` with this config (checkpoint.ended_run): one line
    on stderr saying it is not trained again, and its final validation loss (NaN if it has none); else None."""
    from normlab.train.checkpoint import ended_run
    from normlab.train.run import run_name

    ended = ended_run(run_cfg, output_dir)
    if ended is None:
        return None
    # A re-run sweep: the job is done, and a second wandb run would only confuse its records.
    print(f"normlab: {run_name(run_cfg)} already {ended['status']} in {output_dir}: not trained again "
          "(overwrite=true trains it afresh)", file=sys.stderr)
    return rundir.final_loss(ended)


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
    RunConfig, as `_task` builds it, and whether its run already ended. A bad config stops as in `_task`."""
    from hydra.core.hydra_config import HydraConfig

    output_dir = HydraConfig.get().runtime.output_dir
    try:
        run_cfg = job_config(cfg)
    except ConfigError as err:
        _stop(err)
        raise
    return PackMember(run_cfg, output_dir, ended_loss(run_cfg, output_dir))


def train_members(members: list[PackMember]) -> None:
    """Train the `members` whose runs have not ended as one pack (normlab.train.pack.train_pack), and give each
    its summary, or the error that stopped the pack. A preemption stops the pack as it stops a job (`_task`)."""
    from normlab.train import preempt
    from normlab.train.pack import train_pack
    from normlab.train.sinks import RunDirBusy
    from normlab.launch.sweep_log import read_summary
    from normlab.train.run import run_name

    training = [m for m in members if m.ended is None]
    if not training:
        return
    try:
        with preempt.watch() as previous_handlers:
            summaries = train_pack([(m.cfg, m.run_dir) for m in training])
    except preempt.Preempted as stop:
        names = ", ".join(run_name(m.cfg) for m in training)
        again = f"the sweep run again with hydra.sweep.dir={Path(training[0].run_dir).parent} resumes it (resume=auto)"
        log.warning("pack of %s: %s; %s", names, stop, again)
        print(f"normlab: pack of {names} {stop.status}: {stop}; {again}", file=sys.stderr)
        preempt.chain(stop.signum, previous_handlers)
        raise
    except Exception as err:
        for m in training:
            # train_pack records its failure in every summary.json; a busy run dir is another process's to write.
            recorded = (read_summary(Path(m.run_dir)) or {}).get("error") == f"{type(err).__name__}: {err}"
            m.error, m.recorded = err, recorded or isinstance(err, RunDirBusy)
        return
    for m, summary in zip(training, summaries):
        m.summary = summary


def member_result(member: PackMember) -> float:
    """A pack's job as Hydra runs it after the pack trained (inside a task function): what `_task` returns
    for it, the final validation loss (NaN if diverged), or for a failed pack what a failed job gives
    (`_job_failed`: one line, NaN, or the end of the sweep under fail_fast)."""
    from hydra.core.hydra_config import HydraConfig

    if member.ended is not None:
        return member.ended
    if member.error is not None:
        return _job_failed(HydraConfig.get(), member.cfg, member.error, recorded=member.recorded)
    return member.summary["final_val_loss"]


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
    from hydra.core.override_parser.overrides_parser import OverridesParser

    task = OmegaConf.load(multirun_yaml).hydra.overrides.task
    return tuple(o.get_key_element() for o in OverridesParser.create().parse_overrides(list(task)) if o.is_sweep_override())


def _job_failed(hc, run_cfg, err: BaseException, recorded: bool) -> float:
    """A job that failed: one line on stderr (and the traceback in the job's log), its summary.json
    recorded unless `recorded` already; the sweep goes on (NaN for the sweeper) unless fail_fast, and
    a single run exits 1."""
    from hydra.types import RunMode

    from normlab.train.run import run_name

    if not recorded:
        rundir.record_failure(hc.runtime.output_dir, run_cfg, err)
    name, multirun = run_name(run_cfg), hc.mode == RunMode.MULTIRUN
    what = f"the disk is full ({err})" if disk_full(err) else f"{type(err).__name__}: {err}"
    log.error("job %s failed: %s", name, what, exc_info=None if disk_full(err) else err)
    print(f"{PREFIX}job {hc.job.num} ({name}) failed: {what}" if multirun else f"{PREFIX}{name} failed: {what}",
          file=sys.stderr)
    if not multirun or run_cfg.fail_fast:
        # SystemExit passes through Hydra's per-job exception capture, so no further job starts.
        sys.exit(1)
    return math.nan  # one failed arm must not end the sweep


def _hydra_main() -> None:
    import hydra

    hydra.main(version_base="1.3", config_path="pkg://" + CONFIG_MODULE, config_name="config")(_task)()
