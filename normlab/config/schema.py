"""The run schema: typed configuration for one normlab run, and its dotted keys.

These dataclasses are the one place a default is written: `normlab train` composes them (registered
with Hydra as the schema `base`, normlab.launch.resolvers) under the choices of conf/ (presets, norms,
data), and `RunConfig()` is the same config. `RunConfig.from_dict` turns the resolved mapping into these
dataclasses (normlab.config.parse) and checks every value (normlab.config.validate) before anything
heavy starts. A bad value raises `ConfigError` with one line naming the key and what is allowed.
Nothing here imports torch, so validation is instant.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, get_type_hints

from normlab.config.parse import build_config, check_types, dotted_keys, format_lr, nearest_key, unknown_key_line
from normlab.config.registry import LABEL_SUFFIXES, NORM_TRAITS
from normlab.config.validate import AUTO_FINAL_NORM, validate_run


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
    alpha_attn: float = 0.5  # DyT, Derf: initial α of the attention norms (and of QK-norm and the embedding norm)
    alpha_mlp: float = 0.5  # DyT, Derf: initial α of the MLP norms
    alpha_final: float = 0.5  # DyT, Derf: initial α of the final norm before the head
    shift: float = 0.0  # Derf: initial shift s inside the erf

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
    vocab_size: int | None = None  # null: the tokenizer's vocabulary (256 for tokenizer=byte); else at least it
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
    holdout: str = "tail"  # validation without a split of its own: tail (last val_fraction of the bytes) | hash | first
    not_utf8: str = "auto"  # bytes that are not UTF-8 under tokenizer=bpe/hf: refuse | replace (U+FFFD) | auto (replace for stdlib)
    val_docs: int = 1000  # data.holdout=first: the number of leading documents held out
    train: list = field(default_factory=list)  # data=tokens: token shard files or globs to train on
    val: list = field(default_factory=list)  # data=tokens: token shard files or globs to validate on
    dtype: str | None = None  # data=tokens: raw arrays' ids, uint16 | uint32; null: from the llm.c header or a sidecar
    workers: int | None = bookkeeping(None)  # processes encoding a corpus's tokens; null: one per core it may use
    batch_bytes: int = bookkeeping(1 << 20)  # text each encoding worker takes at once: memory scales with it


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
    """Per-layer statistics (normlab.telemetry.probe): at step 0, every `every` steps and at the last step."""

    every: int = 10  # 0 turns telemetry off


@dataclass
class CkptConfig:
    every: int = 100  # write a checkpoint every N steps, and always at the end; 0: only at the end
    keep: int = 1  # newest checkpoints kept in <run dir>/checkpoints


@dataclass
class RunConfig:
    """Everything one run needs. Short top-level keys are the ones users sweep."""

    name: str | None = bookkeeping(None)  # the run's name (run dir, wandb run, log lines); null: run_name's generated one
    norm: NormConfig = field(default_factory=NormConfig)
    placement: str = "pre"
    mix_p: float = 0.25  # placement=mix: the first ⌊mix_p·depth⌋ blocks are post-norm, the rest pre-norm
    embed_norm: bool = False  # a norm on the embedding (token + position) before block 0
    final_norm: bool | str = "auto"  # the norm before the head: auto (the placement's default), true or false
    residual_gate: str = "none"  # none | rezero | layerscale: x + a ⊙ f(·) with a learnable a
    residual_gate_init: float | None = None  # a₀; null: the method's own (ReZero 0, LayerScale by depth as CaiT)
    qk_norm: bool = False  # a norm on queries and keys, whatever the placement
    qk_norm_axis: str = "head"  # head: over each head's head_dim (Qwen3); all: over the whole projection (OLMo 2)
    qk_norm_gains: str = "shared"  # shared: one gain for every head; head: a gain per head (with qk_norm_axis=head)
    attn_softcap: float | None = None  # c of c·tanh(logit/c) on the attention logits (Gemma 2); null: none
    z_loss: float = 0.0  # c of + c·mean((log Z)²) on the output logits (PaLM); 0: none
    depth: int = 4
    lr: float = 3e-3  # peak learning rate (after warmup)
    init: str = "normal"
    seed: int = 0
    batch_size: int = 32
    grad_accum: int = 1
    seq_len: int = 128
    max_steps: int = 500
    eval_every: int = 100  # evaluate every N steps and at the end; 0: only at the end
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
    def from_dict(cls, raw: Mapping[str, Any], validate: bool = True) -> RunConfig:
        """Build (and unless told not to, validate) a RunConfig from a resolved mapping.

        `raw` is nested ({'model': {'d_model': 64}}), dotted ({'model.d_model': 64}, as a checkpoint's
        flattened config holds it) or both; a key given both ways with two values raises ConfigError.
        Keys unknown to the schema raise ConfigError when validating (a typo would otherwise change
        nothing, silently), with the nearest known key as a suggestion; without validation they are kept
        out, so an old config.json still loads. Values of the wrong type raise ConfigError either way.
        """
        return build_config(cls, raw, validate)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def label(self) -> str:
        """The arm: norm label, placement (with p for mix), '-qk' under QK-norm and a suffix for each
        switch away from its default, e.g. 'dyt-mix0.25-qk', 'rms-pre-qk_all-cap50', 'none-pre-rezero'."""
        placement = f"mix{self.mix_p:g}" if self.placement == "mix" else self.placement
        return f"{self.norm.label}-{placement}" + "".join(self._switch_labels())

    def _switch_labels(self) -> list[str]:
        """One label part per switch set away from its default; none for a run of the default switches."""
        parts = []
        if self.qk_norm:
            parts.append("-qk" + ("_all" if self.qk_norm_axis == "all" else "")
                         + ("_headgains" if self.qk_norm_gains == "head" else ""))
        if self.embed_norm:
            parts.append("-embnorm")
        if self.final_norm != AUTO_FINAL_NORM:
            parts.append("-final" if self.final_norm else "-nofinal")
        if self.residual_gate != "none":
            init = "" if self.residual_gate_init is None else f"{self.residual_gate_init:g}"
            parts.append(f"-{self.residual_gate}{init}")
        if self.attn_softcap is not None:
            parts.append(f"-cap{self.attn_softcap:g}")
        if self.z_loss:
            parts.append(f"-z{format_lr(self.z_loss)}")
        return parts

    @property
    def run_name(self) -> str:
        """The run's name: `name` when set, else a readable one made from the arm, e.g. 'rms-pre-d6-lr1e-3-s0'."""
        return self.name or f"{self.label}-d{self.depth}-lr{format_lr(self.lr)}-s{self.seed}"

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
        """ConfigError, one line, for the first value of the wrong type (checked as from_dict checks it) or that
        cannot be trained (normlab.config.validate)."""
        check_types(self)
        validate_run(self)


