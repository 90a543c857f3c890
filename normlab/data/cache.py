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
Other tokenizers add a BPE file (normlab.data.tokenizer) and `tokens-<key>.{train,val}.bin`
plus `tokens-<key>.json` holding the encoded splits. Every file is written to a
temporary name in the same directory and moved into place with `os.replace`,
so concurrent jobs never see half an entry; on POSIX a lock file additionally
lets only one job build an entry while the others wait and then reuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from normlab.config import DataConfig
from normlab.data.errors import DataError
from normlab.data.sources import Source
from normlab.data.tokenizer import Tokenizer
from normlab.util.files import atomic_path, exclusive, write_bytes_atomic


log = logging.getLogger(__name__)

TOKENIZER = "bytes-v1"
VOCAB_SIZE = 256
SEPARATOR = b"\n"


@dataclass(frozen=True)
class Text:
    """The corpus as bytes: training text, validation text, and the sha256 of the two concatenated.

    Built by normlab.data.corpus from cached byte streams; `cached_encoding` keys its entries by it.
    """

    train: np.ndarray  # uint8
    val: np.ndarray  # uint8
    sha256: str
    description: str


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


def cached_tokens(root: Path, source: Source) -> tuple[np.ndarray, dict]:
    """The source's tokens as a uint8 array plus the entry's metadata, building the cache entry on a miss."""
    key = _cache_key(source)
    bin_path = root / f"{source.kind}-{key}.bin"
    meta_path = root / f"{source.kind}-{key}.json"
    hit = _read_entry(bin_path, meta_path, key)
    if hit is not None:
        return hit
    try:
        with exclusive(root / f"{source.kind}-{key}.lock"):
            # Another job may have finished building this entry while we waited for the lock.
            hit = _read_entry(bin_path, meta_path, key)
            if hit is not None:
                return hit
            n_bytes, sha256 = _write_tokens(source.documents(), bin_path)
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


def _read_entry(bin_path: Path, meta_path: Path, key: str) -> tuple[np.ndarray, dict] | None:
    """A complete, verified cache entry, or None if it is missing, stale or damaged."""
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
        log.warning("rebuilding damaged token cache entry %s: %s", meta_path, err)
        return None
    # Hashing the mapped file costs tens of ms for the stdlib corpus and guarantees that the
    # reported sha256 describes the tokens actually trained on.
    if hashlib.sha256(tokens).hexdigest() != meta.get("sha256"):
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


def _write_tokens(documents: Iterable[bytes], dest: Path) -> tuple[int, str]:
    """Stream the documents, separator-joined, into `dest` atomically; return (token count, hex sha256)."""
    digest = hashlib.sha256()
    count = 0

    with atomic_path(dest) as tmp, open(tmp, "wb") as fh:
        for i, doc in enumerate(documents):
            pieces = (doc,) if i == 0 else (SEPARATOR, doc)
            for piece in pieces:
                fh.write(piece)
                digest.update(piece)
                count += len(piece)
    return count, digest.hexdigest()


def cached_encoding(root: Path, tok: Tokenizer, text: Text) -> tuple[np.ndarray, np.ndarray, str]:
    """(train ids, val ids, sha256 of both) of `text` under `tok`, encoded once and then read from the cache.

    An entry is `tokens-<key>.train.bin`, `tokens-<key>.val.bin` (ids in `tok.dtype`, native byte order)
    and `tokens-<key>.json`, keyed by the tokenizer's identity, the text's sha256 and the cut.
    """
    identity = {"tokenizer": tok.identity, "text_sha256": text.sha256, "n_train_bytes": len(text.train)}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    paths = {part: root / f"tokens-{key}.{part}.bin" for part in ("train", "val")}
    meta_path = root / f"tokens-{key}.json"
    hit = _read_encoding(paths, meta_path, key, tok.dtype)
    if hit is not None:
        return hit
    try:
        with exclusive(root / f"tokens-{key}.lock"):
            hit = _read_encoding(paths, meta_path, key, tok.dtype)
            if hit is not None:
                return hit
            log.info("encoding %s with %s (once; cached in %s)", text.description, tok.identity, root)
            ids = {"train": tok.encode(text.train.tobytes()), "val": tok.encode(text.val.tobytes())}
            digest = hashlib.sha256(ids["train"])
            digest.update(ids["val"])
            for part, array in ids.items():
                write_bytes_atomic(paths[part], array.tobytes())
            meta = {**identity, "key": key, "dtype": tok.dtype.str, "sha256": digest.hexdigest(),
                    "n_train": len(ids["train"]), "n_val": len(ids["val"])}
            write_bytes_atomic(meta_path, json.dumps(meta, indent=1).encode())
            return ids["train"], ids["val"], meta["sha256"]
    except OSError as err:
        raise DataError(
            f"cannot write the token cache in {root}: {err.strerror or err}; set data.cache_dir or NORMLAB_CACHE"
        ) from None


def _read_encoding(paths: dict, meta_path: Path, key: str, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, str] | None:
    """A complete, verified encoding entry, or None if it is missing, stale or damaged."""
    try:
        meta = json.loads(meta_path.read_bytes())
        if meta["key"] != key or meta["dtype"] != dtype.str:
            return None
        train = _map(paths["train"], dtype, int(meta["n_train"]))
        val = _map(paths["val"], dtype, int(meta["n_val"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("re-encoding damaged token cache entry %s: %s", meta_path, err)
        return None
    digest = hashlib.sha256(train)
    digest.update(val)
    if digest.hexdigest() != meta.get("sha256"):
        log.warning("re-encoding token cache entry %s: content does not match its sha256", meta_path)
        return None
    return train, val, meta["sha256"]
