"""What `normlab train` checks before Hydra starts, so that a mistake stops the command in one line
before any job runs: `check_command` runs every check, cheapest first.

Besides normlab.launch.overrides' checks of the command line and of each job's composition, these are:
the values of config groups and top-level keys (check_values), resume paths (precheck), every job a
sweep launches, as the configured sweeper expands it (sweep_jobs), composed and validated whole
(check_jobs, with `norm.KNOB=...` overrides forced so that a knob the norm lacks is named in one line),
a grid sweep's job dirs (sweep_dirs.check_sweep_dirs: inside the sweep dir, and in a sweep run again, each job where
its run is, with the sweep's values of the keys neither sweeps) and packs (check_packing). All raise ConfigError.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode

from normlab.config import NORM_TRAITS, NORMS, PLACEMENTS, ConfigError, RunConfig, check_norm_knob
from normlab.config.parse import override_text
from normlab.config.packing import check_packable, pack_groups
from normlab.launch.machine import check_launcher, check_machine, cpu_for_sure
from normlab.launch.overrides import check_command_line, check_composition, quoted_value
from normlab.launch.resolvers import task_dict
from normlab.launch.resume import with_continue_command
from normlab.launch.sweep_dirs import check_sweep_dirs
from normlab.launch.sweep_index import BASIC_SWEEPER

CONFIG_MODULE = "normlab.conf"
CONFIG_GROUPS = ("model", "norm", "data", "tokenizer", "optim", "experiment")
NORMLAB_LAUNCHER = "hydra_plugins.normlab_launcher.normlab_launcher.NormlabLauncher"


def check_command(overrides: list[str], config_dirs: list[str], multirun: bool, config_name: str | None) -> list[str]:
    """Everything `normlab train OVERRIDES` checks before Hydra starts, cheapest first: the command line
    alone (overrides.check_command_line), its values and resume paths (precheck), each job's composition
    (overrides.check_composition) and whole config (check_jobs), then whether this machine can run the
    jobs (machine.check_machine; not for jobs a SLURM launcher runs elsewhere). Raises ConfigError.
    Returns the overrides to add (precheck's)."""
    check_command_line(overrides, config_dirs, multirun, CONFIG_MODULE, config_name)
    added = precheck(overrides, config_dirs, multirun=multirun)
    by_job: dict = {}
    composed = check_composition(
        [*overrides, *added], config_dirs, CONFIG_MODULE, config_name, sweep_jobs if multirun else None, by_job=by_job,
    )
    if not multirun:
        check_not_a_sweep(composed[0], overrides)
    check_jobs(overrides, config_dirs, multirun, composed=by_job if config_name in (None, "config") else None)
    check_machine(composed, multirun, local=not on_cluster(overrides), units_of=pack_groups)
    return added


def check_not_a_sweep(cfg, overrides: list[str]) -> None:
    """ConfigError (one line) for a single run whose config holds a sweep (a preset's hydra.sweeper.params)
    that the command line does not pin: without -m Hydra would silently train one job with the preset's
    other values. A command that gives a value to every swept key (one job of the sweep: what a sweep job's
    saved overrides replay) is a single run."""
    params = dict(cfg.hydra.sweeper.get("params") or {})
    given = {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)}
    if not params or set(params) <= given:
        return
    preset = cfg.hydra.runtime.choices.get("experiment")
    holder = f"experiment={preset}" if preset else "the config"
    jobs = sweep_jobs([f"{k}={v}" for k, v in params.items()])
    one = " ".join(o for o in jobs[0] if o.split("=", 1)[0] not in given)
    raise ConfigError(f"{holder} holds a sweep of {len(jobs)} jobs over {', '.join(params)}: add -m to run it "
                      f"(normlab train -m {' '.join(overrides)}), or give {one} to train one of its jobs")


def on_cluster(overrides: list[str]) -> bool:
    """Whether the jobs run elsewhere, through a SLURM launcher: this machine's device and memory are not theirs."""
    return any(o.startswith("hydra/launcher=") and "slurm" in o for o in overrides)


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


