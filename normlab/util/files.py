"""Files that are whole or absent, and locks: the one implementation of each.

A write goes to a temporary file beside its destination, reaches the disk (fsync), and is renamed over the
destination; the rename reaches the disk too (fsync of the directory), so a crash or power cut leaves the
old file or the new one, never half of one. A write that fails (a full disk) removes its temporary file
and raises the OSError.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # not on Windows: locks there are no-ops
    fcntl = None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` to write; when the block ends without error the file is synced and
    renamed to `path` (and the rename synced), else removed. The parent dir is made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """`data` as the whole of `path`, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """`obj` as indented JSON in `path`, atomically (readers never see half a file)."""
    write_bytes_atomic(path, (json.dumps(obj, indent=2, default=str, allow_nan=False) + "\n").encode())


def fsync_dir(folder: str | os.PathLike) -> None:
    """Sync a directory, so a rename in it reaches the disk; a file system that cannot is left as it is."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive(lock_path: str | os.PathLike, wait: bool = True) -> Iterator[None]:
    """Hold an exclusive advisory lock (flock) on `lock_path`, a file or a directory, for the block. With
    wait=False raise BlockingIOError at once if another process holds it. The kernel drops the lock when
    the process dies, however it dies. A no-op where flock is unavailable."""
    if fcntl is None:
        yield
        return
    fd = os.open(lock_path, os.O_RDONLY | os.O_DIRECTORY) if Path(lock_path).is_dir() else os.open(
        lock_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock



def flock_holders() -> dict[tuple[int, int, int], int] | None:
    """{(major, minor, inode): PID} of every file or dir an flock is held on, and the process holding it (in this
    process's PID namespace), from /proc/locks, which takes no lock; None where it cannot be read."""
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    held = {}
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 16334 fe:00:2148306 0 EOF"; a process waiting for the lock has "->" after the number
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK":
            try:
                major, minor, inode = fields[5].split(":")
                held[int(major, 16), int(minor, 16), int(inode)] = int(fields[4])
            except ValueError:
                continue
    return held


def lock_holder(path: str | os.PathLike) -> int | None:
    """The id of the process that holds an flock on `path` (flock_holders), or None where none does or it cannot
    be told (no /proc/locks, a path that is gone)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (flock_holders() or {}).get((os.major(found.st_dev), os.minor(found.st_dev), found.st_ino))
