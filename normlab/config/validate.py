"""What a trainable run configuration is: the values each key may take, and every check of
`RunConfig.validate`, each raising ConfigError with one line that names the key and what is allowed.

The checks take the run's config (a `normlab.config.schema.RunConfig`) as their argument; the schema
calls them, so this module does not import it.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from normlab.config.errors import ConfigError, shown
from normlab.config.registry import NORM_TRAITS, NORMS, PLACEMENT_TRAITS, PLACEMENTS, SINK_NAMES, check_norm_knob

INITS = ("normal", "xavier")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's modes; reduce-overhead: CUDA graphs
DATA_SOURCES = ("stdlib", "text", "hf", "tokens")
HOLDOUTS, NOT_UTF8 = ("tail", "hash", "first"), ("auto", "refuse", "replace")  # normlab.data.holdout, .corpus
TOKEN_DTYPES = ("uint16", "uint32")  # data=tokens: the ids of a raw array
TOKENIZERS = ("byte", "bpe", "hf")
BPE_VOCAB_RANGE = (257, 65536)  # the 256 bytes plus at least one merge; ids fit in uint16
WANDB_MODES = ("offline", "online", "disabled")
SEED_RANGE = (0, 2**32 - 1)  # what numpy and torch take as a seed
BYTE_VOCAB = 256  # the byte tokenizer's ids
# The data and tokenizer keys that some sources or kinds read, and which: another must leave them at their defaults.
TEXT_SOURCES = ("stdlib", "text", "hf")
SOURCE_KEYS = {"files": ("text",), "name": ("hf",), "config_name": ("hf",), "split": ("hf",), "text_field": ("text", "hf"),
               "train": ("tokens",), "val": ("tokens",), "dtype": ("tokens",),
               **dict.fromkeys(("holdout", "val_fraction", "val_docs", "max_bytes", "not_utf8"), TEXT_SOURCES)}
TOKENIZER_KEYS = {"vocab_size": ("bpe",), "name": ("hf",)}
NAME_MAX = 100  # a run name is part of its run dir's name
WANDB_PROJECT_MAX = 128  # wandb's limits on a project name and on each tag
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"
WANDB_TAG_MAX = 64
WANDB_UNREACHABLE = ("offline", "stop")
# The keys whose value is one of a fixed set, with that set (what tab completion offers after `key=`).
KEY_CHOICES: dict[str, tuple[str, ...]] = {
    "norm.name": NORMS, "placement": PLACEMENTS, "init": INITS, "precision": PRECISIONS, "device": DEVICES,
    "compile_mode": COMPILE_MODES, "data.source": DATA_SOURCES, "data.holdout": HOLDOUTS,
    "data.not_utf8": NOT_UTF8, "data.dtype": TOKEN_DTYPES, "tokenizer.kind": TOKENIZERS,
    "wandb.mode": WANDB_MODES, "wandb.on_unreachable": WANDB_UNREACHABLE,
}
RESUME_CHOICES = "choose null (start fresh), auto (the newest checkpoint in the run dir, if any) or a checkpoint path"
AUTO_FINAL_NORM = "auto"  # final_norm: the placement's own choice
RESIDUAL_GATES = ("none", "rezero", "layerscale")
QK_NORM_AXES = ("head", "all")
QK_NORM_GAINS = ("shared", "head")


def validate_run(cfg: Any) -> None:
    """Every check of a RunConfig, in this order: the first that fails raises ConfigError."""
    check_choices(cfg)
    check_records(cfg)
    check_sizes(cfg)
    check_resume(cfg)
    check_ranges(cfg)
    check_shapes(cfg)
    check_norm_knobs(cfg)
    check_combination(cfg)
    check_switches(cfg)
    check_data(cfg)
    check_limits(cfg)
    check_data_source(cfg)


def check_choices(cfg: Any) -> None:
    """Keys that name one of a fixed set of options."""
    _choice("norm.name", cfg.norm.name, tuple(NORM_TRAITS))
    _choice("placement", cfg.placement, tuple(PLACEMENT_TRAITS))
    _choice("init", cfg.init, INITS)
    _choice("residual_gate", cfg.residual_gate, RESIDUAL_GATES)
    _choice("qk_norm_axis", cfg.qk_norm_axis, QK_NORM_AXES)
    _choice("qk_norm_gains", cfg.qk_norm_gains, QK_NORM_GAINS)
    if cfg.final_norm != AUTO_FINAL_NORM and not isinstance(cfg.final_norm, bool):
        raise ConfigError(f"final_norm={shown(cfg.final_norm)} is not allowed: choose auto (the placement's default), true or false")
    _choice("precision", cfg.precision, PRECISIONS)
    _choice("device", cfg.device, DEVICES)
    _choice("compile_mode", cfg.compile_mode, COMPILE_MODES)
    _choice("data.source", cfg.data.source, DATA_SOURCES)


def check_records(cfg: Any) -> None:
    """Where the run's records go: its name, wandb's mode and connection, and the sinks."""
    if cfg.name is not None and (not 1 <= len(cfg.name) <= NAME_MAX or cfg.name.startswith(".")
                                 or set("/\\") & set(cfg.name)):
        raise ConfigError(f"name={shown(cfg.name)}: a run name has 1 to {NAME_MAX} characters, none of / \\, "
                          "and does not start with . (null: the name made from the arm, depth, lr and seed)")
    if cfg.wandb.mode is not None:
        _choice("wandb.mode", cfg.wandb.mode, WANDB_MODES)
    _choice("wandb.on_unreachable", cfg.wandb.on_unreachable, WANDB_UNREACHABLE)
    _positive("wandb.init_timeout", cfg.wandb.init_timeout)
    for sink in cfg.sinks:
        if not isinstance(sink, str) or sink not in SINK_NAMES:
            raise ConfigError(f"sinks={cfg.sinks}: unknown sink {shown(sink)}; choose from {', '.join(SINK_NAMES)}")


def check_sizes(cfg: Any) -> None:
    """The learning rate, eps, and every count and size: sizes at least 1, periods and warmup at least 0."""
    _positive("lr", cfg.lr)
    _positive("norm.eps", cfg.norm.eps)
    _at_least("depth", cfg.depth, 1)
    _at_least("model.d_model", cfg.model.d_model, 1)
    _at_least("model.n_head", cfg.model.n_head, 1)
    _at_least("model.mlp_ratio", cfg.model.mlp_ratio, 1)
    _at_least("model.context", cfg.model.context, 1)
    _at_least("batch_size", cfg.batch_size, 1)
    _at_least("grad_accum", cfg.grad_accum, 1)
    _at_least("seq_len", cfg.seq_len, 1)
    _at_least("max_steps", cfg.max_steps, 1)
    _at_least("eval_every", cfg.eval_every, 0)
    _at_least("eval_batches", cfg.eval_batches, 1)
    _at_least("log_every", cfg.log_every, 1)
    _at_least("optim.warmup_steps", cfg.optim.warmup_steps, 0)
    _at_least("ckpt.every", cfg.ckpt.every, 0)
    _at_least("ckpt.keep", cfg.ckpt.keep, 1)


def check_resume(cfg: Any) -> None:
    """resume names a way to start, and overwrite (start over) does not meet a checkpoint to continue."""
    if cfg.resume is not None and not cfg.resume.strip():
        raise ConfigError(f"resume={shown(cfg.resume)}: {RESUME_CHOICES}")
    if cfg.overwrite and cfg.resume not in (None, "auto"):
        raise ConfigError(f"overwrite=true starts the run over, resume={cfg.resume} continues one: choose one of them")


def check_ranges(cfg: Any) -> None:
    """Numbers with a range: DyT's α, fractions, and the factors and periods that 0 turns off."""
    for key in ("alpha_attn", "alpha_mlp", "alpha_final"):
        _positive(f"norm.{key}", getattr(cfg.norm, key))
    if not 0.0 <= cfg.mix_p <= 1.0:
        raise ConfigError(f"mix_p={cfg.mix_p}: must be between 0 and 1 (the fraction of post-norm blocks)")
    if cfg.telemetry.every < 0:
        raise ConfigError(f"telemetry.every={cfg.telemetry.every}: must be an integer >= 0 (0 turns telemetry off)")
    if not 0.0 <= cfg.norm.momentum <= 1.0:
        raise ConfigError(f"norm.momentum={cfg.norm.momentum}: must be between 0 and 1")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio}: must be between 0 and 1")
    if cfg.diverge_factor < 0:
        raise ConfigError(f"diverge_factor={cfg.diverge_factor}: must be >= 0 (0: only NaN/inf counts)")
    if cfg.optim.grad_clip < 0:
        raise ConfigError(f"optim.grad_clip={cfg.optim.grad_clip}: must be >= 0 (0 turns clipping off)")
    if cfg.optim.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={cfg.optim.weight_decay}: must be >= 0")
    if cfg.attn_softcap is not None and not cfg.attn_softcap > 0:
        raise ConfigError(f"attn_softcap={cfg.attn_softcap}: must be a positive number, or null for no cap")
    if cfg.z_loss < 0:
        raise ConfigError(f"z_loss={cfg.z_loss}: must be >= 0 (0 turns the z-loss off)")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction}: must be between 0 and 1, exclusive")