def check_values(overrides, config_dirs: list[str], job_of=None) -> None:
    """Reject unknown config-group options and bad top-level values among parsed `overrides`
    (their plain values; see _plain_values). Raises ConfigError naming the value and what is allowed,
    and for a swept value, `job_of(key, value)`'s words for the jobs it is in (a multirun's: job_label)."""
    for override in overrides:
        key = override.key_or_group
        if override.is_delete() or key == "resume":
            continue
        for value in _plain_values(override):
            try:
                _check_one(key, value, config_dirs)
            except ConfigError as err:
                where = job_of(key, value) if job_of is not None and override.is_sweep_override() else ""
                raise ConfigError(f"{err}{where}") from None


def _check_one(key: str, value, config_dirs: list[str]) -> None:
    if key in CONFIG_GROUPS:
        known = group_options(key, config_dirs)
        if isinstance(value, (dict, list)):
            raise ConfigError(_not_an_option(key, value, known))
        if value not in known:
            raise ConfigError(f"{key}={value!r} is not a known option: choose one of {', '.join(sorted(known))}")
    else:
        _check_value(key, value)


def job_label(num: int, jobs: list[list[str]], more: int = 0) -> str:
    """` (in the sweep's job 1 of jobs 0-2: lr=-1)`: job `num` of a multirun's `jobs` (override lists, in
    Hydra's order, numbered from 0 as the job dirs and the sweep's lines are) by the overrides that tell
    the jobs apart (all of them where nothing does); `more`: how many later jobs the refusal also holds for."""
    settings: dict[str, set[str]] = {}
    for job in jobs:
        for o in job:
            settings.setdefault(o.split("=", 1)[0], set()).add(o)
    varying = {key for key, given in settings.items() if len(given) > 1}
    shown = [o for o in jobs[num] if o.split("=", 1)[0] in varying] or jobs[num]
    also = f", and {more} more job{'s' if more > 1 else ''}" if more else ""
    return f" (in the sweep's job {num} of jobs 0-{len(jobs) - 1}: {' '.join(shown)}{also})"


def _job_of(overrides: list[str], config_dirs: list[str]):
    """`job_of(key, value)` for check_values: the label of the first job of the multirun `overrides` that sets
    `key` to `value`, with the jobs listed as Hydra's sweeper will (a preset's sweeps included) only when
    a value is refused."""
    def job_of(key: str, value) -> str:
        try:
            jobs, _, grid = sweep_plan(overrides, config_dirs)
        except Exception:  # a config the sweeper's listing cannot compose: the value alone is named
            return ""
        parser = OverridesParser.create()
        having = [n for n, job in enumerate(jobs)
                  if any(o.key_or_group == key and o.value() == value for o in parser.parse_overrides(job))]
        return job_label(having[0], jobs, len(having) - 1) if having and grid else ""

    return job_of


def _not_an_option(key: str, value, known: set[str]) -> str:
    """The refusal of a mapping or list given to config group `key`, which takes one option's name."""
    line = (f"{key}={override_text(value)}: {key} is a config group: give the name of one of its options "
            f"({', '.join(sorted(known))})")
    if isinstance(value, list) or not value:
        return f"{line}, not a {'list' if isinstance(value, list) else 'mapping'}"
    named = ", ".join(f"{key}.{k}" for k in value)
    return f"{line}, not a mapping; to set {named}, write {' '.join(f'{key}.{k}={override_text(v)}' for k, v in value.items())}"


