"""The run schema: typed, validated configuration for one normlab run.

Hydra composes plain YAML (conf/); `RunConfig.from_dict` turns the resolved
mapping into these dataclasses and checks every value before anything heavy
starts. A bad value raises `ConfigError` with one line naming the key and what
is allowed. Nothing here imports torch, so validation is instant.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, get_args, get_origin, get_type_hints

from normlab.config.errors import ConfigError
from normlab.config.registry import (  # noqa: F401 (re-exported)
    ALPHA_PARAMS,
    GAIN_PARAMS,
    LABEL_SUFFIXES,
    NORM_TRAITS,
    NORMS,
    PLACEMENT_TRAITS,
    PLACEMENTS,
    SINK_NAMES,
    NormTraits,
    PlacementTraits,
    check_norm_knob,
    norm_traits,
)
from normlab.config.validate import (  # noqa: F401 (re-exported)
    BPE_VOCAB_RANGE,
    BYTE_VOCAB,
    RESUME_CHOICES,
    TOKENIZERS,
    is_number,
    validate_run,
)


def bookkeeping(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A schema field that changes no number of the run's result: its name, where it runs, what it
    logs and where it writes. Such a field may change when a run resumes, and two runs that differ
    only in such fields belong to one arm in `normlab compare`; `bookkeeping_keys()` lists them."""
    return field(default=default, default_factory=default_factory, metadata={"bookkeeping": True})


@dataclass
class NormConfig:
    """One norm type and its knobs; `NORM_TRAITS[name].knobs` are the ones the norm reads."""

    name: str = "layer"
    eps: float = 1e-5
    weight: bool = True  # learnable gain (γ / w); LayerNorm, RMSNorm, BatchNorm, DyT
    bias: bool = True  # learnable shift (β); LayerNorm, BatchNorm, DyT
    momentum: float = 0.1  # BatchNorm running-statistics momentum
    sync: bool = True  # BatchNorm under DDP: statistics over the global batch
    causal: bool = False  # BatchNorm: statistics per position over the batch, never across time
    stat_rows: int | None = None  # BatchNorm: sequences per statistic ("ghost batch"); null: the micro-batch
    alpha_attn: float = 0.5  # DyT: initial α of the attention norms (and of QK-norm)
    alpha_mlp: float = 0.5  # DyT: initial α of the MLP norms
    alpha_final: float = 0.5  # DyT: initial α of the final norm before the head

    @property
    def label(self) -> str:
        """The norm as a group option names it: 'rms', 'rms_noweight', 'layer_nobias', 'batch_causal'.

        Structural knobs that are switched off show in the label, so two arms that
        differ in them never share a run name.
        """
        knobs = NORM_TRAITS[self.name].knobs if self.name in NORM_TRAITS else ()
        suffixes = (suffix for knob, value, suffix in LABEL_SUFFIXES if knob in knobs and getattr(self, knob) == value)
        return self.name + "".join(suffixes)


@dataclass
class ModelConfig:
    d_model: int = 128
    n_head: int = 4
    context: int = 128  # number of learned positions: the longest sequence the model takes
    mlp_ratio: int = 4
    bias: bool = True  # biases of the linear layers
    vocab_size: int | None = 256  # null: the tokenizer's vocabulary (the presets' choice); else at least it
    embed_scale: bool = False  # multiply the token embedding by sqrt(d_model) (Vaswani et al. 2017; xiong2020 preset)


@dataclass
class DataConfig:
    source: str = "stdlib"
    files: list = field(default_factory=list)  # data=text: local text files
    name: str | None = None  # data=hf: hub dataset name
    config_name: str | None = None  # data=hf: dataset configuration
    split: str = "train"
    text_field: str = "text"
    val_fraction: float = 0.1
    cache_dir: str | None = bookkeeping(None)  # token cache; default ~/.cache/normlab
    streaming: bool = False  # data=hf: stream the split instead of downloading it whole; needs max_bytes
    max_bytes: int | None = None  # read at most this many bytes of text per split; null: all of it
    val_split: str | None = "auto"  # data=hf: auto ("validation" if the dataset has it), a split name, or null (cut val_fraction)


@dataclass
class TokenizerConfig:
    """How text becomes token ids: byte (256 ids), a BPE trained on the training split, or a pretrained one."""

    kind: str = "byte"  # byte | bpe | hf
    vocab_size: int = 4096  # tokenizer=bpe: the vocabulary, 257..65536
    name: str | None = None  # tokenizer=hf: a hub name (gpt2), a directory holding tokenizer.json, or the file


@dataclass
class OptimConfig:
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of the peak lr
    grad_clip: float = 1.0  # max total grad norm; 0 turns clipping off


