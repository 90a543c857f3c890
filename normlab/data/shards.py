"""Token shards: 1-D arrays of token ids in files, memory-mapped, and the training windows drawn across them.

A split's tokens are one stream stored in one or more shards, in order; a window may run from one shard into
the next, so the windows a split offers (every start in [0, n - seq_len)) do not depend on where the shards
are cut. A split held in one array draws exactly the windows it drew before it was sharded.

File formats (`read_shard`):
  llm.c / modded-nanogpt  a header of 256 little-endian int32 (magic, version, token count, then zeros),
                          then the tokens: magic 20240520 version 1 holds uint16 ids (GPT-2's),
                          magic 20240801 version 7 uint32 ids (Llama 3's). normlab writes its own shards so.
  raw arrays              the ids alone, as nanoGPT's train.bin (uint16): the dtype is given (data.dtype) or
                          read from a sidecar `<file>.json` holding {"dtype": "uint16"}.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from normlab.data.errors import DataError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# (magic, version) -> the dtype of the ids that follow, as llm.c's dev/data/data_common.py writes them.
FORMATS = {(20240520, 1): np.dtype("<u2"), (20240801, 7): np.dtype("<u4")}
RAW_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
MAX_HEADER_COUNT = 2**31 - 1  # the header's count is an int32


def shard_dtype(vocab_size: int) -> np.dtype:
    """The dtype of a shard holding ids below `vocab_size`: uint16 when they fit, else uint32."""
    return RAW_DTYPES["uint16"] if vocab_size <= 1 << 16 else RAW_DTYPES["uint32"]


def header(dtype: np.dtype, count: int) -> bytes:
    """llm.c's 1024-byte header for `count` ids of `dtype` (uint16 or uint32)."""
    (magic, version), = [key for key, value in FORMATS.items() if value == np.dtype(dtype).newbyteorder("<")]
    values = np.zeros(HEADER_INTS, dtype="<i4")
    values[:3] = magic, version, count
    return values.tobytes()


