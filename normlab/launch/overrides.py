"""The command line's overrides, checked before Hydra runs: one `normlab: error:` line for each mistake.

Hydra answers a mistyped key, a key the chosen group option lacks, a missing launcher plugin, a
missing --config-dir or a sweep without -m with several lines and exit code 1, and accepts
`+key=value` for any key at all. `check_command_line` catches what the overrides alone show;
`check_composition` composes each job once, as Hydra will, and turns Hydra's refusal into one
line that says what is allowed. Both raise ConfigError. Keys are checked against the schema
(normlab.config.RunConfig); unknown keys in the composed config are RunConfig.from_dict's to refuse.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import unicodedata
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin, get_type_hints

from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from normlab.config import NORM_TRAITS, ConfigError, RunConfig, check_norm_knob, schema_keys, unknown_key_message
from normlab.launch.derived import Composer

# Hydra plugins by the group options that need them: (the plugin's module, normlab's pip extra).
PLUGINS = {
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "joblib"),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    "slurm_cpu": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    "optuna": ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
    "lr_search": ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
}
PLUGIN_GROUPS = ("hydra/launcher", "hydra/sweeper")


def _loader(config_module: str, config_dirs: list[str]):
    """Hydra's config loader over the search path `normlab train` gets: the packaged conf/, then --config-dir."""
    search_path = create_config_search_path("pkg://" + config_module)
    for d in config_dirs:
        search_path.prepend("command-line", f"file://{Path(d).absolute()}", anchor=SearchPathQuery(provider="schema"))
    return Hydra.create_main_hydra2(task_name="normlab", config_search_path=search_path).config_loader


def _parse(overrides: list[str]) -> list:
    parser = OverridesParser.create()
    parsed = []
    for line in overrides:
        try:
            parsed += parser.parse_overrides([line])
        except OverrideParseException as err:
            raise ConfigError(f"{line}: not an override normlab can read ({_parse_reason(str(err), line)}); write "
                              "key=value, +key=value, group=option or ~key") from None
    return parsed


LEXER_ERROR = "LexerNoViableAltException: "


def _parse_reason(message: str, line: str) -> str:
    """Hydra's refusal `message` of the override `line` in a few words. Hydra's lexer names no reason, only a
    caret under the character it stopped at (`LexerNoViableAltException: name=a^b` over `      ^`): that
    character is named, with the value quoted as Hydra reads it."""
    lines = message.splitlines()
    if lines and lines[0].startswith(LEXER_ERROR) and len(lines) > 1 and lines[1].strip() == "^":
        at = len(lines[1]) - 1 - len(LEXER_ERROR)
        key, eq, value = line.partition("=")
        if 0 <= at < len(line) and eq and at > len(key):
            quoted = f"{key}={quoted_value(value)}"
            shell = shlex.quote(quoted) if set('"$`\\!') & set(quoted) else f'"{quoted}"'
            return (f"{line[at]!r} at position {at - len(key) - 1} of the value cannot stand unquoted: quote it "
                    f"as {quoted}, in a shell {shell}")
        if 0 <= at < len(line):
            return f"{line[at]!r} at position {at} cannot stand there"
    # Hydra's message: "Error parsing override ...", the parser's reason, then a link to the grammar.
    kept = [ln.strip() for ln in lines if ln.strip()]
    return next((ln for ln in kept[1:] if not ln.startswith("See ")), kept[0] if kept else "")


CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL", "\x1b": "an escape"}


def check_characters(overrides: list[str]) -> None:
    """ConfigError (one line, the text escaped) for an override holding a control character, or a byte that
    is not UTF-8 (argv's surrogate escape): Hydra's grammar stops at either with several lines, where a
    newline in hydra.run.dir is a path no one meant."""
    for line in overrides:
        key, eq, value = line.partition("=")
        for i, char in enumerate(value if eq else line):
            if "\udc80" <= char <= "\udcff":
                what = f"the byte 0x{ord(char) - 0xDC00:02x}, which is not UTF-8,"
            elif unicodedata.category(char) == "Cc":
                what = f"{CONTROL_NAMES.get(char, 'the control character')} ({repr(char)[1:-1]})"
            else:
                continue
            where = (f"{key.lstrip('+~')} holds {what} at position {i} of its value {value!r}" if eq
                     else f"the override {line!r} holds {what} at position {i}")
            raise ConfigError(f"{where}: an override's value (a path, a name) may hold neither control characters "
                              "nor bytes that are not UTF-8")


