"""Tokenizers: bytes to token ids and back, and how many text bytes each token stands for.

Three kinds (`TokenizerConfig.kind`):
  byte  a token is one raw byte ("bytes-v1"): vocabulary 256, encoding is the identity.
  bpe   a byte-level BPE trained with Hugging Face `tokenizers` on the training split's text.
        Training is deterministic and cached in the token cache dir as
        `bpe-<sha256 of the training text>-v<vocab_size>.json`.
  hf    a pretrained tokenizer (GPT-2's, ...): a tokenizer.json file, a directory holding
        one, or a hub name looked up in the Hugging Face cache (or downloaded when online).

Every tokenizer has an `identity` (a hash of its full definition) that keys the cache of the
encoded corpus, and `token_bytes`, the UTF-8 byte length of each token id, so a loss per token
converts to bits per byte. Nothing here touches the network on its own: the caller decides
whether a hub download may be tried (`local_only`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

from normlab.config import BPE_VOCAB_RANGE
from normlab.data.pieces import blocks, newline_chunks, text_pieces
from normlab.util.errors import one_line
from normlab.util.files import atomic_path

BYTE_VOCAB = 256
MAX_VOCAB_UINT16 = 1 << 16
MIN_BPE_VOCAB, MAX_BPE_VOCAB = BPE_VOCAB_RANGE
# BPE merges are learned from at most this many characters of the training text, taken as evenly spaced
# pieces: on the stdlib corpus (28 MB of training text) that keeps training to seconds, and
# merge statistics of a few MB of the same text are close to those of all of it.
BPE_TRAIN_BYTES = 8 << 20


class TokenizerError(RuntimeError):
    """A tokenizer that cannot be built or loaded; the message is one line."""


class Tokenizer:
    """Bytes in, token ids out, and back.

    `vocab_size`: ids are in [0, vocab_size). `token_bytes[i]`: the number of UTF-8 bytes token
    `i` stands for. `identity`: a short string that changes whenever the encoding could.
    """

    kind: str
    vocab_size: int
    identity: str
    token_bytes: np.ndarray

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned dtype that holds every id (uint8 for bytes, uint16 up to 65536 ids, else uint32)."""
        if self.vocab_size <= BYTE_VOCAB:
            return np.dtype(np.uint8)
        return np.dtype(np.uint16) if self.vocab_size <= MAX_VOCAB_UINT16 else np.dtype(np.uint32)

    def encode(self, data: bytes | str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """A token is one raw byte; decoding replaces bytes that are not valid UTF-8."""

    kind = "byte"
    vocab_size = BYTE_VOCAB
    identity = "bytes-v1"

    def __init__(self) -> None:
        self.token_bytes = np.ones(BYTE_VOCAB, dtype=np.int64)

    def encode(self, data: bytes | str) -> np.ndarray:
        """The bytes of `data`: a str's UTF-8, where a surrogate-escaped byte ('\\udcff', as Python passes
        bytes of argv or a file name that are not UTF-8) is that raw byte."""
        try:
            raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else bytes(data)
        except UnicodeEncodeError:
            raise not_utf8(data, self.kind) from None
        return np.frombuffer(raw, dtype=np.uint8).copy()

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer` (a trained BPE or a pretrained one)."""

    def __init__(self, kind: str, tokenizer, description: str):
        self.kind = kind
        self.backend = tokenizer
        self.description = description
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        definition = tokenizer.to_str()
        self.identity = f"{kind}-" + hashlib.sha256(definition.encode()).hexdigest()[:16]
        self.token_bytes = _token_byte_lengths(tokenizer, self.vocab_size)

    def encode(self, data: bytes | str) -> np.ndarray:
        """Ids of the whole text, encoded in newline-aligned chunks (deterministic for a given text)."""
        text = data.decode("utf-8", errors="replace") if isinstance(data, (bytes, bytearray, memoryview)) else data
        pieces = list(newline_chunks(text))
        if not pieces:
            return np.zeros(0, dtype=self.dtype)
        try:
            encodings = self.backend.encode_batch_fast(pieces, add_special_tokens=False)
        except TypeError:  # what `tokenizers` says of a str that holds a surrogate, which is not text
            if any("\ud800" <= c <= "\udfff" for c in text):
                raise not_utf8(text, self.kind) from None
            raise
        return np.concatenate([np.asarray(e.ids, dtype=self.dtype) for e in encodings])

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer's definition (tokenizer.json format) to `path`."""
        self.backend.save(str(path))


def not_utf8(text: str, kind: str) -> TokenizerError:
    """The one-line refusal of `text` holding a surrogate, by a tokenizer of `kind`: a surrogate-escaped byte
    is a byte that is not UTF-8, which only the byte tokenizer takes; any other surrogate stands for no byte."""
    i, char = next((i, c) for i, c in enumerate(text) if "\ud800" <= c <= "\udfff")
    if kind == "byte" or not "\udc80" <= char <= "\udcff":
        return TokenizerError(f"the text holds the lone surrogate U+{ord(char):04X} at position {i}, "
                              "which is neither UTF-8 text nor an escaped byte")
    return TokenizerError(f"the text is not UTF-8: the byte 0x{ord(char) - 0xDC00:02x} at position {i}; tokenizer={kind} "
                          "reads UTF-8 text only (a byte-tokenizer run takes any bytes)")


def check_bpe_vocab(vocab_size: int) -> None:
    if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
        raise TokenizerError(
            f"tokenizer.vocab_size={vocab_size}: a byte-level BPE needs between {MIN_BPE_VOCAB} "
            f"(the 256 bytes and one merge) and {MAX_BPE_VOCAB} tokens"
        )


def train_bpe(train_text, vocab_size: int, cache_dir: str | os.PathLike, text_id: str | None = None,
              replace: bool = False) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` tokens learned from `train_text` (bytes, a uint8 array, or a FileText read a
    block at a time), read from the cache when built before.

    The cache file is `bpe-<text_id[:24]>-v<vocab_size>.json` in `cache_dir`, `text_id` a hex digest naming the
    text (default: its sha256); the same text and size always give the same tokenizer. Memory holds the sample
    learned from (about BPE_TRAIN_BYTES characters), never the whole text. Raises
    normlab.data.pieces.NotUtf8 for a text that is not UTF-8, unless `replace` (such bytes are read as U+FFFD).
    """
    check_bpe_vocab(vocab_size)
    if text_id is None:
        digest = hashlib.sha256()
        for _, block in blocks((train_text,), size=1 << 20):
            digest.update(block)
        text_id = digest.hexdigest()
    path = bpe_cache_path(cache_dir, text_id, vocab_size)
    if path.is_file():
        try:
            return from_file(path, kind="bpe")
        except TokenizerError:
            pass  # a damaged cache file is rebuilt below
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    backend.train_from_iterator(_spread_sample((train_text,), BPE_TRAIN_BYTES, replace), trainer=trainer)
    tokenizer = HFTokenizer("bpe", backend, f"bpe:{vocab_size}")
    # Same directory, then one rename: concurrent jobs never read half a file.
    try:
        with atomic_path(path) as tmp:
            tokenizer.save(str(tmp))
    except Exception as err:
        raise TokenizerError(f"cannot write the BPE cache file {path}: {one_line(err)}") from None
    return tokenizer


def bpe_cache_path(cache_dir: str | os.PathLike, text_id: str, vocab_size: int) -> Path:
    return Path(cache_dir) / f"bpe-{text_id[:24]}-v{vocab_size}.json"


def _spread_sample(parts, budget: int, replace: bool) -> list[str]:
    """All the pieces (normlab.data.pieces.text_pieces) of the text made of `parts` if it is within `budget`
    characters, else every k-th piece, k = round(characters / budget): about `budget` characters, evenly spread.
    The text is read twice (its characters counted, then its pieces cut), a block at a time."""
    chars = sum(len(piece) for piece, _, _ in text_pieces(parts, replace=replace))
    stride = 1 if chars <= budget else max(1, round(chars / budget))
    return [piece for i, (piece, _, _) in enumerate(text_pieces(parts, replace=replace)) if i % stride == 0]


def from_file(path: str | os.PathLike, kind: str = "hf") -> HFTokenizer:
    """A tokenizer from a tokenizer.json file, or a directory that holds one."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"tokenizer.name: {path} does not exist (give a tokenizer.json, a directory holding one, or a hub name)")
    try:
        backend = Backend.from_file(str(path))
    except Exception as err:
        raise TokenizerError(f"{path} is not a tokenizers file (tokenizer.json): {one_line(err)}") from None
    return HFTokenizer(kind, backend, f"{kind}:{path}")


def pretrained(name: str, local_only: bool, offline_reason: str = "") -> HFTokenizer:
    """The pretrained tokenizer `name`: a local file or directory, else the hub repo's tokenizer.json.

    With `local_only`, only the Hugging Face cache is read; a tokenizer missing from it raises
    TokenizerError at once, naming `offline_reason`.
    """
    if os.path.exists(os.path.expanduser(name)):
        return from_file(os.path.expanduser(name))
    from huggingface_hub import hf_hub_download  # only for a hub name, and it pulls in an HTTP stack

    try:
        path = hf_hub_download(name, "tokenizer.json", local_files_only=local_only)
    except Exception as err:
        if local_only:
            raise TokenizerError(
                f"{offline_reason or 'offline'} and tokenizer {name!r} is not in the Hugging Face cache; "
                "run once with network access to download it, or give a local tokenizer.json"
            ) from None
        raise TokenizerError(f"cannot load tokenizer {name!r} from the Hugging Face hub: {one_line(err)}") from None
    tokenizer = from_file(path)
    tokenizer.description = f"hf:{name}"
    return tokenizer


def _token_byte_lengths(backend, vocab_size: int) -> np.ndarray:
    """The UTF-8 byte length of every id: exact for byte-level vocabularies (GPT-2, our BPE), where each
    character of a token's string stands for one byte; otherwise the length of the token decoded alone."""
    byte_level = isinstance(backend.decoder, decoders.ByteLevel)
    byte_chars = set(pre_tokenizers.ByteLevel.alphabet())
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    lengths = np.zeros(vocab_size, dtype=np.int64)
    for i in range(vocab_size):
        if i in added:
            lengths[i] = len(added[i].encode("utf-8"))
            continue
        piece = backend.id_to_token(i)
        if piece is None:
            continue
        if byte_level and all(c in byte_chars for c in piece):
            lengths[i] = len(piece)
        else:
            lengths[i] = len(backend.decode([i], skip_special_tokens=False).encode("utf-8"))
    return lengths
