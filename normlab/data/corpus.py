"""Corpus: load a source once (through the cache), split off validation text, and tokenize both parts.

Text: a corpus is a sequence of documents (files or dataset rows) joined with a single b"\\n"
between consecutive documents (none before the first or after the last), optionally cut to its
first `DataConfig.max_bytes` bytes. Tokenizers (normlab.data.tokenizer) turn that text into ids; the
default byte tokenizer ("bytes-v1") is the identity on bytes, vocabulary 256.

Split: the dataset's own validation split when `val_split` names one (auto: "validation" if it
exists, data=hf only), else `data.holdout` (normlab.data.holdout): by default (tail) the last
`floor(n * val_fraction)` bytes are validation, the rest train. `data=tokens` (normlab.data.tokens)
reads token shards made elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from normlab.config import TOKENIZERS, ConfigError, DataConfig, TokenizerConfig
from normlab.data.cache import Text, cache_root, cached_encoding, cached_file, cached_tokens, files_digest, not_utf8
from normlab.data.errors import DataError
from normlab.data.hf import MissingSplit, hf_source, tokenizer_offline_reason
from normlab.data.holdout import document_units, head_sample
from normlab.data.batches import replaced_bytes
from normlab.data.pieces import NotUtf8, check_utf8
from normlab.data.prepare import Unit
from normlab.data.shards import TokenShards
from normlab.data.sources import Source, capped, stdlib_source, text_source
from normlab.data.tokenizer import BPE_TRAIN_BYTES, ByteTokenizer, Tokenizer, TokenizerError, pretrained, train_bpe
from normlab.data.tokens import token_shards


@dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenized corpus split into training and held-out tokens, each a stream of ids held in shards."""

    train: TokenShards = field(repr=False)  # ids in [0, vocab_size): uint8 from the byte cache, else uint16 or uint32
    val: TokenShards = field(repr=False)  # the validation ids
    vocab_size: int  # the tokenizer's: ids are in [0, vocab_size)
    source: str  # e.g. "stdlib:/usr/lib/python3.11", "text:a.txt,b.txt", "hf:name/split"
    n_bytes: int  # UTF-8 bytes of text, train + val (the token count too under the byte tokenizer)
    sha256: str  # hex sha256 of the train token ids' bytes followed by the val token ids' bytes
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer, repr=False)
    bytes_per_token: np.ndarray | None = field(default=None, repr=False)  # data=tokens: see normlab.data.tokens
    # [val position, bytes to add] of each val token holding a U+FFFD read for bytes that are not UTF-8
    val_corrections: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64), repr=False)

    @property
    def token_bytes(self) -> torch.Tensor:
        """int64 tensor of vocab_size entries: the UTF-8 bytes each token id stands for."""
        lengths = self.tokenizer.token_bytes if self.bytes_per_token is None else self.bytes_per_token
        return torch.from_numpy(lengths)

    def held_out_correction(self, n_batches: int, batch_size: int, seq_len: int) -> int:
        """What to add to `target_bytes(eval_batches(self.val, ...), self.token_bytes)` so that bits per byte counts
        the corpus's own bytes where the text held bytes that are not UTF-8 (data.not_utf8=replace): 0 elsewhere."""
        return replaced_bytes(self.val_corrections, len(self.val), n_batches, batch_size, seq_len)


def load_corpus(cfg: DataConfig, tokenizer: TokenizerConfig | None = None, *, seq_len: int | None = None,
                progress: bool = False) -> Corpus:
    """Read the configured source (or its cached bytes and tokens), split off validation text, and tokenize both parts.

    `tokenizer` defaults to the byte tokenizer, under which the tokens are the bytes. Validation is the
    dataset's own split when `data.val_split` names one (or is auto and the dataset has a "validation"
    split), else what `data.holdout` holds out: under tail the last `floor(n * val_fraction)` bytes, which
    other tokenizers move forward to the next UTF-8 character boundary. Tokens of non-byte tokenizers are
    prepared once (normlab.data.prepare, `data.workers` processes, a bar on stderr with `progress`) and read
    from the cache after. `seq_len`: data=tokens refuses a shard shorter than a window.

    Raises DataError with a one-line message if the source or tokenizer cannot be loaded or the text is
    too small to split or not UTF-8 under a text tokenizer, and ConfigError for a val_fraction outside (0, 1).
    """
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction}: must be between 0 and 1, exclusive")
    if cfg.streaming and cfg.max_bytes is None and cfg.holdout == "tail":
        raise ConfigError("data.streaming=true needs data.max_bytes=N under data.holdout=tail, which reads the stream "
                          "to its end first, or data.holdout=hash or first")
    tokenizer = tokenizer or TokenizerConfig()
    root = cache_root(cfg)
    if cfg.source == "tokens":
        return _tokens_corpus(cfg, _build_tokenizer(tokenizer, None, None), root, seq_len, progress)
    prep = {"workers": cfg.workers or _usable_cores(), "batch_bytes": cfg.batch_bytes, "progress": progress,
            "replace": replaces(cfg)}
    try:
        if cfg.holdout == "tail":
            return _tail_corpus(cfg, tokenizer, root, prep)
        return _document_corpus(cfg, tokenizer, root, prep)
    except NotUtf8 as err:
        raise not_utf8(_resolve_source(cfg).description, err) from None


