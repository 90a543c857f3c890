"""Arms named by the preset they ran: `model=small` against `model=tiny`, not the five keys a model preset sets.

A preset (conf/model/<name>.yaml) sets a handful of keys at once (depth, seq_len, model.d_model, ...). When
the arms differ in such keys and each arm's run matches one preset in all the keys where the presets
differ, the arm's label names the preset instead of each key.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from normlab.config import RunConfig, flatten_config

PRESET_GROUPS = ("model",)  # config groups whose options are presets of several keys
CONFIG_PACKAGE = "normlab.conf"  # where the YAML of the config groups lives (package data, read as files)


@lru_cache(maxsize=None)
def presets(group: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    """(option, {dotted key: value}) of each option of config group `group`, over the keys where its options
    differ (a key an option leaves out holds the schema's default); empty if the group has no files."""
    import yaml

    try:
        files = sorted((f for f in (resources.files(CONFIG_PACKAGE) / group).iterdir() if f.name.endswith(".yaml")),
                       key=lambda f: f.name)  # fmt: skip
    except (FileNotFoundError, ModuleNotFoundError, NotADirectoryError):
        return ()
    defaults = flatten_config(RunConfig())
    options = {f.name.removesuffix(".yaml"): flatten_config(yaml.safe_load(f.read_text()) or {}) for f in files}
    keys = sorted({k for values in options.values() for k in values if k in defaults})
    full = {name: {k: values.get(k, defaults[k]) for k in keys} for name, values in options.items()}
    differ = [k for k in keys if len({repr(values[k]) for values in full.values()}) > 1]
    return tuple((name, {k: values[k] for k in differ}) for name, values in full.items())


def preset_of(settings: Mapping[str, Any], group: str) -> str | None:
    """The option of `group` whose keys `settings` (a run's flat config) all hold; None if none does."""
    for name, values in presets(group):
        if values and all(k in settings and settings[k] == v for k, v in values.items()):
            return name
    return None


def named_presets(settings_of: Mapping[Any, Mapping[str, Any]], dims: list[str]) -> tuple[list[str], dict[Any, list[str]]]:
    """For arms whose runs have the flat configs `settings_of` (arm: a run's settings) and differ in `dims`:
    the dims a preset names, and each arm's `group=option` words. A group counts only when every arm matches
    one of its options; else its keys stay keys."""
    covered: list[str] = []
    words: dict[Any, list[str]] = {arm: [] for arm in settings_of}
    for group in PRESET_GROUPS:
        keys = {k for _, values in presets(group) for k in values}
        mine = [d for d in dims if d in keys]
        if not mine:
            continue
        names = {arm: preset_of(settings, group) for arm, settings in settings_of.items()}
        if None in names.values() or len(set(names.values())) < 2:
            continue
        covered += mine
        for arm, name in names.items():
            words[arm].append(f"{group}={name}")
    return covered, words