def precheck(overrides: list[str], config_dirs: list[str], multirun: bool = False) -> list[str]:
    """Reject unknown group options, bad values and bad resume paths on the command line before Hydra starts.

    Sweep values that only Hydra's sweeper can list (glob, interval) are checked per job by check_jobs.
    Returns overrides to add: `resume=PATH` continues that checkpoint's run in its own dir, so
    unless `hydra.run.dir` is given, one pointing there.
    """
    parsed = OverridesParser.create().parse_overrides(overrides)
    check_values(parsed, config_dirs, _job_of(overrides, config_dirs) if multirun else None)
    extra: list[str] = []
    for override in (o for o in parsed if o.key_or_group == "resume" and not o.is_delete()):
        values = _plain_values(override)
        paths = [v for v in values if v is not None and v != "auto"]
        if paths and (multirun or len(values) > 1):
            raise ConfigError(f"resume={paths[0]}: a checkpoint path resumes one run, not a sweep: use resume=auto")
        for path in paths:
            if not isinstance(path, str) or not path.strip():
                raise ConfigError(f"resume={path!r}: choose null, auto or a checkpoint path")
            # torch, through the checkpoint module: imported only for a resume path, so that a command without
            # one (and a sweep's launching process, whose workers import torch) never waits for it.
            from normlab.train.checkpoint import Checkpoint, CheckpointError, find_checkpoint, load_newest, run_dir_of

            try:
                checkpoint = find_checkpoint(path)
                # A bad file stops here, before Hydra makes a run dir.
                load_newest(path) if Path(path).is_dir() else Checkpoint.load(checkpoint)
            except CheckpointError as err:
                raise ConfigError(str(with_continue_command(err))) from None
            run_dir = run_dir_of(checkpoint)
            if run_dir is not None and not any(o.key_or_group == "hydra.run.dir" for o in parsed):
                extra.append("hydra.run.dir=" + quoted_value(str(run_dir)))
    return extra


def sweep_jobs(overrides: list[str], config_loader=None) -> list[list[str]]:
    """The override lists of the jobs Hydra's BasicSweeper launches for `overrides` (its sweeper params
    first), expanded by the sweeper's own split logic: choice, range and, given the config loader, glob.
    Raises ConfigError for a sweep the basic sweeper cannot expand (interval: a search sweeper's)."""
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
    config is checked as the trial starts (task.train_job), before anything heavy."""
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
    plugins: dict[str, str] = {}  # a multirun's hydra/launcher and hydra/sweeper: choice, _target_
    try:
        hydra = _main_hydra(config_dirs)
        jobs, grid = [list(overrides)], False
        if multirun:
            jobs, plugins, grid = _listed_jobs(hydra, overrides, config_dirs)
        cfgs, job_cfgs = [], []
        for num, job in enumerate(jobs):
            try:
                cfgs.append(_check_job(hydra, job, config_dirs, RunConfig, composed or {}, job_cfgs))
            except ConfigError as err:
                where = job_label(num, jobs) if grid else " (in each of the sweep's trials)" if multirun else ""
                raise ConfigError(f"{err}{where}") from None
    except ConfigError:
        raise
    except Exception:
        return  # Hydra reports what it cannot compose in its own words when it runs
    finally:
        GlobalHydra.instance().clear()
    if grid:  # normlab's launcher lands each job where its run is; another launcher, in the dir of its place
        check_sweep_dirs(job_cfgs, cfgs, None if plugins["launcher_target"] == NORMLAB_LAUNCHER else plugins["launcher"])
    check_packing(cfgs, plugins)


def _main_hydra(config_dirs: list[str]) -> Hydra:
    """Hydra over the search path `normlab train` gets: the packaged conf/, then any --config-dir, as Hydra adds it."""
    search_path = create_config_search_path("pkg://" + CONFIG_MODULE)
    for d in config_dirs:
        search_path.prepend("command-line", f"file://{Path(d).absolute()}", anchor=SearchPathQuery(provider="schema"))
    return Hydra.create_main_hydra2(task_name="normlab", config_search_path=search_path)


def _listed_jobs(hydra: Hydra, overrides: list[str], config_dirs: list[str]) -> tuple[list[list[str]], dict, bool]:
    """A multirun's jobs as its sweeper makes them, its launcher and sweeper (choice and _target_ each), and
    whether the jobs are a grid's (the basic sweeper's, a preset's hydra.sweeper.params first); for a search
    sweeper, only the fixed part, its listed values checked one by one (_search_sweep_checks)."""
    forced = _norm_knob_overrides(list(overrides))[1]
    sweep_cfg = hydra.compose_config("config", forced, run_mode=RunMode.MULTIRUN, from_shell=True)
    plugins = {}
    for plugin in ("launcher", "sweeper"):
        plugins[plugin] = sweep_cfg.hydra.runtime.choices.get(f"hydra/{plugin}")
        plugins[plugin + "_target"] = sweep_cfg.hydra[plugin].get("_target_")
    if plugins["launcher_target"] == NORMLAB_LAUNCHER:
        check_launcher(sweep_cfg.hydra.launcher)
    params = [f"{k}={v}" for k, v in (sweep_cfg.hydra.sweeper.get("params") or {}).items()]
    if sweep_cfg.hydra.sweeper.get("_target_") == BASIC_SWEEPER:
        return sweep_jobs(params + list(overrides), hydra.config_loader), plugins, True
    parser = OverridesParser.create(config_loader=hydra.config_loader)
    return _search_sweep_checks(parser, list(overrides), config_dirs), plugins, False


def sweep_plan(overrides: list[str], config_dirs: list[str]) -> tuple[list[list[str]], dict, bool]:
    """_listed_jobs of the multirun `overrides`, on a Hydra of its own."""
    try:
        return _listed_jobs(_main_hydra(config_dirs), overrides, config_dirs)
    finally:
        GlobalHydra.instance().clear()


def check_packing(cfgs: list, plugins: dict[str, str]) -> None:
    """ConfigError (one line) unless the jobs `cfgs` (RunConfigs) that ask for pack=true can train as packs:
    in a multirun only normlab's launcher packs (another would train them unpacked, silently) and only a
    grid sweep's jobs (Hydra's basic sweeper; a search sweeper launches a trial or two at a time), and each
    pack must be packable (normlab.config.packing.check_packable refuses torchrun, fp16, compile=true, ...); where
    it may train on CUDA at precision=auto, normlab.train.pack.check_pack (torch) also asks what precision its
    device resolves. `plugins` holds a multirun's launcher and sweeper (check_jobs); {} for a single run."""
    if not any(cfg.pack for cfg in cfgs):
        return
    if plugins and plugins["launcher_target"] != NORMLAB_LAUNCHER:
        raise ConfigError(f"pack=true with hydra/launcher={plugins['launcher']}: only normlab's launcher "
                          "(hydra/launcher=normlab, the default) packs a sweep's jobs; drop pack=true to run them unpacked")
    if plugins and plugins["sweeper_target"] != BASIC_SWEEPER:
        raise ConfigError(f"pack=true with hydra/sweeper={plugins['sweeper']}: only a grid sweep's jobs (Hydra's basic "
                          "sweeper) are packed, a search sweeper launches its trials one batch at a time; drop pack=true")
    for group in pack_groups(cfgs):  # pack by pack: the first refused is named
        pack = [cfgs[i] for i in group]
        if not pack[0].pack:
            continue
        # What the device decides: precision=auto is fp16 on a CUDA device without bf16; torch's to say, where one may be.
        if pack[0].precision == "auto" and not cpu_for_sure(pack[0].device):
            from normlab.train.pack import check_pack  # torch

            check_pack(pack)  # check_packable's refusals first
        else:
            check_packable(pack)



