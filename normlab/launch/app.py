"""`normlab train`: the Hydra app around `train(cfg, run_dir)`.

It checks the command line before Hydra starts (normlab.launch.prechecks), then lets Hydra compose each
job's config from normlab's packaged conf/ (plus any --config-dir) and make its run dir, and hands both
to the task (normlab.launch.task.train_job), which trains it.

Under torchrun it joins the process group before Hydra starts and pins the run dir's time stamp and id
to rank 0's, so every rank uses one dir.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import time

import hydra
from hydra.core.plugins import Plugins

import normlab.launch.slurm as slurm
from hydra_plugins.normlab_launcher.normlab_launcher import NormlabLauncher
from normlab import __version__
from normlab.config import ConfigError
from normlab.launch.argv import experiment_override, hydra_completes, parse_train_args
from normlab.launch.prechecks import CONFIG_MODULE, check_command
from normlab.launch.resolvers import register_resolvers
from normlab.launch.rundir import claim
from normlab.launch.task import train_job
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

    config_dirs = [args.config_dir] if args.config_dir else []
    try:
        added = check_command(args.overrides, config_dirs, args.multirun, args.config_name)
    except ConfigError as err:
        return fail(err)
    except Exception as err:  # Hydra's override grammar: one line is enough
        return fail(f"could not parse the overrides: {str(err).splitlines()[0]}")
    if args.multirun and any(o.startswith("hydra/launcher=") for o in args.overrides):
        refusal = slurm.check_sweep(CONFIG_MODULE, args.overrides, config_dirs)
        if refusal:
            return fail(refusal)
    return _train([*argv, *added], [*args.overrides, *added], config_dirs, args.multirun)


def _train(argv: list[str], overrides: list[str], config_dirs: list[str], multirun: bool) -> int:
    """Run Hydra on the checked command line `argv` (its `overrides`); returns the process exit code."""
    # Help needs Hydra alone, so torch (through distributed) is imported here, past the help.
    import normlab.train.distributed as distributed

    if distributed.init_from_env():
        # Ranks may start seconds apart: all take rank 0's time stamp and id, hence its dirs.
        register_resolvers(distributed.broadcast_object((time.time(), secrets.token_hex(3))))
        if not distributed.is_main():
            argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]  # rank 0 writes the run dir's files
    # hydra/launcher=normlab, the default. Hydra finds plugins by walking the hydra_plugins package,
    # which misses one in an editable install (`pip install -e .`).
    Plugins.instance().register(NormlabLauncher)
    try:
        # A single run's dir is locked and its resume checked before Hydra writes into it (normlab.launch.rundir).
        guard = claim(overrides, config_dirs, CONFIG_MODULE)
        with guard if not multirun and distributed.is_main() else contextlib.nullcontext():
            _hydra_main(["normlab train", *argv])
    except ConfigError as err:
        return fail(err)
    finally:
        distributed.shutdown()
    return 0


def _hydra_main(command_line: list[str]) -> None:
    """Hydra's app for `command_line` (sys.argv, which Hydra reads), whose task is normlab's."""
    sys.argv = command_line
    hydra.main(version_base="1.3", config_path="pkg://" + CONFIG_MODULE, config_name="config")(train_job)()