def check_shapes(cfg: Any) -> None:
    """Sizes that must fit each other: heads in the width, micro-batches in the batch, sequences in the context."""
    if cfg.model.d_model % cfg.model.n_head:
        raise ConfigError(
            f"model.d_model={cfg.model.d_model} is not divisible by model.n_head={cfg.model.n_head}: "
            "choose a head count that divides the width"
        )
    if cfg.batch_size % cfg.grad_accum:
        raise ConfigError(
            f"batch_size={cfg.batch_size} does not split into grad_accum={cfg.grad_accum} equal "
            "micro-batches: choose grad_accum that divides batch_size"
        )
    if cfg.seq_len > cfg.model.context:
        raise ConfigError(
            f"seq_len={cfg.seq_len} is larger than the model's context (model.context={cfg.model.context}): "
            "lower seq_len or raise model.context"
        )


def check_norm_knobs(cfg: Any) -> None:
    """A knob the norm does not read must keep its default: a set one would be silently ignored.

    A knob at its default is fine, so a config that lists every knob (a saved run's) still loads.
    """
    defaults = type(cfg.norm)()
    for f in fields(cfg.norm):
        value = getattr(cfg.norm, f.name)
        if f.name != "name" and value != getattr(defaults, f.name):
            check_norm_knob(cfg.norm.name, f.name, value)