@dataclass
class WandbConfig:
    """The wandb run. A null mode, project or entity leaves the choice to wandb's own settings (WANDB_MODE,
    WANDB_PROJECT, WANDB_ENTITY, `wandb offline`/`wandb online`) when the user made one; else normlab's
    default applies: offline, project normlab. A value given here (on the command line) wins over them."""

    mode: str | None = None  # offline | online | disabled | null (wandb's setting, else offline)
    project: str | None = None  # null: WANDB_PROJECT, else normlab
    entity: str | None = None  # null: WANDB_ENTITY, else the account's default
    group: str | None = None  # null: in a multirun, the sweep's name (its preset or swept keys, and its time stamp)
    tags: list = field(default_factory=list)
    init_timeout: float = 30.0  # seconds an online run may take to reach the server
    on_unreachable: str = "offline"  # online run that cannot start: offline (warn, record offline, sync later) | stop
    layers: bool = False  # true: per-layer curves in wandb too; false: run-level scalars and the layer table and heatmaps
    overrides: list = field(default_factory=list)  # set by `normlab train`: the job's Hydra overrides, for wandb's config


@dataclass
class TelemetryConfig:
    """Per-layer statistics (normlab.train.probe): at step 0, every `every` steps and at the last step."""

    every: int = 10  # 0 turns telemetry off


@dataclass
class CkptConfig:
    every: int = 100  # write a checkpoint every N steps, and always at the end; 0: only at the end
    keep: int = 1  # newest checkpoints kept in <run dir>/checkpoints


@dataclass
class RunConfig:
    """Everything one run needs. Short top-level keys are the ones users sweep."""

    name: str = bookkeeping("run")
    norm: NormConfig = field(default_factory=NormConfig)
    placement: str = "pre"
    mix_p: float = 0.25  # placement=mix: the first ⌊mix_p·depth⌋ blocks are post-norm, the rest pre-norm
    qk_norm: bool = False  # a per-head norm on queries and keys, whatever the placement
    depth: int = 4
    lr: float = 1e-3
    init: str = "normal"
    seed: int = 0
    batch_size: int = 32
    grad_accum: int = 1
    seq_len: int = 128
    max_steps: int = 600
    eval_every: int = 200
    eval_batches: int = 16
    log_every: int = bookkeeping(10)
    precision: str = "auto"
    device: str = bookkeeping("auto")
    compile: bool = bookkeeping(False)  # torch.compile the model for the training steps that take no telemetry
    tf32: bool = bookkeeping(True)  # CUDA only: float32 matmuls on TF32 tensor cores (Ampere and later)
    compile_mode: str = bookkeeping("default")  # with compile=true: torch.compile's mode (reduce-overhead: CUDA graphs)
    # Deterministic kernels (torch.use_deterministic_algorithms): like tf32 and compile, it changes how the
    # same computation is rounded, never the experiment, so it is bookkeeping: a resumed run may change it.
    deterministic: bool = bookkeeping(False)
    diverge_factor: float = 3.0  # stop as diverged when the loss exceeds this × the initial loss; 0: only NaN/inf
    fail_fast: bool = bookkeeping(False)  # in a multirun, stop the sweep at the first failed job
    progress: bool = bookkeeping(True)
    # multirun, normlab's launcher: jobs that differ only in lr and seed train as one packed model (normlab.train.pack),
    # each member written as its own run with the rows its unpacked run would write: so it is bookkeeping.
    pack: bool = bookkeeping(False)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    wandb: WandbConfig = bookkeeping(default_factory=WandbConfig)
    telemetry: TelemetryConfig = bookkeeping(default_factory=TelemetryConfig)
    ckpt: CkptConfig = bookkeeping(default_factory=CkptConfig)
    sinks: list = bookkeeping(default_factory=lambda: ["jsonl", "wandb"])  # where records go (SINK_NAMES)
    resume: str | None = bookkeeping("auto")  # null: start fresh; auto: newest checkpoint in the run dir, if any; or a path
    overwrite: bool = bookkeeping(False)  # start over in a run dir that holds a run's records, deleting them

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], validate: bool = True) -> "RunConfig":
        """Build (and unless told not to, validate) a RunConfig from a resolved mapping.

        Keys unknown to the schema raise ConfigError when validating (a typo would otherwise change
        nothing, silently), with the nearest known key as a suggestion; without validation they are kept
        out, so an old config.json still loads. Values of the wrong type raise ConfigError either way.
        """
        if isinstance(raw, Mapping) and isinstance(raw.get("resume"), bool):
            raise ConfigError(f"resume={raw['resume']}: {RESUME_CHOICES}")
        if validate and isinstance(raw, Mapping):
            check_known_keys(raw)
        cfg = _build(cls, raw, prefix="")
        if validate:
            cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def label(self) -> str:
        """The arm: norm label, placement (with p for mix) and '-qk' under QK-norm, e.g. 'dyt-mix0.25-qk'."""
        placement = f"mix{self.mix_p:g}" if self.placement == "mix" else self.placement
        return f"{self.norm.label}-{placement}" + ("-qk" if self.qk_norm else "")

    @property
    def run_name(self) -> str:
        """A readable run name, e.g. 'rms-pre-d6-lr1e-3-s0'."""
        return f"{self.label}-d{self.depth}-lr{format_lr(self.lr)}-s{self.seed}"

    def qk_norm_config(self) -> NormConfig | None:
        """The norm QK-norm puts on each head's queries and keys, or None without QK-norm.

        It is the run's norm type, except under norm=none, which has no norm to
        apply: then it is RMSNorm with the run's eps (qk_norm=true asks for a norm).
        """
        if not self.qk_norm:
            return None
        if not NORM_TRAITS[self.norm.name].classes:
            return dataclasses.replace(self.norm, name="rms", weight=True)
        return self.norm

    def validate(self) -> None:
        """ConfigError, one line, for the first value that cannot be trained (normlab.config.validate)."""
        validate_run(self)