def _value_text(override) -> str:
    try:
        return override.get_value_element_as_str()
    except Exception:  # a sweep has no single value
        return override.input_line.partition("=")[2]


def quoted_value(text: str) -> str:
    """`text` as an override's value that Hydra reads back as this very string: as it is where it would be
    (a plain path), else single-quoted, with a quote and the backslashes before one (or before the end) escaped."""
    try:
        [override] = OverridesParser.create().parse_overrides([f"key={text}"])
        if override.value() == text:
            return text
    except OverrideParseException:
        pass
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body) + "'"


def check_command_line(
    overrides: list[str], config_dirs: list[str], multirun: bool, config_module: str, config_name: str | None = None
) -> None:
    """What the command line alone shows: a missing --config-dir or --config-name, an override holding a
    control character or a byte that is not UTF-8, an override Hydra cannot parse, a sweep without -m, a
    launcher or sweeper whose plugin is not installed, and a key the schema does not have."""
    for d in config_dirs:
        if not Path(d).is_dir():
            raise ConfigError(f"--config-dir={d}: no such directory: give a directory that holds config group dirs (norm/, model/, ...)")
    check_characters(overrides)
    parsed = _parse(overrides)
    try:
        loader = _loader(config_module, config_dirs)
        groups = set(loader.list_groups(""))
        if config_name and not loader.repository.config_exists(config_name):
            primary = sorted(n for n in loader.get_group_options("") if not n.startswith("_"))
            raise ConfigError(f"--config-name={config_name}: no such config: choose one of {', '.join(primary)}")
        for override in parsed:
            key = override.key_or_group
            if override.is_sweep_override() and not multirun:
                raise ConfigError(
                    f"{override.input_line} is a sweep: add -m (normlab train -m {override.input_line}) to run one job "
                    f"per value; for a list write {key}=[a,b], for text with a comma quote it: {key}='a,b'"
                )
            if key in PLUGIN_GROUPS:
                _check_plugin(key, _value_text(override), loader.get_group_options(key))
            elif not (override.is_delete() or override.package is not None or key in groups or _hydra_own(key)):
                if key not in schema_keys():
                    raise ConfigError(unknown_key_message(key, _value_text(override), extra_keys=tuple(sorted(groups))))
    finally:
        GlobalHydra.instance().clear()


def _hydra_own(key: str) -> bool:
    """A key or group of Hydra's own (hydra.run.dir, hydra/job_logging) or a nested group path: not the schema's."""
    return key.startswith("hydra.") or "/" in key


def _check_plugin(group: str, option: str, known: list[str]) -> None:
    for name in option.split(","):  # a sweep over launchers is refused by Hydra itself; each is checked here
        module, extra = PLUGINS.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module.split(".")[0]) and importlib.util.find_spec(module):
            continue
        if extra is not None:
            raise ConfigError(f'{group}={name} needs a plugin that is not installed: pip install "normlab[{extra}]"')
        if name not in known:
            raise ConfigError(
                f"{group}={name} is not a known option: choose one of {', '.join(known)} "
                '(more with pip install "normlab[joblib]", "normlab[slurm]" or "normlab[optuna]")'
            )


def check_composition(
    overrides: list[str], config_dirs: list[str], config_module: str, config_name: str | None = None, expand=None,
    by_job: dict | None = None,
) -> list:
    """Compose each job of `overrides` as Hydra will and return the composed configs (hydra node
    included); turn Hydra's refusal into one line: a key the chosen group option lacks names the
    options that have it; a `+key` that is already set says to drop the +. What the overrides alone
    show is check_command_line's.

    `expand(overrides, config_loader)` lists a multirun's jobs (prechecks.sweep_jobs); where it cannot (a
    search sweeper's interval), the overrides' fixed part is composed. None: one job, `overrides`.
    `by_job`, when given, receives each composed config under its job's overrides (a tuple), so a
    later check reuses it instead of composing the job again (0.1 s a job). Jobs that differ from an earlier one
    only in values are not composed again: normlab.launch.derived.
    """
    composed = []
    try:
        loader = _loader(config_module, config_dirs)
        groups = set(loader.list_groups(""))
        jobs = [overrides]
        if expand is not None:
            try:
                jobs = expand(overrides, loader)
            except Exception:  # a sweep only a search sweeper expands: its trials are checked as they start
                jobs = [[o.input_line for o in _parse(overrides) if not o.is_sweep_override()]]
        compose = Composer(loader, config_name or "config")  # once per shape of job (normlab.launch.derived)
        for job in jobs:
            try:
                composed.append(compose(job))
            except Exception as err:
                raise ConfigError(_explain(err, job, _parse(job), loader, groups, config_name or "config")) from None
            if by_job is not None:
                by_job[tuple(job)] = composed[-1]
    finally:
        GlobalHydra.instance().clear()
    return composed


