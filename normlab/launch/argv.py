"""`normlab train`'s command line as it reaches Hydra: Hydra's argument parser, whose refusal becomes one
line; `+experiment=NAME` taken as `experiment=NAME`; and the `normlab` command's own word in shell
completion, which Hydra cannot complete."""

from __future__ import annotations

import argparse
import functools
import os
import sys

from hydra._internal.utils import get_args_parser

from normlab.config import KEY_CHOICES, ConfigError, RunConfig, flatten_config
from normlab.util.errors import fail

COMMANDS = ("train", "resume", "compare", "sample", "prepare")


def experiment_override(arg: str) -> str:
    """`+experiment=NAME` as `experiment=NAME`: the defaults list has an experiment slot (null), so Hydra
    would refuse to append one; lightning-hydra-template users type it either way."""
    return arg[1:] if arg.startswith("+experiment=") else arg


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """`normlab train ARGS` parsed as Hydra parses its app's arguments; a refusal exits with one line."""
    parser = get_args_parser()
    parser.error = _refuse_arguments
    return parser.parse_args(argv)


def _refuse_arguments(message: str) -> None:
    """Hydra's argument parser refuses the command line: one line instead of its usage text."""
    stray = message.partition("unrecognized arguments:")[2].split()
    if stray and all("=" in arg for arg in stray):  # overrides after an option: argparse takes overrides only once
        hint = ": put -m and other options before the overrides (normlab train -m lr=1e-3,3e-3 norm=rms)"
    else:
        hint = ": `normlab train --help` lists the options"
    sys.exit(fail(f"train: {message}{hint}"))


def check_modes(args: argparse.Namespace) -> None:
    """ConfigError (one line) for options Hydra takes one at a time (-m, --cfg, --info, --run): Hydra itself
    ends such a command in a traceback."""
    given = [name for name, on in (("-m", args.multirun), ("--cfg", args.cfg is not None),
                                   ("--info", args.info is not None), ("--run", args.run)) if on]
    if len(given) < 2:
        return
    if given[0] == "-m" and given[1] in ("--cfg", "--info"):
        shown = f"{given[1]} job" if given[1] == "--cfg" else given[1]
        raise ConfigError(f"train: -m with {given[1]}: {given[1]} shows one job, not a sweep: drop -m and give one "
                          f"value per key (normlab train {shown} norm=rms shows the sweep's job norm=rms)")
    raise ConfigError(f"train: {' and '.join(given)} together: Hydra takes one of -m, --cfg, --info and --run "
                      "at a time")


def hydra_completes() -> bool:
    """`normlab train -sc install=bash` (or `normlab -sc ...`): whether Hydra's completion answers, as
    installed for the `normlab` command. The shell then asks `normlab -sc query=bash` with its line,
    'normlab train norm=r': Hydra completes the line after 'train' or 'prepare' (taken out of COMP_LINE here); on the
    command's own word the commands are printed here, and the other commands' words are left to the shell."""
    line = os.environ.get("COMP_LINE")
    if line is None:
        return True
    words = line.split()
    if len(words) < 2 or (len(words) == 2 and not line.endswith(" ")):
        print(" ".join(COMMANDS))
        return False
    if words[1] not in ("train", "prepare"):
        return False  # resume, compare and sample take paths: the shell's own file completion applies
    values = value_choices(words[-1]) if not line.endswith(" ") else None
    if values is not None:
        print(" ".join(values))
        return False
    os.environ["COMP_LINE"] = line.replace(f" {words[1]}", "", 1)  # prepare takes train's overrides
    return True


def value_choices(word: str) -> list[str] | None:
    """What `KEY=PARTIAL` may become when KEY takes one of a fixed set of values (KEY_CHOICES; true and false
    for a boolean key), a sweep's next value after a comma included: `placement=pre,p` -> `placement=pre,post`.
    None for any other word, which Hydra completes. Hydra itself offers such a key's current value only: it
    completes the options of config groups, and placement, precision, ... are values, not groups."""
    key, eq, value = word.partition("=")
    key = key.lstrip("+")
    if not eq:
        return None
    allowed = KEY_CHOICES.get(key) or (("true", "false") if isinstance(_defaults().get(key), bool) else None)
    if allowed is None:
        return None
    done, _, partial = value.rpartition(",")
    head = word[: len(word) - len(partial)]
    return [head + option for option in allowed if option.startswith(partial) and option not in done.split(",")]


@functools.lru_cache(maxsize=1)
def _defaults() -> dict:
    return flatten_config(RunConfig())