def check_combination(cfg: Any) -> None:
    """Reject norm × placement × QK-norm combinations that make no sense, saying why."""
    norm, traits = cfg.norm.name, NORM_TRAITS[cfg.norm.name]
    if PLACEMENT_TRAITS[cfg.placement].deepnorm and not traits.classes:
        raise ConfigError(
            f"placement={cfg.placement} with norm={norm}: DeepNorm up-weights the residual by α=(2N)^(1/4) in "
            "every sublayer and relies on the norm after each add to undo it; choose a norm, or placement=post"
        )
    qk_norms = ", ".join(n for n, t in NORM_TRAITS.items() if t.classes and t.per_token and t.gains)
    if cfg.qk_norm and not traits.per_token:
        raise ConfigError(
            f"qk_norm=true with norm={norm}: {traits.title} is not a per-token norm, so it has no per-head form "
            f"for queries and keys; use a per-token norm ({qk_norms}) or qk_norm=false"
        )
    if cfg.qk_norm and traits.classes and not traits.gains:
        raise ConfigError(
            f"qk_norm=true with norm={norm}: normalized queries and keys with no learnable gain have a fixed "
            "length, which bounds every attention logit, so attention cannot sharpen; use a norm with a "
            f"learnable gain ({qk_norms}) or qk_norm=false"
        )
    if traits.batch_statistics:
        check_stat_rows(cfg)


def check_switches(cfg: Any) -> None:
    """The switches around the blocks and in attention: each needs what it acts on."""
    has_norm = bool(NORM_TRAITS[cfg.norm.name].classes)
    if cfg.embed_norm and not has_norm:
        raise ConfigError("embed_norm=true with norm=none: there is no norm to put on the embedding; choose a norm")
    if cfg.embed_norm and NORM_TRAITS[cfg.norm.name].batch_statistics and cfg.norm.causal:
        raise ConfigError(
            f"embed_norm=true with norm={cfg.norm.label}: its per-position statistics subtract the position "
            "embedding exactly, which leaves the model no learned positions; choose another norm or embed_norm=false"
        )
    if cfg.final_norm is True and not has_norm:
        raise ConfigError("final_norm=true with norm=none: there is no norm to put before the head; choose a norm")
    if cfg.residual_gate_init is not None and cfg.residual_gate == "none":
        raise ConfigError(
            f"residual_gate_init={cfg.residual_gate_init:g} with residual_gate=none: there is no gate to "
            "initialize; set residual_gate=rezero or layerscale, or residual_gate_init=null"
        )
    for key, default in (("qk_norm_axis", "head"), ("qk_norm_gains", "shared")):
        if getattr(cfg, key) != default and not cfg.qk_norm:
            raise ConfigError(f"{key}={getattr(cfg, key)} with qk_norm=false: it sets QK-norm's form; add qk_norm=true")
    if cfg.qk_norm_gains == "head":
        check_head_gains(cfg)


