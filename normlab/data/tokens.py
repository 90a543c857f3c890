"""data=tokens: train from token shards made elsewhere (llm.c, modded-nanogpt, nanoGPT) or by normlab.

`data.train` and `data.val` list files or globs (normlab.data.shards.resolve_paths); each file is a shard of
its split, in the order listed, memory-mapped (normlab.data.shards.read_shard). Checked before the first step,
one line each: the header (magic, version, count against the size), a raw array's dtype, a shard of fewer
than seq_len + 1 ids (less than one window), train and val naming one file, and an id at or above the
tokenizer's vocabulary. The last needs every id read once: the check also counts the bytes the ids stand
for and hashes each shard, and keeps what it found in the token cache (`shardcheck-<key>.json`, keyed by the
file's path, size and mtime and the tokenizer), so a later run reads the headers alone.

Bits per byte with no text at hand: the bytes a token stands for come from the tokenizer's vocabulary
(Tokenizer.token_bytes: exact for a byte-level BPE such as GPT-2's, each of whose tokens is a fixed string of
bytes). A special token (GPT-2's <|endoftext|>, which llm.c and modded-nanogpt put before every document)
marks a document boundary and counts as one byte: normlab's own corpora separate documents with a newline,
one byte of text, so a run on llm.c's shards of a corpus and a run on normlab's preparation of it divide by
the same bytes, up to one per split.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from normlab.config import DataConfig
from normlab.data.errors import DataError
from normlab.data.shards import TokenShards, read_shard, resolve_paths
from normlab.data.tokenizer import HFTokenizer, Tokenizer
from normlab.util.files import write_json_atomic

_BLOCK = 1 << 22  # ids read at a time by the check


@dataclass(frozen=True)
class Shards:
    """The checked shards of data=tokens, and what the corpus records of them."""

    train: TokenShards
    val: TokenShards
    n_bytes: int  # the bytes all the ids stand for (bytes_per_token)
    sha256: str  # of the shards' sha256s, train then val, in order
    description: str
    bytes_per_token: np.ndarray


def boundary_bytes(tok: Tokenizer) -> np.ndarray:
    """The bytes each id stands for in shards made elsewhere: the tokenizer's, but one for a special token."""
    lengths = tok.token_bytes.copy()
    if isinstance(tok, HFTokenizer):
        for index, added in tok.backend.get_added_tokens_decoder().items():
            if added.special and index < len(lengths):
                lengths[index] = 1
    return lengths


def token_shards(cfg: DataConfig, tok: Tokenizer, root: Path, seq_len: int | None, progress: bool) -> Shards:
    """data.train's and data.val's shards, checked (see the module's docstring); DataError in one line if not fit."""
    paths = {"data.train": resolve_paths(cfg.train, "data.train"), "data.val": resolve_paths(cfg.val, "data.val")}
    shared = {p.resolve() for p in paths["data.train"]} & {p.resolve() for p in paths["data.val"]}
    if shared:
        raise DataError(f"data.train and data.val both name {sorted(shared)[0]}: validation must hold out "
                        "tokens that training does not see")
    arrays = {key: [read_shard(p, cfg.dtype, key) for p in found] for key, found in paths.items()}
    for key, found in paths.items():
        for path, ids in zip(found, arrays[key]):
            if seq_len is not None and len(ids) <= seq_len:
                raise DataError(f"{key}: {path} holds {len(ids)} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                                "a window needs seq_len + 1 ids")
    lengths = boundary_bytes(tok)
    facts = _checked_all(paths, arrays, tok, lengths, root, progress)
    digest = hashlib.sha256(json.dumps([f["sha256"] for f in facts]).encode()).hexdigest()
    return Shards(
        train=TokenShards(arrays["data.train"]),
        val=TokenShards(arrays["data.val"]),
        n_bytes=sum(f["n_bytes"] for f in facts),
        sha256=digest,
        description="tokens:" + ",".join(map(str, cfg.train)) + "+" + ",".join(map(str, cfg.val)),
        bytes_per_token=lengths,
    )


def _checked_all(paths: dict, arrays: dict, tok: Tokenizer, lengths: np.ndarray, root: Path, progress: bool) -> list:
    """Each shard's facts (n_tokens, max_id, n_bytes, sha256), from the cache or read now; DataError for an id
    at or above the vocabulary."""
    from tqdm import tqdm  # only when shards are checked

    todo = [(key, path, ids) for key in paths for path, ids in zip(paths[key], arrays[key])]
    entries = {path: root / f"shardcheck-{_check_key(path, ids, tok)}.json" for _, path, ids in todo}
    unread = sum(ids.nbytes for _, path, ids in todo if not entries[path].is_file())
    facts = []
    with tqdm(total=unread, unit="B", unit_scale=True, desc="checking token shards", file=sys.stderr,
              disable=not progress or not unread) as bar:
        for key, path, ids in todo:
            found = _read_facts(entries[path])
            if found is None:
                found = _read_ids(ids, lengths, bar)
                if found["max_id"] < tok.vocab_size:
                    write_json_atomic(entries[path], found)
            if found["max_id"] >= tok.vocab_size:
                raise DataError(f"{key}: {path} holds the id {found['max_id']}, at or above the vocabulary of "
                                f"{tok.vocab_size} ids ({getattr(tok, 'description', tok.kind)}): name the tokenizer the "
                                "shards were made with (tokenizer=hf tokenizer.name=...)")
            facts.append(found)
    return facts


def _check_key(path: Path, ids: np.ndarray, tok: Tokenizer) -> str:
    stat = path.stat()
    identity = [str(path.resolve()), stat.st_size, stat.st_mtime_ns, ids.dtype.str, len(ids), tok.identity]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]


def _read_facts(entry: Path) -> dict | None:
    try:
        facts = json.loads(entry.read_bytes())
        return {key: facts[key] for key in ("n_tokens", "max_id", "n_bytes", "sha256")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_ids(ids: np.ndarray, lengths: np.ndarray, bar) -> dict:
    """Every id of a shard read once, a block at a time from the file (not through the mapping, which would
    hold the whole file's pages): its highest id, the bytes the ids stand for, and the sha256 of their bytes."""
    digest, max_id, counts = hashlib.sha256(), -1, np.zeros(len(lengths), dtype=np.int64)
    offset = getattr(ids, "offset", 0)
    with open(ids.filename, "rb") if isinstance(ids, np.memmap) else open(os.devnull, "rb") as fh:
        fh.seek(offset)
        for start in range(0, len(ids), _BLOCK):
            block = np.fromfile(fh, dtype=ids.dtype, count=min(_BLOCK, len(ids) - start))
            digest.update(block.tobytes())
            max_id = max(max_id, int(block.max()))
            if max_id < len(lengths):
                counts += np.bincount(block, minlength=len(lengths))
            bar.update(block.nbytes)
    n_bytes = int(counts @ lengths) if max_id < len(lengths) else None
    return {"n_tokens": len(ids), "max_id": max_id, "n_bytes": n_bytes, "sha256": digest.hexdigest()}