def schema_keys(cls: type | None = None, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of RunConfig, sub-configs and their keys alike ('norm', 'norm.name', ...), in schema order."""
    cls = cls or RunConfig
    hints = get_type_hints(cls)
    found: list[str] = []
    for f in fields(cls):
        found.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            found += schema_keys(hints[f.name], f"{prefix}{f.name}.")
    return tuple(found)


def check_known_keys(raw: Mapping[str, Any], cls: type | None = None, prefix: str = "") -> None:
    """ConfigError for the first key of `raw` (a config tree) that the schema does not have."""
    cls = cls or RunConfig
    hints = get_type_hints(cls)
    for key, value in raw.items():
        if key == "hydra" and not prefix:
            continue  # Hydra's own node, where a caller has left it in
        if key not in hints:
            raise ConfigError(unknown_key_message(prefix + str(key), value))
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, Mapping):
            check_known_keys(value, hints[key], f"{prefix}{key}.")


def unknown_key_message(key: str, value: Any = dataclasses.MISSING, extra_keys: tuple[str, ...] = ()) -> str:
    """One line for a key the schema does not have: the nearest known key as a suggestion
    ("did you mean norm=rms?"), else the keys allowed beside it. `extra_keys`: further names a user
    may mean (config groups such as 'experiment')."""
    shown = key if value is dataclasses.MISSING else f"{key}={override_text(value)}"
    suggestion = suggest_key(key, extra_keys)
    if suggestion:
        fix = suggestion if value is dataclasses.MISSING else f"{suggestion}={override_text(value)}"
        return f"{shown}: {key} is not a config key; did you mean {fix}?"
    parent = key.rpartition(".")[0]
    siblings = [k.rpartition(".")[2] for k in (*schema_keys(), *extra_keys) if k.rpartition(".")[0] == parent]
    where = f"the keys under {parent} are" if parent else "the top-level keys are"
    if not siblings:
        return f"{shown}: {key} is not a config key (`normlab train --help` lists them)"
    return f"{shown}: {key} is not a config key; {where}: {', '.join(siblings)}"


def suggest_key(key: str, extra_keys: tuple[str, ...] = ()) -> str | None:
    """The known key a typo most likely meant ('nrom' -> 'norm', 'model.dmodel' -> 'model.d_model',
    'lr_rate' -> 'lr'), or None."""
    import difflib

    known = (*schema_keys(), *extra_keys)
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


def bookkeeping_keys() -> tuple[str, ...]:
    """The dotted keys of RunConfig marked `bookkeeping` ('name', 'ckpt', 'data.cache_dir', ...), in schema order.

    A marked sub-config ('wandb') stands for every key under it ('wandb.mode', ...).
    """
    return _bookkeeping_keys(RunConfig, "")


def _bookkeeping_keys(cls: type, prefix: str) -> tuple[str, ...]:
    hints = get_type_hints(cls)
    found: list[str] = []
    for f in fields(cls):
        if f.metadata.get("bookkeeping"):
            found.append(prefix + f.name)
        elif dataclasses.is_dataclass(hints[f.name]):
            found += _bookkeeping_keys(hints[f.name], f"{prefix}{f.name}.")
    return tuple(found)


def _build(cls: type, raw: Mapping[str, Any], prefix: str):
    """Instantiate dataclass `cls` from `raw`, checking each field's type."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        key = prefix + f.name
        kwargs[f.name] = _coerce(key, hints[f.name], raw[f.name])
    return cls(**kwargs)


def _coerce(key: str, hint: Any, value: Any) -> Any:
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
        raise ConfigError(f"{key}={value!r}: must be true or false")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: must be an integer")
    if base is float:
        if is_number(value) and math.isfinite(value):
            return float(value)
        if is_number(value):
            raise ConfigError(f"{key}={value}: must be a finite number (not nan or inf)")
        raise ConfigError(f"{key}={value!r}: must be a number")
    if base is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r}: must be a string")
    if base is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise ConfigError(f"{key}={value!r}: must be a list")
    return value


def format_lr(lr: float) -> str:
    """A compact learning-rate label for run names: 0.001 -> '1e-3', 0.0025 -> '2.5e-3'."""
    mantissa, exponent = f"{float(lr):.6e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def flatten_config(cfg: RunConfig | Mapping[str, Any]) -> dict[str, Any]:
    """{'norm.name': 'rms', 'optim.betas': [0.9, 0.95], ...}: a config as dotted keys."""
    tree = cfg.to_dict() if isinstance(cfg, RunConfig) else cfg
    flat: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = value

    walk(tree, "")
    return flat
