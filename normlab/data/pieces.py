"""Pieces: a split's text cut into the pieces its tokenizer encodes one by one, read a block at a time.

A text is one or more parts read as one (a document and the separator before it, or a split of the byte
cache): byte buffers, or ranges of files (FileText), read a block at a time so that their pages never count
in the process's memory. A text tokenizer reads it as UTF-8 and encodes it in the pieces of
`newline_chunks`: each at least CHUNK_CHARS characters and ending just after a newline (the last may be
shorter). Cut here while the bytes are decoded a block at a time, they are the pieces the whole text would
give, so the ids are too; memory holds a block and a piece, never the text. A line longer than
MAX_PIECE_CHARS characters is cut there (the whole text would give one piece of it).

Bytes that are not UTF-8 stop the reading (NotUtf8), or, with `replace`, are read as Python's
`errors="replace"` reads them: each maximal run of bytes that begins no character becomes one U+FFFD. A
piece then says where its replacement characters are and how many bytes each stands for, so bits per byte
can count the corpus's own bytes, not the three of U+FFFD (normlab.data.prepare).

Each piece comes with the byte offset in the text just past it, so a preparation that stopped can start again
at the piece after the last one it wrote.
"""

from __future__ import annotations

import codecs
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

CHUNK_CHARS = 1 << 16  # texts are encoded in newline-aligned pieces of about this size
BLOCK_BYTES = 1 << 16  # bytes decoded at a time: a block may decode to four times its size
MAX_PIECE_CHARS = 1 << 24
REPLACEMENT = "\ufffd"
REPLACEMENT_BYTES = len(REPLACEMENT.encode("utf-8"))


class NotUtf8(ValueError):
    """The text is not UTF-8: `offset` is the byte offset in the text of the first byte that is not, `byte` its
    value, `where` the text (a document, the training text)."""

    def __init__(self, offset: int, byte: int, where: str = "the text"):
        super().__init__(offset, byte)
        self.offset, self.byte, self.where = offset, byte, where

    def __str__(self) -> str:
        return f"the byte 0x{self.byte:02x} at byte offset {self.offset} of {self.where} is not UTF-8"


def newline_chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at least `size` characters, each ending just after a newline (the last may not)."""
    start = 0
    while start < len(text):
        cut = text.find("\n", start + size)
        end = len(text) if cut < 0 else cut + 1
        yield text[start:end]
        start = end


@dataclass(frozen=True)
class FileText:
    """Bytes [start, start + length) of a file, read when used a block at a time, never mapped: a large text then
    passes through the page cache without counting in the process's memory, as a mapped file's pages would."""

    path: str
    start: int
    length: int

    @classmethod
    def whole(cls, path: str | os.PathLike) -> "FileText":
        return cls(str(path), 0, os.path.getsize(path))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, cut: slice) -> "FileText":
        begin, end, _ = cut.indices(self.length)
        return FileText(self.path, self.start + begin, max(end - begin, 0))


def text_bytes(parts: Sequence) -> int:
    """The length in bytes of the text made of `parts`."""
    return sum(_length(part) for part in parts)


def _length(part) -> int:
    return len(part) if isinstance(part, FileText) else memoryview(part).nbytes


def blocks(parts: Sequence, start: int = 0, size: int = BLOCK_BYTES) -> Iterator[tuple[int, memoryview | bytes]]:
    """(offset, bytes) of the text made of `parts` (buffers, FileTexts), from byte `start` on, in blocks of at
    most `size` bytes."""
    base = 0
    for part in parts:
        length = _length(part)
        if start < base + length:
            if isinstance(part, FileText):
                with open(part.path, "rb") as fh:
                    for at in range(max(start - base, 0), length, size):
                        yield base + at, os.pread(fh.fileno(), min(size, length - at), part.start + at)
            else:
                view = memoryview(part).cast("B")
                for at in range(max(start - base, 0), length, size):
                    yield base + at, view[at : at + size]
        base += length


def byte_pieces(parts: Sequence, start: int = 0, size: int = CHUNK_CHARS) -> Iterator[tuple[bytes, int, tuple]]:
    """The text's bytes from `start` on, `size` at a time (what the byte tokenizer encodes), with the offset past each."""
    for offset, block in blocks(parts, start, size):
        yield bytes(block), offset + len(block), ()


def text_pieces(parts: Sequence, start: int = 0, replace: bool = False, size: int = CHUNK_CHARS,
                block: int = BLOCK_BYTES) -> Iterator[tuple[str, int, tuple]]:
    """The newline chunks of the text from byte `start` on (a piece boundary), each with the byte offset past it
    and its replacements: (character index in the piece, bytes it stands for) of each U+FFFD that stands for
    bytes that are not UTF-8. Raises NotUtf8 at the first such byte unless `replace`."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    pending, replaced, search, end = "", [], size, start
    for offset, chunk, final in _then_final(blocks(parts, start, block), text_bytes(parts)):
        text, found = decode_block(decoder, chunk, offset, final, replace)
        replaced += [(len(pending) + i, k) for i, k in found]
        pending += text
        while pending:
            cut = pending.find("\n", search)
            if cut < 0 and len(pending) < MAX_PIECE_CHARS and not final:
                search = max(size, len(pending))
                break
            length = cut + 1 if cut >= 0 else min(len(pending), MAX_PIECE_CHARS)
            piece, pending, search = pending[:length], pending[length:], size
            mine = tuple(r for r in replaced if r[0] < length)
            replaced = [(i - length, k) for i, k in replaced[len(mine):]]
            end += len(piece.encode("utf-8")) + sum(k - REPLACEMENT_BYTES for _, k in mine)
            yield piece, end, mine


def _then_final(decoded: Iterator[tuple[int, memoryview]], total: int) -> Iterator[tuple[int, bytes, bool]]:
    """The blocks, then the end of the text: (offset, bytes, whether it is the end)."""
    for offset, chunk in decoded:
        yield offset, chunk, False
    yield total, b"", True


def check_utf8(parts: Sequence) -> None:
    """Raise NotUtf8 unless the text made of `parts` is UTF-8, read a block at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    for offset, chunk in blocks(parts):
        decode_block(decoder, chunk, offset)
    decode_block(decoder, b"", text_bytes(parts), final=True)


def decode_block(decoder, data, offset: int, final: bool = False, replace: bool = False) -> tuple[str, list]:
    """`data` (which starts at byte `offset` of the text) through the incremental strict `decoder`, and the
    replacements made (character index, bytes replaced). NotUtf8 on a bad byte unless `replace`, which reads it
    as Python's errors="replace" does."""
    held = decoder.getstate()[0]  # bytes of a character begun in the block before
    pieces, replaced, length = [], [], 0
    while True:
        try:
            text = decoder.decode(data, final)
            return "".join(pieces) + text, replaced
        except UnicodeDecodeError as err:
            raw = bytes(err.object)
            if not replace:
                raise NotUtf8(offset - len(held) + err.start, raw[err.start]) from None
            good = raw[: err.start].decode("utf-8")
            pieces += [good, REPLACEMENT]
            length += len(good)
            replaced.append((length, err.end - err.start))
            length += 1
            decoder.reset()
            data, held, offset = raw[err.end :], b"", offset - len(held) + err.end
