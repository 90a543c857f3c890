"""Between a config tree and its text: building the schema's dataclasses from a resolved mapping (each
value coerced to its field's type, each key checked, with the nearest known key suggested for a typo),
and the text forms back: dotted keys, values as an override types them, the learning-rate label.

The functions take the schema's class (or its dotted keys) as an argument: the schema calls them, so
this module does not import it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
from dataclasses import fields
from typing import Any, Mapping, get_args, get_origin, get_type_hints

from normlab.config.errors import ConfigError, shown
from normlab.config.validate import RESUME_CHOICES, is_number


def build_config(cls: type, raw: Mapping[str, Any], validate: bool) -> Any:
    """Dataclass `cls` built from `raw` and, with `validate`, validated (RunConfig.from_dict): unknown keys
    are checked first, then each value's type as it is built, then the values together."""
    if isinstance(raw, Mapping):
        raw = nest_dotted(raw)
    if isinstance(raw, Mapping) and isinstance(raw.get("resume"), bool):
        raise ConfigError(f"resume={raw['resume']}: {RESUME_CHOICES}")
    if validate and isinstance(raw, Mapping):
        check_known_keys(raw, cls, dotted_keys(cls))
    cfg = _build(cls, raw, prefix="")
    if validate:
        cfg.validate()
    return cfg


def dotted_keys(cls: type, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of dataclass `cls`, sub-configs and their keys alike ('norm', 'norm.name', ...), in field order."""
    hints = _hints(cls)
    found: list[str] = []
    for f in fields(cls):
        found.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            found += dotted_keys(hints[f.name], f"{prefix}{f.name}.")
    return tuple(found)


def check_known_keys(raw: Mapping[str, Any], cls: type, known: tuple[str, ...], prefix: str = "") -> None:
    """ConfigError for the first key of `raw` (a config tree) that dataclass `cls` does not have; `known`:
    the schema's dotted keys, for the message."""
    hints = _hints(cls)
    for key, value in raw.items():
        if key == "hydra" and not prefix:
            continue  # Hydra's own node, where a caller has left it in
        if key not in hints:
            raise ConfigError(unknown_key_line(prefix + str(key), value, known))
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, Mapping):
            check_known_keys(value, hints[key], known, f"{prefix}{key}.")


def unknown_key_line(key: str, value: Any, known: tuple[str, ...]) -> str:
    """One line for a key not among `known` (dotted keys): the nearest known key as a suggestion
    ("did you mean norm=rms?"), else the keys allowed beside it. `value` dataclasses.MISSING: the key alone."""
    shown = key if value is dataclasses.MISSING else f"{key}={override_text(value)}"
    suggestion = nearest_key(key, known)
    if suggestion:
        fix = suggestion if value is dataclasses.MISSING else f"{suggestion}={override_text(value)}"
        return f"{shown}: {key} is not a config key; did you mean {fix}?"
    parent = key.rpartition(".")[0]
    siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
    where = f"the keys under {parent} are" if parent else "the top-level keys are"
    if not siblings:
        return f"{shown}: {key} is not a config key (`normlab train --help` lists them)"
    return f"{shown}: {key} is not a config key; {where}: {', '.join(siblings)}"


def nearest_key(key: str, known: tuple[str, ...]) -> str | None:
    """The key of `known` a typo most likely meant ('nrom' -> 'norm', 'model.dmodel' -> 'model.d_model',
    'lr_rate' -> 'lr'), or None."""
    # The key's own parent ('model' for 'model.zzz') is no suggestion: it holds the unknown key.
    candidates = [k for k in known if not key.startswith(k + ".")]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.7)
    if close:
        return close[0]
    parent, _, leaf = key.rpartition(".")
    # A known key with a word added ('lr_rate', 'depth_n'): the known key is the typed key's first word.
    head = (parent + "." if parent else "") + leaf.replace("-", "_").split("_")[0]
    return head if head != key and head in known else None