def _explain(err: Exception, job: list[str], parsed: list, loader, groups: set[str], config_name: str) -> str:
    """One line for Hydra's refusal `err` of `job`."""
    message = str(err)
    for override in parsed:
        key, line = override.key_or_group, override.input_line
        if f"Could not override '{key}'" in message:
            group, _, leaf = key.partition(".")
            if key not in schema_keys():
                return unknown_key_message(key, _value_text(override), extra_keys=tuple(sorted(groups)))
            if group not in groups:
                return f"{line}: {key} is not in the composed config; set it with +{line}"
            rest = [o for o in job if o != line]
            cfg = loader.load_configuration(config_name, rest, run_mode=RunMode.RUN, from_shell=True)
            chosen = cfg.hydra.runtime.choices.get(group)
            having = [f"{group}={o}" for o in loader.get_group_options(group) if _option_has(loader, group, o, leaf)]
            where = f"choose an option that has it: {', '.join(having)}" if having else f"no {group} option has it"
            if group == "norm" and cfg.norm.get("name") in NORM_TRAITS:
                try:  # the norm registry says which knobs this norm reads
                    check_norm_knob(cfg.norm.name, leaf, line.split("=", 1)[1])  # as typed: false, not False
                except ConfigError as refusal:
                    return f"{refusal}; {where}"
            return f"{line}: {group}={chosen} has no key {leaf}; {where}"
        if f"An item is already at '{key}'" in message:
            return f"{line}: {key} is already in the config: write {line.lstrip('+')} (without +) to change it"
        if message.startswith(f"Error merging override {line}"):
            return _unmergeable(override, err)
    first = next((ln.strip() for ln in message.splitlines() if ln.strip()), type(err).__name__)
    return f"could not compose the config of `normlab train {' '.join(job)}`: {first}"


TYPE_TEXT = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list ([a,b])"}


def _unmergeable(override, err: Exception) -> str:
    """One line for a value Hydra cannot merge into its key (a mapping where a list or a string goes): what the
    key takes, from the schema's type, else Hydra's reason."""
    key, line = override.key_or_group, override.input_line
    try:
        value = override.value()
    except Exception:  # a sweep: no single value
        value = None
    given = {dict: "mapping", list: "list", type(None): "null value"}.get(type(value), type(value).__name__)
    takes = _schema_type_text(key)
    if takes:
        return f"{line}: {key} takes {takes}, not a {given}"
    reason = next((ln.strip() for ln in str(err.__cause__ or err).splitlines() if ln.strip()), type(err).__name__)
    return f"{line}: {key} cannot take a {given}: {reason}"


def _schema_type_text(key: str) -> str | None:
    """What the schema's key `key` takes, in words (a string, an integer or null, ...); None for a key not in it."""
    node: object = RunConfig
    for part in key.split("."):
        hints = get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if part not in hints:
            return None
        node = hints[part]
    kinds = [get_origin(t) or t for t in (get_args(node) if get_origin(node) in (Union, UnionType) else (node,))]
    words = [TYPE_TEXT[t] for t in kinds if t in TYPE_TEXT] + (["null"] if type(None) in kinds else [])
    return " or ".join(words) or None


def _option_has(loader, group: str, option: str, leaf: str) -> bool:
    """Whether group option `group/option` sets key `leaf` (within its own package)."""
    try:
        result = loader.repository.load_config(config_path=f"{group}/{option}")
    except Exception:  # an option that cannot be loaded holds no key we can show
        return False
    if result is None or not OmegaConf.is_config(result.config):
        return False
    node = result.config
    if result.header.get("package") == "_global_":
        node = node.get(group, {})
    with open_dict(node):
        return leaf.split(".")[0] in node
