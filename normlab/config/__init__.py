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


INITS = ("normal", "xavier")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's modes; reduce-overhead: CUDA graphs
DATA_SOURCES = ("stdlib", "text", "hf")
TOKENIZERS = ("byte", "bpe", "hf")
BPE_VOCAB_RANGE = (257, 65536)  # the 256 bytes plus at least one merge; ids fit in uint16
WANDB_MODES = ("offline", "online", "disabled")
SEED_RANGE = (0, 2**32 - 1)  # what numpy and torch take as a seed
BYTE_VOCAB = 256  # the byte tokenizer's ids
WANDB_PROJECT_MAX = 128  # wandb's limits on a project name and on each tag
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"
WANDB_TAG_MAX = 64
WANDB_UNREACHABLE = ("offline", "stop")
RESUME_CHOICES = "choose null (start fresh), auto (the newest checkpoint in the run dir, if any) or a checkpoint path"


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
        _choice("norm.name", self.norm.name, tuple(NORM_TRAITS))
        _choice("placement", self.placement, tuple(PLACEMENT_TRAITS))
        _choice("init", self.init, INITS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("device", self.device, DEVICES)
        _choice("compile_mode", self.compile_mode, COMPILE_MODES)
        _choice("data.source", self.data.source, DATA_SOURCES)
        if self.wandb.mode is not None:
            _choice("wandb.mode", self.wandb.mode, WANDB_MODES)
        _choice("wandb.on_unreachable", self.wandb.on_unreachable, WANDB_UNREACHABLE)
        _positive("wandb.init_timeout", self.wandb.init_timeout)
        for sink in self.sinks:
            if not isinstance(sink, str) or sink not in SINK_NAMES:
                raise ConfigError(f"sinks={self.sinks}: unknown sink {sink!r}; choose from {', '.join(SINK_NAMES)}")
        _positive("lr", self.lr)
        _positive("norm.eps", self.norm.eps)
        _at_least("depth", self.depth, 1)
        _at_least("model.d_model", self.model.d_model, 1)
        _at_least("model.n_head", self.model.n_head, 1)
        _at_least("model.mlp_ratio", self.model.mlp_ratio, 1)
        _at_least("model.context", self.model.context, 1)
        _at_least("batch_size", self.batch_size, 1)
        _at_least("grad_accum", self.grad_accum, 1)
        _at_least("seq_len", self.seq_len, 1)
        _at_least("max_steps", self.max_steps, 1)
        _at_least("eval_every", self.eval_every, 0)
        _at_least("eval_batches", self.eval_batches, 1)
        _at_least("log_every", self.log_every, 1)
        _at_least("optim.warmup_steps", self.optim.warmup_steps, 0)
        _at_least("ckpt.every", self.ckpt.every, 0)
        _at_least("ckpt.keep", self.ckpt.keep, 1)
        if self.resume is not None and not self.resume.strip():
            raise ConfigError(f"resume={self.resume!r}: {RESUME_CHOICES}")
        if self.overwrite and self.resume not in (None, "auto"):
            raise ConfigError(f"overwrite=true starts the run over, resume={self.resume} continues one: choose one of them")
        for key in ("alpha_attn", "alpha_mlp", "alpha_final"):
            _positive(f"norm.{key}", getattr(self.norm, key))
        if not 0.0 <= self.mix_p <= 1.0:
            raise ConfigError(f"mix_p={self.mix_p}: must be between 0 and 1 (the fraction of post-norm blocks)")
        if self.telemetry.every < 0:
            raise ConfigError(f"telemetry.every={self.telemetry.every}: must be an integer >= 0 (0 turns telemetry off)")
        if not 0.0 <= self.norm.momentum <= 1.0:
            raise ConfigError(f"norm.momentum={self.norm.momentum}: must be between 0 and 1")
        if not 0.0 <= self.optim.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio={self.optim.min_lr_ratio}: must be between 0 and 1")
        if self.diverge_factor < 0:
            raise ConfigError(f"diverge_factor={self.diverge_factor}: must be >= 0 (0: only NaN/inf counts)")
        if self.optim.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip={self.optim.grad_clip}: must be >= 0 (0 turns clipping off)")
        if self.optim.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.optim.weight_decay}: must be >= 0")
        if not 0.0 < self.data.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.data.val_fraction}: must be between 0 and 1, exclusive")
        if self.model.d_model % self.model.n_head:
            raise ConfigError(
                f"model.d_model={self.model.d_model} is not divisible by model.n_head={self.model.n_head}: "
                "choose a head count that divides the width"
            )
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"batch_size={self.batch_size} does not split into grad_accum={self.grad_accum} equal "
                "micro-batches: choose grad_accum that divides batch_size"
            )
        if self.seq_len > self.model.context:
            raise ConfigError(
                f"seq_len={self.seq_len} is larger than the model's context (model.context={self.model.context}): "
                "lower seq_len or raise model.context"
            )
        self._validate_norm_knobs()
        self._validate_combination()
        self._validate_data()
        self._validate_limits()
        if self.data.source == "text" and not self.data.files:
            raise ConfigError("data.files is empty: data=text needs data.files=[path, ...]")
        if self.data.source == "hf" and not self.data.name:
            raise ConfigError("data.name is not set: data=hf needs data.name=<hub dataset name>")

    def _validate_data(self) -> None:
        """The tokenizer and the data keys that depend on the source."""
        _choice("tokenizer.kind", self.tokenizer.kind, TOKENIZERS)
        low, high = BPE_VOCAB_RANGE
        if self.tokenizer.kind == "bpe" and not low <= self.tokenizer.vocab_size <= high:
            raise ConfigError(
                f"tokenizer.vocab_size={self.tokenizer.vocab_size}: a byte-level BPE needs between {low} "
                f"(the 256 bytes and one merge) and {high} tokens"
            )
        if self.tokenizer.kind == "hf" and not self.tokenizer.name:
            raise ConfigError("tokenizer.name is not set: tokenizer=hf needs tokenizer.name=<hub name or local path>, e.g. gpt2")
        if self.data.max_bytes is not None and self.data.max_bytes < 1:
            raise ConfigError(f"data.max_bytes={self.data.max_bytes}: must be an integer >= 1, or null for all the text")
        if self.data.streaming and self.data.source != "hf":
            raise ConfigError(f"data.streaming=true with data={self.data.source}: only data=hf streams")
        if self.data.streaming and self.data.max_bytes is None:
            raise ConfigError(
                "data.streaming=true needs data.max_bytes=N: a stream has no end to stop at "
                "(e.g. data.max_bytes=100000000 for 100 MB of text)"
            )
        if self.data.val_split not in (None, "auto") and self.data.source != "hf":
            raise ConfigError(
                f"data.val_split={self.data.val_split!r} with data={self.data.source}: only data=hf has named splits; "
                "use data.val_fraction"
            )

    def _validate_limits(self) -> None:
        """Values the libraries below would refuse with a traceback, or ignore: checked here, in one line each."""
        low, high = SEED_RANGE
        if not low <= self.seed <= high:
            raise ConfigError(f"seed={self.seed}: must be an integer between {low} and 2**32-1 ({high})")
        betas = self.optim.betas
        if len(betas) != 2 or not all(_is_number(b) and 0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"optim.betas={betas}: AdamW takes two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]")
        if self.optim.eps < 0:
            raise ConfigError(f"optim.eps={self.optim.eps}: must be >= 0")
        tokenizer_vocab = {"byte": BYTE_VOCAB, "bpe": self.tokenizer.vocab_size}.get(self.tokenizer.kind)
        if self.model.vocab_size is not None:
            _at_least("model.vocab_size", self.model.vocab_size, 1)
            if tokenizer_vocab is not None and self.model.vocab_size < tokenizer_vocab:
                raise ConfigError(
                    f"model.vocab_size={self.model.vocab_size} is smaller than the tokenizer's vocabulary "
                    f"({tokenizer_vocab} ids, tokenizer={self.tokenizer.kind}): set model.vocab_size=null to follow "
                    f"the tokenizer, or at least {tokenizer_vocab}"
                )
        for key, source in (("files", "text"), ("name", "hf"), ("config_name", "hf")):
            if getattr(self.data, key) and self.data.source != source:
                raise ConfigError(
                    f"data.{key} is set, but data={self.data.source} does not read it: add data={source} "
                    f"(data.{key} belongs to data={source})"
                )
        if self.tokenizer.name and self.tokenizer.kind != "hf":
            raise ConfigError(
                f"tokenizer.name is set, but tokenizer={self.tokenizer.kind} does not read it: add tokenizer=hf"
            )
        check_wandb_names(self.wandb.project, self.wandb.tags)

    def _validate_norm_knobs(self) -> None:
        """A knob the norm does not read must keep its default: a set one would be silently ignored.

        A knob at its default is fine, so a config that lists every knob (a saved run's) still loads.
        """
        defaults = NormConfig()
        for f in fields(NormConfig):
            value = getattr(self.norm, f.name)
            if f.name != "name" and value != getattr(defaults, f.name):
                check_norm_knob(self.norm.name, f.name, value)

    def _validate_combination(self) -> None:
        """Reject norm × placement × QK-norm combinations that make no sense, saying why."""
        norm, traits = self.norm.name, NORM_TRAITS[self.norm.name]
        if PLACEMENT_TRAITS[self.placement].deepnorm and not traits.classes:
            raise ConfigError(
                f"placement={self.placement} with norm={norm}: DeepNorm up-weights the residual by α=(2N)^(1/4) in "
                "every sublayer and relies on the norm after each add to undo it; choose a norm, or placement=post"
            )
        qk_norms = ", ".join(n for n, t in NORM_TRAITS.items() if t.classes and t.per_token and t.gains)
        if self.qk_norm and not traits.per_token:
            raise ConfigError(
                f"qk_norm=true with norm={norm}: {traits.title} is not a per-token norm, so it has no per-head form "
                f"for queries and keys; use a per-token norm ({qk_norms}) or qk_norm=false"
            )
        if self.qk_norm and traits.classes and not traits.gains:
            raise ConfigError(
                f"qk_norm=true with norm={norm}: normalized queries and keys with no learnable gain have a fixed "
                "length, which bounds every attention logit, so attention cannot sharpen; use a norm with a "
                f"learnable gain ({qk_norms}) or qk_norm=false"
            )
        if traits.batch_statistics:
            self._validate_stat_rows()

    def _validate_stat_rows(self) -> None:
        """BatchNorm's statistic groups: stat_rows sequences that divide the micro-batch, at least two values each."""
        rows = self.norm.stat_rows
        if rows is not None and (rows < 1 or self.micro_batch_size % rows):
            raise ConfigError(
                f"norm.stat_rows={rows}: must divide the micro-batch of {self.micro_batch_size} sequences "
                f"(batch_size/grad_accum), or be null for the whole micro-batch"
            )
        # Each statistic needs at least two values: over the group at one position when causal,
        # over the group × time otherwise.
        values = (rows or self.micro_batch_size) * (1 if self.norm.causal else self.seq_len)
        if values < 2:
            group = f"groups of norm.stat_rows={rows} sequences" if rows else "micro-batch"
            where = f"per position, over the {group}" if self.norm.causal else f"over {group} × time"
            raise ConfigError(
                f"norm={self.norm.label} takes its statistics {where}, which holds {values} value here: "
                "raise norm.stat_rows or batch_size/grad_accum (the micro-batch size) to at least 2"
            )