def _norm_knob_overrides(job: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """The `norm.KNOB=VALUE` overrides of `job` as (knob, value), and `job` with them forced (`++`).

    Forced, they compose even where the chosen norm's file lacks the knob (Hydra would stop with its
    own multi-line error), so `check_jobs` can say in one line which knobs that norm has.
    """
    knobs, forced = [], []
    for text, override in zip(job, OverridesParser.create().parse_overrides(job)):
        key = override.key_or_group
        if key.startswith("norm.") and key != "norm.name" and not override.is_delete() and override.package is None:
            value = text.split("=", 1)[1]  # as typed: norm.weight=false, not False
            knobs.append((key[len("norm.") :], value))
            text = f"++{key}={value}"
        forced.append(text)
    return knobs, forced


def _check_job(hydra, job: list[str], config_dirs: list[str], run_config, composed: dict, job_cfgs: list):
    """Check one job's values, compose its config (or take it from `composed`, by the overrides it was
    composed with) and validate it; returns its RunConfig, and appends its composed config to `job_cfgs`."""
    check_values(OverridesParser.create().parse_overrides(job), config_dirs)
    knobs, forced = _norm_knob_overrides(job)
    cfg = composed.get(tuple(forced)) or hydra.compose_config("config", forced, run_mode=RunMode.RUN, from_shell=True)
    job_cfgs.append(cfg)
    raw = task_dict(cfg)
    if raw.get("norm", {}).get("name") in NORM_TRAITS:
        for knob, value in knobs:
            check_norm_knob(raw["norm"]["name"], knob, value)
    return run_config.from_dict(raw)
