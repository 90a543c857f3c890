"""Preparing tokens: a corpus's text encoded in parallel into token shards, in bounded memory, resumably.

The text comes as units, each one split's text made of byte buffers (normlab.data.pieces): the two splits of
the byte cache, or one document after another. Each unit is cut into pieces (pieces.text_pieces), the pieces
are gathered into batches of about `batch_bytes` bytes of text, and each batch is encoded by one of `workers`
processes: a process pool over `tokenizers`, each worker encoding on one thread (scripts/bench/data_prep.py
measures it against tokenizers' own threads and datasets.map; docs/data.md says why this one). The batches'
ids come back in order and are appended to their split's shards, SHARD_TOKENS ids a shard, in llm.c's format
(normlab.data.shards). At most 2 × workers batches are out at a time, so memory holds about
(2 × workers + 1) × batch_bytes of text and its ids, however large the corpus.

Resuming: an entry is built in `<entry>.partial/`. Whenever a shard is complete, the shards are synced and
progress.json records how far the text was read and how many ids each split holds; a preparation that was
killed starts again from there (its shards cut back to those counts) and ends with the same shards as one
that ran through. When all is written, meta.json goes in and the folder is renamed to `<entry>/` in one
step: a reader finds a whole entry or none.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from normlab.data.errors import DataError
from normlab.data.pieces import REPLACEMENT_BYTES, NotUtf8, byte_pieces, text_pieces
from normlab.data.shards import HEADER_BYTES, header
from normlab.data.tokenizer import HFTokenizer, Tokenizer
from normlab.util.files import fsync_dir, write_json_atomic

SHARD_TOKENS = 100_000_000  # ids a shard holds (llm.c's FineWeb shards hold as many); the last holds the rest
SPLITS = ("train", "val")
BATCH_BYTES = 1 << 20  # text a worker encodes at once: its memory is some tens of times this


@dataclass(frozen=True)
class Unit:
    """One text of a split: the concatenation of `parts` (bytes-like buffers); `name` says which in an error."""

    split: str
    parts: tuple
    name: str = "the text"


@dataclass
class Batch:
    """Pieces of text to encode together, and where the text was read up to after them."""

    pieces: list = field(default_factory=list)
    splits: list = field(default_factory=list)
    replaced: list = field(default_factory=list)  # each piece's replacements (normlab.data.pieces.text_pieces)
    n_bytes: int = 0
    end: tuple = (0, 0)  # (unit index, byte offset in that unit) just past the last piece


@dataclass
class Progress:
    """How far a preparation got: the read position, each split's ids written, the text's bytes read."""

    unit: int = 0
    offset: int = 0
    written: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    n_bytes: int = 0
    replaced: int = 0  # U+FFFD read for bytes that are not UTF-8 (replace=True)
    corrections: list = field(default_factory=list)  # [val position, bytes to add] of each val token holding one


def prepare(folder: Path, units_from: Callable[[int], Iterator[Unit]], tok: Tokenizer, meta: dict, *,
            workers: int = 1, batch_bytes: int = BATCH_BYTES, progress: bool = False,
            total_bytes: int | None = None, replace: bool = False) -> dict:
    """Encode the units `units_from(0)` yields into the entry `folder` (resuming its `.partial` twin where a
    preparation stopped) and return the entry's meta.json: `meta` plus the shards, counts and sha256.

    `units_from(i)` yields the units from the i-th on, the same on every call. Bytes that are not UTF-8 raise
    pieces.NotUtf8 (the partial entry removed: it could never finish), or with `replace` are read as U+FFFD,
    each validation token holding one recorded in meta["val_corrections"] as [position, bytes to add] (bits per
    byte then counts the text's own bytes). Raises DataError when a worker dies, and OSError when the disk
    refuses a write (the partial entry kept, to be resumed).
    """
    partial = folder.with_name(folder.name + ".partial")
    dtype = np.dtype(meta["dtype"])
    state = _resume_point(partial, meta)
    try:
        writers = {split: ShardWriter(partial, split, dtype, state.written[split]) for split in SPLITS}
    except OSError:  # shards that do not match their progress.json: start again
        state = _start_over(partial)
        writers = {split: ShardWriter(partial, split, dtype, 0) for split in SPLITS}
    try:
        _encode_all(units_from, tok, writers, state, partial, meta, workers, batch_bytes, replace,
                    _bar(progress, total_bytes, state.n_bytes, meta.get("description", "")))
    except BaseException as err:
        for writer in writers.values():
            writer.close()
        if isinstance(err, NotUtf8):
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return _publish(partial, folder, writers, state, meta, tok)


def _resume_point(partial: Path, meta: dict) -> Progress:
    """Where the preparation in `partial` stopped, or the start (`partial` made empty) if there is none to resume."""
    try:
        saved = json.loads((partial / "progress.json").read_text())
        if saved.get("key") != meta["key"]:
            raise ValueError("another entry's progress")
        return Progress(saved["unit"], saved["offset"], {s: int(saved["written"][s]) for s in SPLITS},
                        int(saved["n_bytes"]), int(saved["replaced"]), list(saved["corrections"]))
    except (OSError, ValueError, KeyError, TypeError):
        return _start_over(partial)


def _start_over(partial: Path) -> Progress:
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return Progress()


def _bar(progress: bool, total: int | None, done: int, what: str):
    # tqdm is imported with the first preparation only
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=f"tokenizing {what}"[:60],
                file=sys.stderr, disable=not progress, dynamic_ncols=True)


def _encode_all(units_from, tok, writers, state: Progress, partial: Path, meta: dict, workers: int,
                batch_bytes: int, replace: bool, bar) -> None:
    """Every batch from the resume point on, encoded and written in order; progress.json after each finished shard."""
    out: deque = deque()
    with bar, _encoder(tok, workers, np.dtype(meta["dtype"])) as submit:
        def write_oldest() -> None:
            batch, result = out.popleft()
            finished = False
            for split, (ids, corrections) in _result(result).items():
                state.corrections += [[writers[split].written + int(i), int(d)] for i, d in corrections]
                finished |= writers[split].append(ids)
            state.replaced += sum(map(len, batch.replaced))
            state.unit, state.offset = batch.end
            state.n_bytes += batch.n_bytes
            bar.update(batch.n_bytes)
            if finished:
                _checkpoint(partial, writers, state, meta)

        text = isinstance(tok, HFTokenizer)
        for batch in _batches(units_from, state.unit, state.offset, batch_bytes, text, replace):
            out.append((batch, submit(batch)))
            if len(out) > 2 * workers:
                write_oldest()
        while out:
            write_oldest()


def _result(result) -> dict:
    try:
        return result.result() if hasattr(result, "result") else result
    except BrokenProcessPool:
        raise DataError("a tokenizing worker died (out of memory?): lower data.workers or data.batch_bytes; "
                        "the next run resumes from the last complete shard") from None


def _batches(units_from, unit: int, offset: int, batch_bytes: int, text: bool, replace: bool) -> Iterator[Batch]:
    """The pieces of the units from (unit, offset) on, in batches of at least `batch_bytes` bytes (the last fewer)."""
    batch = Batch(end=(unit, offset))
    for index, item in enumerate(units_from(unit), start=unit):
        start = offset if index == unit else 0
        try:
            for piece, end, replaced in text_pieces(item.parts, start, replace) if text else byte_pieces(item.parts, start):
                batch.pieces.append(piece)
                batch.splits.append(item.split)
                batch.replaced.append(replaced)
                batch.n_bytes += end - (batch.end[1] if batch.end[0] == index else 0)
                batch.end = (index, end)
                if batch.n_bytes >= batch_bytes:
                    yield batch
                    batch = Batch(end=(index, end))
        except NotUtf8 as err:
            err.where = item.name
            raise
    if batch.pieces:
        yield batch


@contextlib.contextmanager
def _encoder(tok: Tokenizer, workers: int, dtype: np.dtype):
    """A function batch -> its ids by split (or a future of them): the byte tokenizer's in this process, a text
    tokenizer's in a pool of `workers` forked processes, each on one thread."""
    if not isinstance(tok, HFTokenizer):
        yield lambda batch: _split_ids([np.frombuffer(p, dtype=np.uint8) for p in batch.pieces], batch.splits, [])
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # The workers encode on one thread each (TOKENIZERS_PARALLELISM=false, which they inherit); set while they
    # start, it also keeps tokenizers from warning in each forked worker that the parent used its threads.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                                 initializer=_start_worker, initargs=(tok.backend,)) as pool:
            yield lambda batch: pool.submit(_encode_batch, batch.pieces, batch.splits, batch.replaced, dtype)
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


_backend = None  # a worker's tokenizer


def _start_worker(backend) -> None:
    global _backend
    _backend = backend
    # The preparing process answers signals (normlab.train.preempt) and ends its workers; Ctrl-C reaches the
    # whole process group, so a worker ignores it rather than print a traceback of its own.
    for name in ("SIGINT", "SIGUSR1", "SIGUSR2"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A forked worker holds both ends of the pool's queues, so a preparing process that is killed outright
    # (SIGKILL, the OOM killer) would leave it waiting for work forever: it ends when its parent is gone.
    threading.Thread(target=_orphaned, args=(os.getppid(),), name="normlab-worker-parent", daemon=True).start()


def _orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _encode_batch(pieces: list, splits: list, replaced: list, dtype: np.dtype) -> dict:
    """Each split's ids of the batch's pieces, and the byte corrections of its validation pieces' replacements."""
    encodings = _backend.encode_batch_fast(pieces, add_special_tokens=False)
    ids = [np.asarray(e.ids, dtype=dtype) for e in encodings]
    corrections = []  # (index of the piece, index of the token in it, bytes to add)
    for index, (piece, split, found) in enumerate(zip(pieces, splits, replaced)):
        if found and split == "val":
            offsets = _backend.encode(piece, add_special_tokens=False).offsets
            corrections += [(index, token, delta) for token, delta in replacement_bytes(offsets, found)]
    return _split_ids(ids, splits, corrections)


def replacement_bytes(offsets: list, replaced: tuple) -> list:
    """(token index, bytes to add) for each replacement character of a piece: a U+FFFD standing for k bytes that are
    not UTF-8 counts k, not its own three; the correction goes to the last token starting at or before it (a
    byte-level BPE may give it three byte tokens, all starting there)."""
    starts = [start for start, _ in offsets]
    out = []
    for char, k in replaced:
        token = max(0, int(np.searchsorted(starts, char, side="right")) - 1)
        out.append((token, k - REPLACEMENT_BYTES))
    return out


def _split_ids(ids: list, splits: list, corrections: list) -> dict:
    """The pieces' ids joined by split, in order, each with its corrections as (index in the joined ids, bytes)."""
    joined = {}
    for split in SPLITS:
        mine = [i for i, s in enumerate(splits) if s == split]
        first = dict(zip(mine, np.cumsum([0] + [len(ids[i]) for i in mine])))
        fixes = [(first[piece] + token, delta) for piece, token, delta in corrections if piece in first]
        joined[split] = (np.concatenate([ids[i] for i in mine] or [np.zeros(0, np.uint32)]), fixes)
    return joined


def _checkpoint(partial: Path, writers: dict, state: Progress, meta: dict) -> None:
    for writer in writers.values():
        writer.sync()
    write_json_atomic(partial / "progress.json", {"key": meta["key"], "unit": state.unit, "offset": state.offset,
                                                  "written": {s: w.written for s, w in writers.items()},
                                                  "n_bytes": state.n_bytes, "replaced": state.replaced,
                                                  "corrections": state.corrections})


def _publish(partial: Path, folder: Path, writers: dict, state: Progress, meta: dict, tok: Tokenizer) -> dict:
    """Finish the shards, write meta.json (and the tokenizer) and rename the entry into place."""
    shards = {split: writer.finish() for split, writer in writers.items()}
    empty = [split for split in SPLITS if not writers[split].written]
    if empty:
        shutil.rmtree(partial, ignore_errors=True)
        raise DataError(f"{meta.get('description', 'the corpus')}: the {' and '.join(empty)} split holds no text "
                        "(too few documents for the held-out share): use more data or another data.holdout")
    digest = hashlib.sha256()
    for split in SPLITS:
        for path in shards[split]:
            with open(path, "rb") as fh:
                fh.seek(HEADER_BYTES)
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
    meta = {**meta, "sha256": digest.hexdigest(), "n_bytes": state.n_bytes, "shard_tokens": SHARD_TOKENS,
            "replaced": state.replaced, "val_corrections": state.corrections,
            "n_train": writers["train"].written, "n_val": writers["val"].written,
            "shards": {split: [p.name for p in paths] for split, paths in shards.items()}}
    if isinstance(tok, HFTokenizer):
        tok.save(partial / "tokenizer.json")
    (partial / "progress.json").unlink(missing_ok=True)
    write_json_atomic(partial / "meta.json", meta)
    fsync_dir(partial)
    if folder.exists():  # a damaged entry of the same key: the lock is held, nobody reads it
        shutil.rmtree(folder)
    os.replace(partial, folder)
    fsync_dir(folder.parent)
    return meta


class ShardWriter:
    """Appends a split's ids to its shards in `folder`: `<split>-000000.bin`, ..., each of SHARD_TOKENS ids but
    the last. `written` ids are already there (a resumed preparation): the shards are cut back to exactly those."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, written: int):
        self.folder, self.split, self.dtype, self.written = folder, split, np.dtype(dtype).newbyteorder("<"), written
        self._fh = None
        whole, part = divmod(written, SHARD_TOKENS)
        for path in folder.glob(f"{split}-*.bin"):
            index = int(path.stem.rsplit("-", 1)[1])
            if index > whole or index == whole and not part:
                path.unlink()
        for index in range(whole):
            if self._path(index).stat().st_size != HEADER_BYTES + SHARD_TOKENS * self.dtype.itemsize:
                raise OSError(f"{self._path(index)} is not a whole shard")
        if part:
            self._fh = open(self._path(whole), "r+b")
            self._fh.truncate(HEADER_BYTES + part * self.dtype.itemsize)
            self._fh.seek(0, os.SEEK_END)

    def _path(self, index: int) -> Path:
        return self.folder / f"{self.split}-{index:06d}.bin"

    def append(self, ids: np.ndarray) -> bool:
        """Append `ids`; True if a shard was completed."""
        finished = False
        while len(ids):
            if self._fh is None:
                self._fh = open(self._path(self.written // SHARD_TOKENS), "wb")
                self._fh.write(header(self.dtype, 0))  # the count goes in when the shard is whole
            room = SHARD_TOKENS - self.written % SHARD_TOKENS
            self._fh.write(ids[:room].astype(self.dtype, copy=False).tobytes())
            self.written += min(room, len(ids))
            ids = ids[room:]
            if self.written % SHARD_TOKENS == 0:
                self._close_shard(SHARD_TOKENS)
                finished = True
        return finished

    def _close_shard(self, count: int) -> None:
        self._fh.seek(0)
        self._fh.write(header(self.dtype, count))
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None

    def sync(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def finish(self) -> list[Path]:
        """Close the last shard (its header's count written) and list the shards in order."""
        if self._fh is not None:
            self._close_shard(self.written % SHARD_TOKENS)
        return [self._path(i) for i in range(-(-self.written // SHARD_TOKENS))]

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