def read_shard(path: Path, dtype: str | None = None, key: str = "data.train") -> np.ndarray:
    """The ids in `path`, memory-mapped read-only (never read whole). DataError, naming `key` and the file, when
    the header's magic, version or count does not fit the file, or a raw array's dtype is unknown or does not
    divide its size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            start = fh.read(HEADER_BYTES)
        head = np.frombuffer(start[: len(start) // 4 * 4], dtype="<i4")
    except OSError as err:
        raise DataError(f"{key}: cannot read {path}: {err.strerror or err}") from None
    magic = int(head[0]) if len(head) else None
    if magic in {m for m, _ in FORMATS}:
        return _headed(path, head, size, dtype, key)
    dtype_name = dtype or _sidecar_dtype(path, key)
    if dtype_name is None:
        raise DataError(
            f"{key}: {path} has no llm.c header (its first int32 is {magic}, not the magic 20240520 or 20240801) "
            f"and no dtype: a raw token array needs data.dtype=uint16 (nanoGPT's train.bin) or uint32, or a sidecar "
            f"{path.name}.json holding {{\"dtype\": \"uint16\"}}"
        )
    raw = RAW_DTYPES[dtype_name]
    if size % raw.itemsize:
        raise DataError(f"{key}: {path} holds {size} bytes, not a whole number of {dtype_name} ids")
    return _map(path, raw, 0, size // raw.itemsize)


def _headed(path: Path, head: np.ndarray, size: int, dtype: str | None, key: str) -> np.ndarray:
    if len(head) < HEADER_INTS:
        raise DataError(f"{key}: {path} holds {size} bytes, less than llm.c's {HEADER_BYTES}-byte header")
    magic, version, count = (int(v) for v in head[:3])
    stored = FORMATS.get((magic, version))
    if stored is None:
        known = ", ".join(f"magic {m} version {v}" for m, v in FORMATS)
        raise DataError(f"{key}: {path} has magic {magic} and version {version}: normlab reads {known}")
    if dtype is not None and RAW_DTYPES[dtype] != stored:
        raise DataError(f"{key}: {path}'s header says {stored.name} ids, data.dtype={dtype}: leave data.dtype=null "
                        "for files with an llm.c header")
    if count < 0 or size - HEADER_BYTES != count * stored.itemsize:
        raise DataError(f"{key}: {path}'s header says {count} tokens ({count * stored.itemsize} bytes), the file holds "
                        f"{size - HEADER_BYTES} bytes after the header: it is truncated or not an llm.c shard")
    return _map(path, stored, HEADER_BYTES, count)


def _sidecar_dtype(path: Path, key: str) -> str | None:
    sidecar = path.with_name(path.name + ".json")
    if not sidecar.is_file():
        return None
    try:
        name = json.loads(sidecar.read_text()).get("dtype")
    except (OSError, ValueError, AttributeError) as err:
        raise DataError(f"{key}: cannot read {sidecar}: {err}") from None
    if name not in RAW_DTYPES:
        raise DataError(f"{key}: {sidecar} says dtype {name!r}: choose one of {', '.join(RAW_DTYPES)}")
    return name


def _map(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def resolve_paths(patterns: Sequence[str], key: str) -> list[Path]:
    """The files `patterns` name, in the order given; a glob's matches in sorted order. DataError for a pattern
    that matches nothing, a path that is not a regular file, or a file named twice."""
    if not patterns:
        raise DataError(f"{key} is empty: data=tokens needs {key}=[file or glob, ...]")
    found: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(str(pattern))
        matches = sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
        if not matches or not glob.has_magic(expanded) and not os.path.exists(expanded):
            raise DataError(f"{key}: {pattern!r} matches no file")
        found.extend(Path(m) for m in matches)
    seen: dict[Path, Path] = {}
    for path in found:
        if not path.is_file():
            raise DataError(f"{key}: {path} is not a regular file")
        real = path.resolve()
        if real in seen:
            raise DataError(f"{key} names {path} twice: each shard's tokens would be trained on twice")
        seen[real] = path
    return found


class TokenShards:
    """A split's token stream, held in shards (1-D arrays, memory-mapped or not) in order."""

    def __init__(self, shards: Sequence[np.ndarray]):
        self.shards = tuple(np.asarray(s) if not isinstance(s, np.ndarray) else s for s in shards)
        sizes = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.ends = np.cumsum(sizes)  # the stream index just past each shard
        self._len = int(self.ends[-1]) if len(sizes) else 0

    def __len__(self) -> int:
        return self._len

    @classmethod
    def of(cls, tokens: "TokenShards | torch.Tensor | np.ndarray") -> "TokenShards":
        """`tokens` as shards: a tensor or array is one shard (no copy)."""
        if isinstance(tokens, TokenShards):
            return tokens
        return cls([tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens])

    @property
    def dtype(self) -> np.dtype:
        return self.shards[0].dtype if self.shards else np.dtype(np.uint16)

    def numpy(self) -> np.ndarray:
        """All the ids as one array: the shard itself when there is one, else a copy (small splits, tests)."""
        if len(self.shards) == 1:
            return self.shards[0]
        return np.concatenate(self.shards) if self.shards else np.zeros(0, dtype=self.dtype)

    def span(self, start: int, length: int, out: np.ndarray) -> None:
        """Copy the ids [start, start + length) of the stream into `out`, across shard boundaries."""
        shard = int(np.searchsorted(self.ends, start, side="right"))
        done = 0
        while done < length:
            begin = start + done - (int(self.ends[shard - 1]) if shard else 0)
            piece = self.shards[shard][begin : begin + length - done]
            out[done : done + len(piece)] = piece
            done += len(piece)
            shard += 1

    @staticmethod
    def draw(n_tokens: int, batch_size: int, seq_len: int, generator: torch.Generator) -> np.ndarray:
        """The starts of `batch_size` random windows of a stream of `n_tokens` ids."""
        if n_tokens <= seq_len:
            raise DataError(
                f"a split of {n_tokens} tokens is too short for seq_len={seq_len}: "
                "use more data, a larger data.val_fraction, or a smaller seq_len"
            )
        return torch.randint(0, n_tokens - seq_len, (batch_size,), generator=generator).numpy()

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` random windows (see normlab.data.batches.sample_batch)."""
        starts = self.draw(len(self), batch_size, seq_len, generator).tolist()
        x = np.empty((batch_size, seq_len), dtype=np.int64)
        y = np.empty((batch_size, seq_len), dtype=np.int64)
        window = np.empty(seq_len + 1, dtype=np.int64)
        one = self.shards[0] if len(self.shards) == 1 else None
        for row, start in enumerate(starts):
            if one is not None:
                x[row] = one[start : start + seq_len]
                y[row] = one[start + 1 : start + seq_len + 1]
                continue
            self.span(start, seq_len + 1, window)
            x[row] = window[:-1]
            y[row] = window[1:]
        return torch.from_numpy(x), torch.from_numpy(y)
