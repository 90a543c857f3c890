"""The token cache: its root, keys and entries, written once under a lock and read back by mmap.

Cache: the byte stream of a source is written once and reused. The cache
directory is `DataConfig.cache_dir` if set, else `$NORMLAB_CACHE` if set, else
`~/.cache/normlab`. An entry is two files named after the source kind and a
key, a hash of the tokenizer, the separator and the source's identity:

    <kind>-<key>.bin    the raw bytes (`sha256sum` of it equals meta's sha256)
    <kind>-<key>.json   {"key", "tokenizer", "source", "n_bytes", "sha256", "spec"}

The identity is cheap to compute without reading content: for stdlib and text
it lists each file's path, size and mtime_ns; for hf it is name, config, split,
column and the loaded dataset's fingerprint (a stream: name, split and max_bytes).
Other tokenizers add a BPE file (normlab.data.tokenizer) and the encoded splits, an entry
`tokens-<key>/` (normlab.data.prepare: meta.json, the shards `train-000000.bin`, ..., `val-000000.bin`
in llm.c's format, tokenizer.json), built in `tokens-<key>.partial/` and renamed into place when whole;
entries written before shards were (`tokens-<key>.{train,val}.bin` and `tokens-<key>.json`) are read
as they are. Every file is written to a temporary name in the same directory and moved into place with
`os.replace`, so concurrent jobs never see half an entry; on POSIX a lock file additionally lets only
one job build an entry while the others wait and then reuse it.

Reading an entry checks its sizes, and re-hashes its content against the sha256 it records when it
holds at most VERIFY_BYTES (re-hashing tens of GB would cost every run tens of seconds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from normlab.config import DataConfig
from normlab.data.errors import DataError
from normlab.data.pieces import FileText, NotUtf8, blocks, check_utf8
from normlab.data.prepare import Unit, prepare
from normlab.data.shards import TokenShards, read_shard, shard_dtype
from normlab.data.sources import Source
from normlab.data.tokenizer import Tokenizer
from normlab.util.files import atomic_path, exclusive, write_bytes_atomic


log = logging.getLogger(__name__)

TOKENIZER = "bytes-v1"
VOCAB_SIZE = 256
SEPARATOR = b"\n"
VERIFY_BYTES = 1 << 30


@dataclass(frozen=True)
class Text:
    """The corpus as bytes: training text, validation text, and the sha256 of the two concatenated.

    Built by normlab.data.corpus from cached byte streams; `cached_encoding` keys its entries by it.
    """

    train: np.ndarray  # uint8, memory-mapped: what the byte tokenizer trains on
    val: np.ndarray  # uint8
    sha256: str
    description: str
    train_file: FileText  # the same bytes, for reading a block at a time (normlab.data.pieces)
    val_file: FileText


def cache_root(cfg: DataConfig) -> Path:
    configured = cfg.cache_dir or os.environ.get("NORMLAB_CACHE") or "~/.cache/normlab"
    root = Path(os.path.expanduser(str(configured)))
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"cannot create the token cache directory {root}: {err.strerror or err}; "
            "set data.cache_dir or NORMLAB_CACHE"
        ) from None
    return root


def _cache_key(source: Source) -> str:
    identity = {"tokenizer": TOKENIZER, "separator": SEPARATOR.hex(), "spec": source.spec}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def cached_tokens(root: Path, source: Source, utf8: bool = False) -> tuple[np.ndarray, dict]:
    """The source's tokens as a uint8 array plus the entry's metadata, building the cache entry on a miss.

    With `utf8` (a text tokenizer reads it), a source that is not UTF-8 is refused with a DataError before its
    entry is written."""
    key = _cache_key(source)
    bin_path = root / f"{source.kind}-{key}.bin"
    meta_path = root / f"{source.kind}-{key}.json"
    hit = _read_entry(bin_path, meta_path, key, warn=False)
    if hit is not None:
        return hit
    try:
        with exclusive(root / f"{source.kind}-{key}.lock"):
            # Another job may have finished building this entry while we waited for the lock.
            hit = _read_entry(bin_path, meta_path, key, warn=True)
            if hit is not None:
                return hit
            n_bytes, sha256 = _write_tokens(source.documents(), bin_path, source.description if utf8 else None)
            if n_bytes == 0:
                bin_path.unlink()
                raise DataError(f"{source.description} is empty: there is nothing to train on")
            meta = {
                "key": key,
                "tokenizer": TOKENIZER,
                "source": source.description,
                "n_bytes": n_bytes,
                "sha256": sha256,
                "spec": source.spec,
            }
            # The metadata goes in last: its presence is what marks the entry complete.
            write_bytes_atomic(meta_path, json.dumps(meta, indent=1).encode())
            return _map_tokens(bin_path, n_bytes), meta
    except OSError as err:
        # Source read failures are already DataErrors, so an OSError here is about the cache itself.
        raise DataError(
            f"cannot write the token cache in {root}: {err.strerror or err}; set data.cache_dir or NORMLAB_CACHE"
        ) from None


def cached_file(root: Path, source: Source) -> FileText:
    """The file of the source's byte cache entry (cached_tokens makes it), to read a block at a time."""
    return FileText.whole(root / f"{source.kind}-{_cache_key(source)}.bin")


