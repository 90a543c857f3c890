"""Corpus: load a source once (through the cache), split off validation text, and tokenize both parts.

Text: a corpus is a sequence of documents (files or dataset rows) joined with a single b"\\n"
between consecutive documents (none before the first or after the last), optionally cut to its
first `DataConfig.max_bytes` bytes. Tokenizers (normlab.data.tokenizer) turn that text into ids; the
default byte tokenizer ("bytes-v1") is the identity on bytes, vocabulary 256.

Split: the dataset's own validation split when `val_split` names one (auto: "validation" if it
exists, data=hf only), else the last `floor(n * val_fraction)` bytes are validation, the rest train.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from normlab.config import TOKENIZERS, ConfigError, DataConfig, TokenizerConfig
from normlab.data.cache import Text, cache_root, cached_encoding, cached_tokens
from normlab.data.errors import DataError
from normlab.data.hf import MissingSplit, hf_source, tokenizer_offline_reason
from normlab.data.sources import Source, capped, stdlib_source, text_source
from normlab.data.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, pretrained, train_bpe


@dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenized corpus split into a training head and a held-out tail (or the dataset's own validation split)."""

    train: torch.Tensor = field(repr=False)  # 1-D token ids: uint8 under the byte tokenizer, uint16 up to 65536 ids
    val: torch.Tensor = field(repr=False)  # 1-D, same dtype: the validation tokens
    vocab_size: int  # the tokenizer's: ids are in [0, vocab_size)
    source: str  # e.g. "stdlib:/usr/lib/python3.11", "text:a.txt,b.txt", "hf:name/split"
    n_bytes: int  # UTF-8 bytes of text, train + val (the token count too under the byte tokenizer)
    sha256: str  # hex sha256 of the train token ids' bytes followed by the val token ids' bytes
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer, repr=False)

    @property
    def token_bytes(self) -> torch.Tensor:
        """int64 tensor of vocab_size entries: the UTF-8 bytes each token id stands for."""
        return torch.from_numpy(self.tokenizer.token_bytes)


def load_corpus(cfg: DataConfig, tokenizer: TokenizerConfig | None = None) -> Corpus:
    """Read the configured source (or its cached bytes), split off validation text, and tokenize both parts.

    `tokenizer` defaults to the byte tokenizer, under which the tokens are the bytes. Validation is the
    dataset's own split when `data.val_split` names one (or is auto and the dataset has a "validation"
    split), else the last `floor(n * val_fraction)` bytes; other tokenizers move that cut forward to the
    next UTF-8 character boundary. Tokens of non-byte tokenizers are cached too (see `cached_encoding`).

    Raises DataError with a one-line message if the source or tokenizer cannot be loaded or the text is
    too small to split, and ConfigError for a val_fraction outside (0, 1).
    """
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction}: must be between 0 and 1, exclusive")
    if cfg.streaming and cfg.max_bytes is None:
        raise ConfigError("data.streaming=true needs data.max_bytes=N: a stream has no end to stop at")
    tokenizer = tokenizer or TokenizerConfig()
    root = cache_root(cfg)
    text = _split_text(cfg, root, char_aligned=tokenizer.kind != "byte")
    tok = _build_tokenizer(tokenizer, root, text.train)
    if tok.kind == "byte":
        train, val, sha256 = text.train, text.val, text.sha256
    else:
        train, val, sha256 = cached_encoding(root, tok, text)
    return Corpus(
        train=torch.from_numpy(train),
        val=torch.from_numpy(val),
        vocab_size=tok.vocab_size,
        source=text.description,
        n_bytes=len(text.train) + len(text.val),
        sha256=sha256,
        tokenizer=tok,
    )


def load_tokenizer(cfg: DataConfig, tokenizer: TokenizerConfig) -> Tokenizer:
    """The tokenizer `load_corpus(cfg, tokenizer)` trains on, without encoding the corpus (a BPE reads the
    training text to find its cache entry, and learns its merges only when that entry is missing)."""
    if tokenizer.kind in ("byte", "hf"):
        return _build_tokenizer(tokenizer, None, None)
    root = cache_root(cfg)
    return _build_tokenizer(tokenizer, root, _split_text(cfg, root, char_aligned=True).train)