def check_wandb_names(project: str | None, tags: list) -> None:
    """wandb's own rules for a project name and tags (wandb.sdk.wandb_settings), checked before a run starts.
    A null project is wandb's own setting (WANDB_PROJECT) or normlab's default, both left to wandb."""
    bad = sorted(set(WANDB_PROJECT_FORBIDDEN) & set(project or ""))
    if project is not None and (not project or len(project) > WANDB_PROJECT_MAX or bad):
        raise ConfigError(
            f"wandb.project={project!r}: a wandb project name has 1 to {WANDB_PROJECT_MAX} characters, none of "
            f"{' '.join(WANDB_PROJECT_FORBIDDEN)}" + (f" (found {' '.join(bad)})" if bad else "")
        )
    for tag in tags:
        if not isinstance(tag, (str, int, float)) or isinstance(tag, bool) or not 1 <= len(str(tag)) <= WANDB_TAG_MAX:
            raise ConfigError(f"wandb.tags: tag {tag!r} is not allowed: a wandb tag is a string of 1 to {WANDB_TAG_MAX} characters")


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


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed: choose one of {', '.join(allowed)}")


def _positive(key: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{key}={value}: must be a positive number")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{key}={value}: must be an integer >= {low}")


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
        if _is_number(value) and math.isfinite(value):
            return float(value)
        if _is_number(value):
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