def _read_entry(bin_path: Path, meta_path: Path, key: str, warn: bool) -> tuple[np.ndarray, dict] | None:
    """A complete, verified cache entry, or None if it is missing, stale or damaged (said in a warning if `warn`:
    the entry is looked at before the lock is taken and again under it, and rebuilt once)."""
    try:
        meta = json.loads(meta_path.read_bytes())
        n_bytes = int(meta["n_bytes"])
        if meta["key"] != key or meta["tokenizer"] != TOKENIZER or n_bytes <= 0:
            return None
        if bin_path.stat().st_size != n_bytes:
            raise ValueError(f"{bin_path} holds {bin_path.stat().st_size} bytes, metadata says {n_bytes}")
        tokens = _map_tokens(bin_path, n_bytes)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        if warn:
            log.warning("rebuilding damaged token cache entry %s: %s", meta_path, err)
        return None
    # Hashing the mapped file costs tens of ms for the stdlib corpus and guarantees that the
    # reported sha256 describes the tokens actually trained on.
    if n_bytes <= VERIFY_BYTES and files_digest([FileText.whole(bin_path)]) != meta.get("sha256"):
        if warn:
            log.warning("rebuilding token cache entry %s: content does not match its sha256", bin_path)
        return None
    return tokens, meta


def _map_tokens(path: Path, n_bytes: int) -> np.ndarray:
    return _map(path, np.dtype(np.uint8), n_bytes)


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """The `count` values of `dtype` in `path`; ValueError if the file holds a different number of bytes."""
    size = path.stat().st_size
    if size != count * dtype.itemsize:
        raise ValueError(f"{path} holds {size} bytes, metadata says {count} × {dtype.itemsize}")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    # Copy-on-write mapping: jobs share the page cache, and the array is writable, which
    # torch.from_numpy requires; writes never reach the file.
    return np.asarray(np.memmap(path, dtype=dtype, mode="c", shape=(count,)))


def _write_tokens(documents: Iterable[bytes], dest: Path, utf8_of: str | None = None) -> tuple[int, str]:
    """Stream the documents, separator-joined, into `dest` atomically; return (token count, hex sha256).
    With `utf8_of` (the source's description) a document that is not UTF-8 raises DataError and nothing is kept."""
    digest = hashlib.sha256()
    count = 0

    with atomic_path(dest) as tmp, open(tmp, "wb") as fh:
        for i, doc in enumerate(documents):
            if utf8_of is not None:
                try:
                    check_utf8((doc,))
                except NotUtf8 as err:
                    err.where = f"document {i}"
                    raise not_utf8(utf8_of, err) from None
            for _, block in blocks((doc,) if i == 0 else (SEPARATOR, doc), size=1 << 20):
                fh.write(block)
                digest.update(block)
                count += len(block)
    return count, digest.hexdigest()


def not_utf8(description: str, err: NotUtf8) -> DataError:
    """The one-line refusal of a corpus that is not UTF-8 under a text tokenizer."""
    return DataError(f"{description} is not UTF-8: the byte 0x{err.byte:02x} at byte offset {err.offset} of "
                     f"{err.where}; a text tokenizer (bpe, hf) reads UTF-8 text: use tokenizer=byte, or data.not_utf8=replace to "
                     "read such bytes as U+FFFD")


@dataclass(frozen=True)
class Encoded:
    """A corpus's encoded splits as read from the cache, their sha256 (train ids' bytes then val's) and meta."""

    train: TokenShards
    val: TokenShards
    sha256: str
    meta: dict