def check_head_gains(cfg: Any) -> None:
    """qk_norm_gains=head: per-head gains of a per-head norm that has a gain."""
    if cfg.qk_norm_axis == "all":
        raise ConfigError(
            "qk_norm_gains=head with qk_norm_axis=all: a norm over the whole projection already has a gain "
            "per head and feature; use qk_norm_gains=shared"
        )
    qk = cfg.qk_norm_config()
    traits = NORM_TRAITS[qk.name]
    if not traits.gains or ("weight" in traits.knobs and not qk.weight):
        raise ConfigError(
            f"qk_norm_gains=head with norm={cfg.norm.label}: its QK-norm has no gain to give each head; "
            "choose a norm with a gain, or qk_norm_gains=shared"
        )


def check_stat_rows(cfg: Any) -> None:
    """BatchNorm's statistic groups: stat_rows sequences that divide the micro-batch, at least two values each."""
    rows = cfg.norm.stat_rows
    if rows is not None and (rows < 1 or cfg.micro_batch_size % rows):
        raise ConfigError(
            f"norm.stat_rows={rows}: must divide the micro-batch of {cfg.micro_batch_size} sequences "
            f"(batch_size/grad_accum), or be null for the whole micro-batch"
        )
    # Each statistic needs at least two values: over the group at one position when causal,
    # over the group × time otherwise.
    values = (rows or cfg.micro_batch_size) * (1 if cfg.norm.causal else cfg.seq_len)
    if values < 2:
        group = f"groups of norm.stat_rows={rows} sequences" if rows else "micro-batch"
        where = f"per position, over the {group}" if cfg.norm.causal else f"over {group} × time"
        raise ConfigError(
            f"norm={cfg.norm.label} takes its statistics {where}, which holds {values} value here: "
            "raise norm.stat_rows or batch_size/grad_accum (the micro-batch size) to at least 2"
        )


def check_data(cfg: Any) -> None:
    """The tokenizer and the data keys that depend on the source."""
    _choice("tokenizer.kind", cfg.tokenizer.kind, TOKENIZERS)
    low, high = BPE_VOCAB_RANGE
    if cfg.tokenizer.kind == "bpe" and not low <= cfg.tokenizer.vocab_size <= high:
        raise ConfigError(
            f"tokenizer.vocab_size={cfg.tokenizer.vocab_size}: a byte-level BPE needs between {low} "
            f"(the 256 bytes and one merge) and {high} tokens"
        )
    if cfg.tokenizer.kind == "hf" and not cfg.tokenizer.name:
        raise ConfigError("tokenizer.name is not set: tokenizer=hf needs tokenizer.name=<hub name or local path>, e.g. gpt2")
    if cfg.data.max_bytes is not None and cfg.data.max_bytes < 1:
        raise ConfigError(f"data.max_bytes={cfg.data.max_bytes}: must be an integer >= 1, or null for all the text")
    if cfg.data.streaming and cfg.data.source != "hf":
        raise ConfigError(f"data.streaming=true with data={cfg.data.source}: only data=hf streams")
    if cfg.data.streaming and cfg.data.max_bytes is None and cfg.data.holdout == "tail":
        raise ConfigError("data.streaming=true needs data.max_bytes=N under data.holdout=tail, which reads the stream "
                          "to its end first (e.g. data.max_bytes=100000000 for 100 MB), or data.holdout=hash or first")
    if cfg.data.val_split not in (None, "auto") and cfg.data.source != "hf":
        raise ConfigError(
            f"data.val_split={shown(cfg.data.val_split)} with data={cfg.data.source}: only data=hf has named splits; "
            "use data.val_fraction"
        )
    check_preparation(cfg.data)
    if cfg.data.source == "tokens" and cfg.tokenizer.kind == "bpe":
        raise ConfigError("tokenizer=bpe with data=tokens: a BPE learns its merges from text, which token shards do "
                          "not hold; name the shards' tokenizer: tokenizer=hf tokenizer.name=gpt2 (or a tokenizer.json)")


def check_preparation(data: Any) -> None:
    """How validation is held out, how tokens are prepared, and what data=tokens reads."""
    _choice("data.holdout", data.holdout, HOLDOUTS)
    _choice("data.not_utf8", data.not_utf8, NOT_UTF8)
    _at_least("data.val_docs", data.val_docs, 1)
    if data.holdout != "first" and data.val_docs != type(data)().val_docs:
        raise ConfigError(f"data.val_docs is set, but data.holdout={data.holdout} does not read it: "
                          "add data.holdout=first (the first data.val_docs documents are held out)")
    _at_least("data.workers", 1 if data.workers is None else data.workers, 1)
    _at_least("data.batch_bytes", data.batch_bytes, 1)
    if data.dtype is not None:
        _choice("data.dtype", data.dtype, TOKEN_DTYPES)