def override_text(value: Any) -> str:
    """`value` as it is typed in an override: rms, 0.5, [a.txt,b.txt], null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_text(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{override_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def flatten_config(cfg: Any) -> dict[str, Any]:
    """{'norm.name': 'rms', 'optim.betas': [0.9, 0.95], ...}: a config (a RunConfig, or its mapping) as dotted keys."""
    tree = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
    flat: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = value

    walk(tree, "")
    return flat


def nest_config(flat: Mapping[str, Any], into: dict | None = None) -> dict:
    """flatten_config's inverse: dotted keys as a nested mapping, set into `into` (a new dict by default)."""
    tree = {} if into is None else into
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def nest_dotted(raw: Mapping[str, Any]) -> dict:
    """`raw` with its dotted keys ('model.d_model': 64, as a checkpoint's flattened config holds them) nested
    beside the nested ones ({'model': {'d_model': 64}}), a copy; ConfigError (one line) for a key given both
    ways with two values, or a dotted key under one that is not a mapping ('norm': 'rms' with 'norm.eps')."""
    dotted = {str(k): v for k, v in raw.items() if "." in str(k)}
    if not dotted:
        return dict(raw)
    tree = copy.deepcopy({k: v for k, v in raw.items() if k not in dotted})
    for key, value in dotted.items():
        node, path = tree, key.split(".")
        for depth, part in enumerate(path[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                above = ".".join(path[: depth + 1])
                raise ConfigError(f"{key}={override_text(value)}: {above} is {override_text(node)}, not a mapping of keys")
        if path[-1] in node and node[path[-1]] != value:
            raise ConfigError(f"{key} is given twice, as {override_text(node[path[-1]])} (nested) and "
                              f"{override_text(value)} (dotted): give it once")
        node[path[-1]] = value
    return tree


def format_lr(lr: float) -> str:
    """A compact learning-rate label for run names: 0.001 -> '1e-3', 0.0025 -> '2.5e-3'."""
    mantissa, exponent = f"{float(lr):.6e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def _build(cls: type, raw: Mapping[str, Any], prefix: str) -> Any:
    """Instantiate dataclass `cls` from `raw`, checking each field's type."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {shown(raw)}")
    hints = _hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        key = prefix + f.name
        kwargs[f.name] = _coerce(key, hints[f.name], raw[f.name])
    return cls(**kwargs)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """get_type_hints of a schema dataclass, once: it evaluates every annotation's text (about 0.1 ms a class)."""
    return get_type_hints(cls)


def check_types(cfg: Any, prefix: str = "") -> None:
    """ConfigError (one line, as from_dict's) for the first field of the dataclass `cfg`, built by hand
    (`RunConfig(lr="x")`), whose value is not of its type; a sub-config must be its dataclass."""
    hints = _hints(type(cfg))
    for f in fields(cfg):
        key, value, hint = prefix + f.name, getattr(cfg, f.name), hints[f.name]
        if not dataclasses.is_dataclass(hint):
            _coerce(key, hint, value)
        elif isinstance(value, hint):
            check_types(value, key + ".")
        else:
            raise ConfigError(f"{key}={override_text(value)}: must be a {hint.__name__} (normlab.config.{hint.__name__}); "
                              f"RunConfig.from_dict takes {key} as a mapping")


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """`value` as field `key` of type `hint` takes it; ConfigError naming the key and the type otherwise."""
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, prefix=key + ".")
    optional = type(None) in get_args(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} must be set (got null)")
    base = next((a for a in get_args(hint) if a is not type(None)), hint) if optional else hint
    base = get_origin(base) or base
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={shown(value)}: must be true or false")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={shown(value)}: must be an integer")
    if base is float:
        if is_number(value) and math.isfinite(value):
            return float(value)
        if is_number(value):
            raise ConfigError(f"{key}={value}: must be a finite number (not nan or inf)")
        raise ConfigError(f"{key}={shown(value)}: must be a number")
    if base is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={shown(value)}: must be a string")
    if base is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise ConfigError(f"{key}={shown(value)}: must be a list")
    return value