def _usable_cores() -> int:
    """The cores this process may run on (a SLURM job's or taskset's share), which data.workers=null uses."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on macOS
        return os.cpu_count() or 1


def replaces(cfg: DataConfig) -> bool:
    """Whether a text tokenizer reads bytes that are not UTF-8 as U+FFFD (data.not_utf8; auto: for the bundled
    corpus only, whose standard library holds a few files in older encodings), rather than refuse the corpus."""
    return cfg.not_utf8 == "replace" or cfg.not_utf8 == "auto" and cfg.source == "stdlib"


def _tail_corpus(cfg: DataConfig, tokenizer: TokenizerConfig, root: Path, prep: dict) -> Corpus:
    """The corpus text read into the byte cache, its tail held out, the two parts encoded."""
    text = _split_text(cfg, root, char_aligned=tokenizer.kind != "byte", utf8=not prep["replace"])
    tok = _build_tokenizer(tokenizer, root, text, prep["replace"])
    n_bytes = len(text.train) + len(text.val)
    if tok.kind == "byte":
        return Corpus(train=TokenShards.of(text.train), val=TokenShards.of(text.val), vocab_size=tok.vocab_size,
                      source=text.description, n_bytes=n_bytes, sha256=text.sha256, tokenizer=tok)
    units = [Unit("train", (text.train_file,), "the training text"), Unit("val", (text.val_file,), "the validation text")]
    identity = {"tokenizer": tok.identity, "text_sha256": text.sha256, "n_train_bytes": len(text.train)}
    encoded = cached_encoding(root, tok, identity, lambda start: iter(units[start:]), text.description,
                              legacy=lambda: _is_utf8(text.val_file), total_bytes=n_bytes, **prep)
    return Corpus(train=encoded.train, val=encoded.val, vocab_size=tok.vocab_size, source=text.description,
                  n_bytes=n_bytes, sha256=encoded.sha256, tokenizer=tok, val_corrections=_corrections(encoded.meta))


def _is_utf8(text) -> bool:
    try:
        check_utf8((text,))
    except NotUtf8:
        return False
    return True


def _corrections(meta: dict) -> np.ndarray:
    return np.array(meta.get("val_corrections") or [], dtype=np.int64).reshape(-1, 2)


def _document_corpus(cfg: DataConfig, tokenizer: TokenizerConfig, root: Path, prep: dict) -> Corpus:
    """The documents streamed from the source into token shards, each held out or not as it comes."""
    source, val_source = _resolve_source(cfg), _val_source(cfg)
    units_from = lambda start: document_units(source, val_source, cfg, start)  # noqa: E731
    tok = _build_tokenizer(tokenizer, root, units_from, prep["replace"])
    identity = {"tokenizer": tok.identity, "source": source.spec, "val_source": val_source and val_source.spec,
                "holdout": cfg.holdout, "val_fraction": cfg.val_fraction, "val_docs": cfg.val_docs}
    description = source.description + (f"+{val_source.spec['split']}" if val_source else "")
    encoded = cached_encoding(root, tok, identity, units_from, description, total_bytes=_size_hint(source, cfg), **prep)
    return Corpus(train=encoded.train, val=encoded.val, vocab_size=tok.vocab_size, source=description,
                  n_bytes=int(encoded.meta["n_bytes"]), sha256=encoded.sha256, tokenizer=tok,
                  val_corrections=_corrections(encoded.meta))


def _size_hint(source: Source, cfg: DataConfig) -> int | None:
    """The corpus text's bytes as the source's listing tells them (for the progress bar's ETA): its files and the
    separators between them; None where the listing does not say (a stream, .jsonl rows)."""
    files = source.spec.get("files")
    if not files or source.spec.get("jsonl_field") is not None:
        return cfg.max_bytes
    size = sum(int(f[1]) for f in files) + len(files) - 1
    return min(size, cfg.max_bytes) if cfg.max_bytes else size


def _tokens_corpus(cfg: DataConfig, tok: Tokenizer, root: Path, seq_len: int | None, progress: bool) -> Corpus:
    shards = token_shards(cfg, tok, root, seq_len, progress)
    return Corpus(train=shards.train, val=shards.val, vocab_size=tok.vocab_size, source=shards.description,
                  n_bytes=shards.n_bytes, sha256=shards.sha256, tokenizer=tok, bytes_per_token=shards.bytes_per_token)


def load_tokenizer(cfg: DataConfig, tokenizer: TokenizerConfig) -> Tokenizer:
    """The tokenizer `load_corpus(cfg, tokenizer)` trains on, without encoding the corpus (a BPE reads the
    training text to find its cache entry, and learns its merges only when that entry is missing)."""
    if tokenizer.kind in ("byte", "hf"):
        return _build_tokenizer(tokenizer, None, None)
    root, replace = cache_root(cfg), replaces(cfg)
    try:
        if cfg.holdout == "tail":
            return _build_tokenizer(tokenizer, root, _split_text(cfg, root, True, not replace), replace)
        source, val_source = _resolve_source(cfg), _val_source(cfg)
        return _build_tokenizer(tokenizer, root, lambda start: document_units(source, val_source, cfg, start), replace)
    except NotUtf8 as err:
        raise not_utf8(_resolve_source(cfg).description, err) from None


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


def _split_text(cfg: DataConfig, root: Path, char_aligned: bool, utf8: bool = False) -> Text:
    """The source's bytes split into training and validation text (see load_corpus); with `utf8`, a source that is
    not UTF-8 is refused before its bytes are cached."""
    source = _resolve_source(cfg)
    val_source = _val_source(cfg)
    stream, meta = cached_tokens(root, source, utf8=utf8)
    file = cached_file(root, source)
    if val_source is not None:
        val, _ = cached_tokens(root, val_source, utf8=utf8)
        val_file = cached_file(root, val_source)
        # the sha256 of the two texts one after the other, as the tokens of the byte tokenizer are
        return Text(stream, val, files_digest([file, val_file]), f"{source.description}+{val_source.spec['split']}",
                    file, val_file)
    n = len(stream)
    cut = n - int(n * cfg.val_fraction)
    # A tokenizer of text must not see half a UTF-8 character at the cut: move it to the next character.
    while char_aligned and cut < n and stream[cut] & 0xC0 == 0x80:
        cut += 1
    if cut <= 0 or cut >= n:
        raise DataError(
            f"{source.description} has only {n} bytes: too few to split with data.val_fraction={cfg.val_fraction}"
        )
    return Text(stream[:cut], stream[cut:], meta["sha256"], source.description, file[:cut], file[cut:])


def _build_tokenizer(cfg: TokenizerConfig, root: Path | None, text, replace: bool = False) -> Tokenizer:
    """The configured tokenizer. A BPE learns from (or finds the cache entry of) the training text: `text`'s
    train part (a Text, whose cache entry and cut name it), or the head of the training documents that
    `text(0)` yields (a function giving units: normlab.data.holdout.head_sample)."""
    try:
        if cfg.kind == "byte":
            return ByteTokenizer()
        if cfg.kind == "bpe":
            if isinstance(text, Text):
                # The whole text's sha256 and the cut name the training text without hashing it again.
                name = json.dumps({"text_sha256": text.sha256, "n_train_bytes": len(text.train)}, sort_keys=True)
                return train_bpe(text.train_file, cfg.vocab_size, root, hashlib.sha256(name.encode()).hexdigest(), replace)
            sample = head_sample(text(0), BPE_TRAIN_BYTES)
            if not sample:
                raise DataError("the training split holds no text to learn a BPE from (every document was held "
                                "out): use more documents, a smaller data.val_fraction or data.val_docs")
            return train_bpe(sample, cfg.vocab_size, root, replace=replace)
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