def check_limits(cfg: Any) -> None:
    """Values the libraries below would refuse with a traceback, or ignore: checked here, in one line each."""
    low, high = SEED_RANGE
    if not low <= cfg.seed <= high:
        raise ConfigError(f"seed={cfg.seed}: must be an integer between {low} and 2**32-1 ({high})")
    betas = cfg.optim.betas
    if len(betas) != 2 or not all(is_number(b) and 0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"optim.betas={betas}: AdamW takes two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]")
    if cfg.optim.eps < 0:
        raise ConfigError(f"optim.eps={cfg.optim.eps}: must be >= 0")
    vocab = tokenizer_vocab(cfg)
    if cfg.model.vocab_size is not None:
        _at_least("model.vocab_size", cfg.model.vocab_size, 1)
        if vocab is not None and cfg.model.vocab_size < vocab:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({vocab} ids, tokenizer={cfg.tokenizer.kind}): set model.vocab_size=null to follow "
                f"the tokenizer, or at least {vocab}"
            )
    _only_where_read(cfg.data, "data", "source", SOURCE_KEYS)
    _only_where_read(cfg.tokenizer, "tokenizer", "kind", TOKENIZER_KEYS)
    check_wandb_names(cfg.wandb.project, cfg.wandb.tags)


def check_data_source(cfg: Any) -> None:
    """The data source's own keys are set: data=text's files, data=hf's dataset name."""
    if cfg.data.source == "text" and not cfg.data.files:
        raise ConfigError("data.files is empty: data=text needs data.files=[path, ...]")
    if cfg.data.source == "hf" and not cfg.data.name:
        raise ConfigError("data.name is not set: data=hf needs data.name=<hub dataset name>")
    for key in ("train", "val") if cfg.data.source == "tokens" else ():
        if not getattr(cfg.data, key):
            raise ConfigError(f"data.{key} is empty: data=tokens needs data.train=[...] and data.val=[...], files or globs")


def check_wandb_names(project: str | None, tags: list) -> None:
    """wandb's own rules for a project name and tags (wandb.sdk.wandb_settings), checked before a run starts.
    A null project is wandb's own setting (WANDB_PROJECT) or normlab's default, both left to wandb."""
    bad = sorted(set(WANDB_PROJECT_FORBIDDEN) & set(project or ""))
    if project is not None and (not project or len(project) > WANDB_PROJECT_MAX or bad):
        raise ConfigError(
            f"wandb.project={shown(project)}: a wandb project name has 1 to {WANDB_PROJECT_MAX} characters, none of "
            f"{' '.join(WANDB_PROJECT_FORBIDDEN)}" + (f" (found {' '.join(bad)})" if bad else "")
        )
    for tag in tags:
        if not isinstance(tag, (str, int, float)) or isinstance(tag, bool) or not 1 <= len(str(tag)) <= WANDB_TAG_MAX:
            raise ConfigError(f"wandb.tags: tag {shown(tag)} is not allowed: a wandb tag is a string of 1 to {WANDB_TAG_MAX} characters")


def _only_where_read(section: Any, group: str, chooser: str, readers: dict[str, tuple[str, ...]]) -> None:
    """A key of `section` (cfg.data, cfg.tokenizer) that the chosen option (its `chooser` key) does not read must
    keep its default, as a norm's knob must (check_norm_knobs): a set one would be silently ignored."""
    chosen, defaults = getattr(section, chooser), type(section)()
    for key, options in readers.items():
        if chosen not in options and getattr(section, key) != getattr(defaults, key):
            raise ConfigError(
                f"{group}.{key} is set, but {group}={chosen} does not read it: add {group}={options[0]} "
                f"({group}.{key} belongs to {' and '.join(f'{group}={o}' for o in options)})"
            )


def tokenizer_vocab(cfg: Any) -> int | None:
    """The tokenizer's vocabulary as the config alone tells it (byte: 256, bpe: tokenizer.vocab_size); None for
    tokenizer=hf, whose vocabulary is known once it loads."""
    return {"byte": BYTE_VOCAB, "bpe": cfg.tokenizer.vocab_size}.get(cfg.tokenizer.kind)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={shown(value)} is not allowed: choose one of {', '.join(allowed)}")


def _positive(key: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{key}={value}: must be a positive number")


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{key}={value}: must be an integer >= {low}")
