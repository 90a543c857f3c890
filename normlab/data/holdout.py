"""Held-out documents: which split each document of a stream goes to, known as it comes (`data.holdout`).

  tail   (the default) the last floor(n · val_fraction) bytes of the corpus text (normlab.data.corpus): the
         total must be known first, so the text goes into the byte cache before it is encoded.
  hash   a document is held out when a stable hash of its bytes (its BLAKE2b digest's first 8 bytes, as a
         number below 2^64) falls below val_fraction · 2^64: a fixed share of the documents, the same in any
         order, and every copy of a document on one side.
  first  the first data.val_docs documents are held out.

hash and first send the documents straight from the source to the tokenizer (normlab.data.prepare), with no
byte cache. Each document's text is the document with the separator before it (the first document's
without), so the splits' texts together are the corpus text, as under tail. A dataset's own validation split
(data.val_split) is held out whole instead.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

from normlab.config import DataConfig
from normlab.data.pieces import blocks
from normlab.data.prepare import Unit
from normlab.data.sources import Source

SEPARATOR = b"\n"  # between documents, as in the byte cache (normlab.data.cache)
_HASH_RANGE = 1 << 64


def held_out(document, index: int, cfg: DataConfig) -> bool:
    """Whether the `index`-th document of the stream (its bytes `document`) is validation under `cfg.holdout`."""
    if cfg.holdout == "first":
        return index < cfg.val_docs
    digest = hashlib.blake2b(digest_size=8)
    for _, block in blocks((document,)):
        digest.update(block)
    return int.from_bytes(digest.digest(), "little") < cfg.val_fraction * _HASH_RANGE


def document_units(source: Source, val_source: Source | None, cfg: DataConfig, start: int = 0) -> Iterator[Unit]:
    """The documents of `source` (then of `val_source`, the dataset's own validation split) from the `start`-th on,
    each as a Unit of the split it goes to. The documents before `start` are read and passed over."""
    index = 0
    for split, origin in (("train", source), ("val", val_source)):
        if origin is None:
            continue
        for document in origin.documents():
            if index >= start:
                if val_source is None:
                    split = "val" if held_out(document, index, cfg) else "train"
                parts = (document,) if index == 0 else (SEPARATOR, document)
                yield Unit(split, parts, f"document {index}")
            index += 1


def head_sample(units: Iterator[Unit], budget: int) -> bytes:
    """The first `budget` bytes of the training split's text (fewer if it is shorter), cut back to a whole
    UTF-8 character: what a BPE learns from when the text is not read whole first."""
    taken: list[bytes] = []
    left = budget
    for unit in units:
        if unit.split != "train":
            continue
        for _, block in blocks(unit.parts):
            piece = bytes(block[:left])
            taken.append(piece)
            left -= len(piece)
            if left <= 0:
                break
        if left <= 0:
            break
    sample = b"".join(taken)
    return _whole_characters(sample) if left <= 0 else sample


def _whole_characters(data: bytes) -> bytes:
    """`data` without the UTF-8 character its end cuts in two, if it does."""
    lead = len(data) - 1
    while lead >= 0 and data[lead] & 0xC0 == 0x80:
        lead -= 1
    if lead < 0:
        return data
    first = data[lead]
    length = 1 if first < 0x80 else 2 if first >> 5 == 0b110 else 3 if first >> 4 == 0b1110 else 4
    return data if lead + length <= len(data) else data[:lead]