def model_vocab_size(requested: int | None, corpus: Corpus) -> int:
    """The model's vocabulary: the tokenizer's when `requested` (model.vocab_size) is None, else `requested`,
    which may pad the tokenizer's (embedding rows no token uses) but never be smaller. ConfigError if it is."""
    if requested is None:
        return corpus.vocab_size
    if requested < corpus.vocab_size:
        raise ConfigError(
            f"model.vocab_size={requested} is smaller than the tokenizer's vocabulary ({corpus.vocab_size} ids, "
            f"{corpus.tokenizer.kind}): set model.vocab_size=null to follow the tokenizer, or at least {corpus.vocab_size}"
        )
    return requested


def _split_text(cfg: DataConfig, root: Path, char_aligned: bool) -> Text:
    """The source's bytes split into training and validation text (see load_corpus)."""
    source = _resolve_source(cfg)
    val_source = _val_source(cfg)
    stream, meta = cached_tokens(root, source)
    if val_source is not None:
        val, _ = cached_tokens(root, val_source)
        digest = hashlib.sha256(stream)
        digest.update(val)
        return Text(stream, val, digest.hexdigest(), f"{source.description}+{val_source.spec['split']}")
    n = len(stream)
    cut = n - int(n * cfg.val_fraction)
    # A tokenizer of text must not see half a UTF-8 character at the cut: move it to the next character.
    while char_aligned and cut < n and stream[cut] & 0xC0 == 0x80:
        cut += 1
    if cut <= 0 or cut >= n:
        raise DataError(
            f"{source.description} has only {n} bytes: too few to split with data.val_fraction={cfg.val_fraction}"
        )
    return Text(stream[:cut], stream[cut:], meta["sha256"], source.description)


def _build_tokenizer(cfg: TokenizerConfig, root: Path | None, train_text: np.ndarray | None) -> Tokenizer:
    """The configured tokenizer; a BPE learns from (or finds the cache entry of) `train_text`."""
    try:
        if cfg.kind == "byte":
            return ByteTokenizer()
        if cfg.kind == "bpe":
            return train_bpe(train_text.tobytes(), cfg.vocab_size, root)
        if cfg.kind == "hf":
            if not cfg.name:
                raise DataError("tokenizer.name is not set: tokenizer=hf needs tokenizer.name=<hub name or local path>, e.g. gpt2")
            reason = tokenizer_offline_reason(cfg.name)
            return pretrained(cfg.name, local_only=reason is not None, offline_reason=reason or "")
    except TokenizerError as err:
        raise DataError(str(err)) from None
    raise ConfigError(f"tokenizer.kind={cfg.kind!r} is not allowed: choose one of {', '.join(TOKENIZERS)}")


def _resolve_source(cfg: DataConfig) -> Source:
    if cfg.source == "stdlib":
        source = stdlib_source()
    elif cfg.source == "text":
        source = text_source(list(cfg.files), cfg.text_field)
    elif cfg.source == "hf":
        source = hf_source(cfg, cfg.split)
    else:
        raise ConfigError(f"data.source={cfg.source!r} is not allowed: choose one of stdlib, text, hf")
    return capped(source, cfg.max_bytes)


def _val_source(cfg: DataConfig) -> Source | None:
    """The dataset's own validation split as a source, or None when validation is cut from the training text.

    data.val_split=auto takes a split named "validation" if the dataset has one; a named split must exist.
    """
    if cfg.source != "hf" or cfg.val_split is None:
        return None
    split = "validation" if cfg.val_split == "auto" else cfg.val_split
    try:
        return capped(hf_source(cfg, split), cfg.max_bytes)
    except MissingSplit as missing:
        if cfg.val_split == "auto":
            return None
        raise DataError(
            f"data.val_split={split!r}: dataset {cfg.name!r} has no such split ({missing}); "
            "name one of its splits, or data.val_split=null to cut data.val_fraction off the training split"
        ) from None
