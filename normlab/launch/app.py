"""`normlab train`: the Hydra app around `train(cfg, run_dir)`.

It checks the command line before Hydra starts (normlab.launch.prechecks), then lets Hydra compose each
job's config from normlab's packaged conf/ (plus any --config-dir) and make its run dir, and hands both
to the task (normlab.launch.task.train_job), which trains it. `resume=<run dir>` first puts that run's
saved command line back (normlab.launch.resume), so the run continues with its own config.

Under torchrun it joins the process group before Hydra starts and pins the run dir's time stamp and id
to rank 0's, so every rank uses one dir.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import secrets
import sys
import time
from typing import Callable

import hydra
from hydra.core.plugins import Plugins

import normlab.launch.slurm as slurm
from hydra_plugins.normlab_launcher.normlab_launcher import NormlabLauncher
from normlab import __version__
from normlab.config import ConfigError, RunConfig
from normlab.launch.argv import check_modes, experiment_override, hydra_completes, parse_train_args
from normlab.launch.prechecks import CONFIG_MODULE, check_command
from normlab.launch.resolvers import register_resolvers
from normlab.launch.resume import check_unchanged, replay, resume_spec, saved_run_of
from normlab.launch.rundir import RunEnded, claim, compose_run
from normlab.launch.task import train_job
from normlab.train.ranks import several_ranks
from normlab.util.errors import fail


def run_train(argv: list[str]) -> int:
    """`normlab train ARGS`: run Hydra with ARGS; returns the process exit code."""
    argv = [experiment_override(arg) for arg in argv]
    if "--version" in argv:  # Hydra's own --version would print Hydra's
        print(f"normlab {__version__}")
        return 0
    register_resolvers()  # the packaged config uses them: the checks compose it, then Hydra
    args = parse_train_args(argv)
    if args.shell_completion:
        if hydra_completes():
            _hydra_main(["normlab", *argv])
        return 0
    if args.help or args.hydra_help:
        _hydra_main(["normlab train", *argv])
        return 0
    try:
        check_modes(args)
        argv, args, unchanged = _resuming(argv, args)
        config_dirs = [args.config_dir] if args.config_dir else []
        added = check_command(args.overrides, config_dirs, args.multirun, args.config_name)
        if unchanged is not None:
            composed = compose_run([*args.overrides, *added], config_dirs, CONFIG_MODULE, args.config_name)
            if composed is not None:  # else the config check has said what is wrong
                unchanged(composed[0])
    except ConfigError as err:
        return fail(err)
    except Exception as err:  # Hydra's override grammar: one line is enough
        return fail(f"could not parse the overrides: {str(err).splitlines()[0]}")
    if args.multirun and any(o.startswith("hydra/launcher=") for o in args.overrides):
        refusal = slurm.check_sweep(CONFIG_MODULE, args.overrides, config_dirs)
        if refusal:
            return fail(refusal)
    return _train([*argv, *added], [*args.overrides, *added], config_dirs, args.multirun, args.config_name)


def _resuming(argv: list[str], args) -> tuple[list[str], argparse.Namespace, Callable[[RunConfig], None] | None]:
    """For `resume=<run dir or its checkpoint>`, a single run: the command line that continues that run with
    its saved config (normlab.launch.resume.replay), its parsed arguments, and the check of the config it
    composes against the run's (resume.check_unchanged); else the command line as it is, and None."""
    spec = None if args.multirun else resume_spec(args.overrides)
    saved = saved_run_of(spec) if spec else None
    if saved is None:
        return argv, args, None
    given = [o for o in args.overrides if not o.startswith("resume=")]
    argv = replay(saved, spec, argv, args.overrides)
    return argv, parse_train_args(argv), functools.partial(check_unchanged, saved, spec=spec, given=given)


def _train(argv: list[str], overrides: list[str], config_dirs: list[str], multirun: bool,
           config_name: str | None) -> int:
    """Run Hydra on the checked command line `argv` (its `overrides`); returns the process exit code."""
    distributed = None
    if several_ranks():
        # torch, through distributed: only in one of several ranks (a sweep's launching process leaves torch's
        # import to its workers, and help needs Hydra alone).
        import normlab.train.distributed as distributed
    if distributed is not None and distributed.init_from_env():
        # Ranks may start seconds apart: all take rank 0's time stamp and id, hence its dirs.
        register_resolvers(distributed.broadcast_object((time.time(), secrets.token_hex(3))))
        if not distributed.is_main():
            argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]  # rank 0 writes the run dir's files
    main_rank = distributed is None or distributed.is_main()
    # hydra/launcher=normlab, the default. Hydra finds plugins by walking the hydra_plugins package,
    # which misses one in an editable install (`pip install -e .`).
    Plugins.instance().register(NormlabLauncher)
    try:
        # A single run's dir is locked and its resume checked before Hydra writes into it (normlab.launch.rundir).
        guard = claim(overrides, config_dirs, CONFIG_MODULE, config_name)
        with guard if not multirun and main_rank else contextlib.nullcontext():
            _hydra_main(["normlab train", *argv])
    except ConfigError as err:
        return fail(err)
    except RunEnded as ended:  # nothing to train, and its dir stays as it is: Hydra never started
        print(ended, file=sys.stderr)
    finally:
        if distributed is not None:
            distributed.shutdown()
    return 0


def _hydra_main(command_line: list[str]) -> None:
    """Hydra's app for `command_line` (sys.argv, which Hydra reads), whose task is normlab's."""
    sys.argv = command_line
    hydra.main(version_base="1.3", config_path="pkg://" + CONFIG_MODULE, config_name="config")(train_job)()