def encoding_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def cached_encoding(root: Path, tok: Tokenizer, identity: dict, units_from: Callable[[int], Iterator[Unit]],
                    description: str, legacy: Callable[[], bool] | None = None, **prep) -> Encoded:
    """The splits `units_from(0)` yields, encoded by `tok` once (normlab.data.prepare, with `prep`'s workers,
    batch_bytes, progress, total_bytes and replace) and then read from the cache entry that `identity` keys: the
    tokenizer's identity and what identifies the text. An entry of the older two-file form is read where
    `legacy()` says it may be (it records no corrections for bytes that are not UTF-8, so the text must have
    none). Raises NotUtf8 for a text that is not UTF-8 (unless prep's replace)."""
    key = encoding_key(identity)
    hit = _read_encoding(root, key, tok, legacy, warn=False)
    if hit is not None:
        return hit
    try:
        with exclusive(root / f"tokens-{key}.lock"):
            hit = _read_encoding(root, key, tok, legacy, warn=True)
            if hit is not None:
                return hit
            log.info("encoding %s with %s (once; cached in %s)", description, tok.identity, root)
            meta = {**identity, "key": key, "dtype": shard_dtype(tok.vocab_size).str, "description": description}
            meta = prepare(root / f"tokens-{key}", units_from, tok, meta, **prep)
            if meta["replaced"]:
                log.warning("%s: read %d runs of bytes that are not UTF-8 as U+FFFD (data.not_utf8=replace); bits per "
                            "byte counts the bytes they stand for", description, meta["replaced"])
            folder = root / f"tokens-{key}"
            train, val = (_shards(folder, meta, split) for split in ("train", "val"))
            return Encoded(train, val, meta["sha256"], meta)
    except OSError as err:
        raise DataError(
            f"cannot write the token cache in {root}: {err.strerror or err}; free space there or set data.cache_dir "
            "or NORMLAB_CACHE (the next run resumes from the last complete shard)"
        ) from None


def _shards(folder: Path, meta: dict, split: str) -> TokenShards:
    return TokenShards([read_shard(folder / name, key=str(folder)) for name in meta["shards"][split]])


def _read_encoding(root: Path, key: str, tok: Tokenizer, legacy: Callable[[], bool] | None, warn: bool) -> Encoded | None:
    """A complete, verified encoding entry (sharded, or of the older two-file form), or None if it is missing,
    stale or damaged (said in a warning if `warn`)."""
    folder = root / f"tokens-{key}"
    try:
        if folder.is_dir():
            meta = json.loads((folder / "meta.json").read_bytes())
            if meta["key"] != key or meta["dtype"] != shard_dtype(tok.vocab_size).str:
                return None
            train, val = (_shards(folder, meta, split) for split in ("train", "val"))
            if (len(train), len(val)) != (meta["n_train"], meta["n_val"]):
                raise ValueError(f"the shards hold {len(train)} and {len(val)} ids, meta.json says "
                                 f"{meta['n_train']} and {meta['n_val']}")
            spans = [FileText(s.filename, s.offset, s.nbytes) for s in (*train.shards, *val.shards)]
        else:
            meta = json.loads((root / f"tokens-{key}.json").read_bytes())
            if meta["key"] != key or meta["dtype"] != tok.dtype.str or legacy is None or not legacy():
                return None
            paths = [root / f"tokens-{key}.{part}.bin" for part in ("train", "val")]
            train, val = (TokenShards([_map(path, tok.dtype, int(meta[f"n_{part}"]))])
                          for path, part in zip(paths, ("train", "val")))
            spans = [FileText.whole(path) for path in paths]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, DataError) as err:
        if warn:
            log.warning("re-encoding damaged token cache entry tokens-%s in %s: %s", key, root, err)
        return None
    size = (len(train) + len(val)) * train.dtype.itemsize
    if size <= VERIFY_BYTES and files_digest(spans) != meta.get("sha256"):
        if warn:
            log.warning("re-encoding token cache entry tokens-%s in %s: content does not match its sha256", key, root)
        return None
    return Encoded(train, val, meta["sha256"], meta)


def files_digest(spans: list[FileText]) -> str:
    """The sha256 of the spans' bytes one after another, read a block at a time (hashing through a mapping would
    hold every page of it in the process's memory)."""
    digest = hashlib.sha256()
    for _, block in blocks(spans, size=1 << 20):
        digest.update(block)
    return digest.hexdigest()