def schema_keys(cls: type | None = None, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of RunConfig, sub-configs and their keys alike ('norm', 'norm.name', ...), in schema order."""
    return dotted_keys(cls or RunConfig, prefix)


def bookkeeping_keys() -> tuple[str, ...]:
    """The dotted keys of RunConfig marked `bookkeeping` ('name', 'ckpt', 'data.cache_dir', ...), in schema order.

    A marked sub-config ('wandb') stands for every key under it ('wandb.mode', ...).
    """
    return _bookkeeping_keys(RunConfig, "")


@functools.cache  # a sweep's runs share their few hundred keys: each is judged once
def is_bookkeeping(key: str) -> bool:
    """Whether dotted `key` is a bookkeeping key (bookkeeping_keys) or lies under one ('ckpt.every' under 'ckpt')."""
    return any(key == mark or key.startswith(mark + ".") for mark in bookkeeping_keys())


def run_identity(flat: Mapping[str, Any]) -> tuple:
    """What makes a training, from a flattened config (flatten_config): every key but the bookkeeping ones, lr and
    seed included. Equal for two configs that train the same run (a number and its float alike: lr=1e-3 and 0.001,
    depth 2 and 2.0; a list and a tuple alike); hashable."""
    return tuple(sorted((key, _canonical(value)) for key, value in flat.items() if not is_bookkeeping(key)))


def _canonical(value: Any) -> Any:
    """`value` in a form that compares as the config's values compare, and hashes: numbers as floats, sequences
    as tuples, mappings as sorted pairs, anything else as its repr."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _canonical(v)) for k, v in value.items()))
    return repr(value)


def _bookkeeping_keys(cls: type, prefix: str) -> tuple[str, ...]:
    hints = get_type_hints(cls)
    found: list[str] = []
    for f in fields(cls):
        if f.metadata.get("bookkeeping"):
            found.append(prefix + f.name)
        elif dataclasses.is_dataclass(hints[f.name]):
            found += _bookkeeping_keys(hints[f.name], f"{prefix}{f.name}.")
    return tuple(found)


def suggest_key(key: str, extra_keys: tuple[str, ...] = ()) -> str | None:
    """The known key a typo most likely meant ('nrom' -> 'norm', 'model.dmodel' -> 'model.d_model',
    'lr_rate' -> 'lr'), or None. `extra_keys`: further names a user may mean (config groups such as 'experiment')."""
    return nearest_key(key, (*schema_keys(), *extra_keys))


def unknown_key_message(key: str, value: Any = dataclasses.MISSING, extra_keys: tuple[str, ...] = ()) -> str:
    """One line for a key the schema does not have: the nearest known key as a suggestion
    ("did you mean norm=rms?"), else the keys allowed beside it. `extra_keys`: further names a user
    may mean (config groups such as 'experiment')."""
    return unknown_key_line(key, value, (*schema_keys(), *extra_keys))
