"""Local sources: the Source record, the stdlib and text sources, reading their files, and capping max_bytes.

A source yields documents (files or dataset rows); normlab.data.corpus says how they become the corpus text,
and `capped` cuts that text to its first `DataConfig.max_bytes` bytes.

Sources (`DataConfig.source`; the hf source is normlab.data.hf):
  stdlib  every `.py` file of this interpreter's standard library
          (`sysconfig.get_paths()["stdlib"]`), recursively, in sorted relative
          POSIX-path order, skipping anything under a `site-packages` or
          `dist-packages` directory so the corpus never depends on what was
          pip-installed. Needs no network.
  text    the local files `DataConfig.files`, in the order given; a `.jsonl`
          file gives one document per row (its `text_field`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from normlab.data.errors import DataError
from normlab.data.pieces import FileText


EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
LARGE_BYTES = 1 << 20  # a file this large or larger is read a block at a time as it is used


@dataclass(frozen=True)
class Source:
    """Where a corpus's documents come from: its kind, a description for logs, and a cheap identity."""

    kind: str
    description: str
    spec: dict  # JSON-able identity of the content; hashed into the cache key
    documents: Callable[[], Iterable[bytes | FileText]]  # reads the content, only on a cache miss


def stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """The standard library's `.py` files as sorted POSIX paths relative to `root`.

    `root` defaults to this interpreter's stdlib directory. Nothing under a
    `site-packages` or `dist-packages` directory is listed.
    """
    base = Path(root) if root is not None else _stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Pruning in place stops os.walk from descending into installed packages at all.
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(base)
        found.extend((rel_dir / name).as_posix() for name in filenames if name.endswith(".py"))
    return sorted(found)


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source() -> Source:
    root = _stdlib_root()
    names = stdlib_files(root)
    if not names:
        raise DataError(f"no .py files found under the standard library directory {root}")
    manifest = []
    for name in names:
        try:
            st = (root / name).stat()
        except OSError as err:
            raise DataError(f"cannot read standard library file {root / name}: {err.strerror or err}") from None
        manifest.append([name, st.st_size, st.st_mtime_ns])
    return Source(
        kind="stdlib",
        description=f"stdlib:{root}",
        spec={"source": "stdlib", "root": str(root), "files": manifest},
        documents=lambda: _read_files([root / name for name in names]),
    )


def text_source(files: list, text_field: str) -> Source:
    if not files:
        raise DataError("data.files is empty: data=text needs data.files=[path, ...]")
    paths = [Path(os.path.expanduser(str(f))) for f in files]
    manifest = []
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise DataError(f"data.files: {path} does not exist") from None
        except OSError as err:
            raise DataError(f"data.files: cannot read {path}: {err.strerror}") from None
        if not path.is_file():
            raise DataError(f"data.files: {path} is not a regular file")
        manifest.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    spec = {"source": "text", "files": manifest}
    if any(_is_jsonl(p) for p in paths):
        spec["jsonl_field"] = text_field
    return Source(
        kind="text",
        description="text:" + ",".join(str(f) for f in files),
        spec=spec,
        # Read as bytes rather than through datasets' "text" builder: the tokens are the bytes, so
        # decoding and re-encoding could only alter them (newline translation, invalid UTF-8), and
        # the builder would also store a second, Arrow copy of every file in the Hugging Face cache.
        documents=lambda: _read_files(paths, text_field),
    )


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


def _read_files(paths: list[Path], text_field: str = "text") -> Iterator[bytes | FileText]:
    """Each file's bytes as one document; a .jsonl file gives one document per row (its `text_field`)."""
    for path in paths:
        try:
            if _is_jsonl(path):
                yield from _jsonl_documents(path, text_field)
            else:
                yield _file_bytes(path)
        except OSError as err:
            raise DataError(f"cannot read {path}: {err.strerror or err}") from None


def _file_bytes(path: Path) -> bytes | FileText:
    """A file's bytes: read whole below LARGE_BYTES, else a FileText, read a block at a time as it is used, so that
    a large file is never held in the process's own memory."""
    if path.stat().st_size < LARGE_BYTES:
        return path.read_bytes()
    return FileText.whole(path)


def _jsonl_documents(path: Path, text_field: str) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise DataError(f"{path}:{number} is not a JSON object (a .jsonl file holds one per line)") from None
            text = row.get(text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number} has no text field {text_field!r}: set data.text_field")
            yield text.encode("utf-8")


def capped(source: Source, max_bytes: int | None) -> Source:
    """`source` limited to its first `max_bytes` bytes (separators included); unchanged when max_bytes is None."""
    if max_bytes is None:
        return source
    documents = source.documents

    def head() -> Iterator[bytes]:
        left = max_bytes
        for i, doc in enumerate(documents()):
            room = left - (i > 0)  # every document after the first costs its separator too
            if room <= 0:
                return
            doc = doc[:room]
            yield doc
            left -= len(doc) + (i > 0)

    return dataclasses.replace(source, spec={**source.spec, "max_bytes": max_bytes}, documents=head)
