"""The run dir (RunDir): whether one can be made at a path (check_output_dir), its files, its lock (RunDirBusy when another process holds it), whether it is still at
its path (RunDirGone when it was deleted, moved or replaced during the run), the room it keeps
for summary.json when the disk fills (disk_full), and the line files its metrics grow in (AppendOnlyLines)."""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import math
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

from normlab.config import ConfigError
from normlab.util.files import exclusive, lock_holder, write_bytes_atomic, write_json_atomic

RESERVE_NAME = ".summary.reserve"
RESERVE_BYTES = 256 * 1024  # room kept for summary.json, so a run that fills the disk still records how it ended


class RunDirBusy(RuntimeError):
    """Another process is writing this run dir; the message is one line. `holder`: that process's id, where the
    kernel tells it."""

    def __init__(self, message: str, holder: int | None = None):
        super().__init__(message)
        self.holder = holder


class RunDirGone(RuntimeError):
    """The run dir was deleted, moved or replaced while the run wrote it; the message is one line. `what` and `step`:
    what became of it ("deleted or moved away", "replaced by another") and the step at which the run noticed."""

    def __init__(self, message: str, what: str = "", step: int | None = None):
        super().__init__(message)
        self.what, self.step = what, step


def _identity(path: Path) -> tuple[int, int] | None:
    """The (device, inode) of `path`, or None where nothing is."""
    try:
        found = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return found.st_dev, found.st_ino


def jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: a NaN as null, an infinity as "inf" or "-inf"."""
    # JSON has no NaN/inf; diverged runs must still write valid lines.
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def disk_full(err: BaseException) -> bool:
    """Whether `err` says the disk (or the user's quota) is full."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def check_output_dir(path: str, key: str) -> None:
    """ConfigError if directory `path` (set by override `key`) cannot be made or written; nothing is created."""
    if not path.strip():
        raise ConfigError(f"{key}={path!r}: the run dir must be a path: choose one with {key}=DIR")
    target = Path(path).absolute()
    try:
        existing = next(p for p in (target, *target.parents) if p.exists())
        if not existing.is_dir():
            raise ConfigError(f"{key}={path}: {existing} is a file, not a directory: choose another run dir with {key}=DIR")
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        too_long = [part for part in target.relative_to(existing).parts if len(part.encode()) > name_max]
        if too_long:
            raise ConfigError(f"{key}={path}: the name {too_long[0][:40]}... is longer than {name_max} bytes: choose a shorter one")
        probe = tempfile.mkdtemp(prefix=".normlab-probe-", dir=existing)  # writable? (os.access ignores read-only mounts for root)
        shutil.rmtree(probe, ignore_errors=True)
    except ConfigError:
        raise
    except ValueError as err:  # a NUL byte in the path
        raise ConfigError(f"{key}={path!r}: not a valid path ({err})") from None
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise ConfigError(f"{key}={path}: cannot create the run dir there: {reason}: choose another with {key}=DIR") from None


# The run dirs this process holds locked: path -> [holders, what releases the lock]. flock locks belong to an open
# file, so a second hold of the same dir in this process (the Hydra layer's, then train()'s, then a run's end in
# the end thread: normlab.train.ending) shares the first; the last release, whichever it is, unlocks.
_HELD: dict[Path, list] = {}
_HELD_LOCK = threading.Lock()


class RunDir:
    """The files of one run: config.json (the resolved config), summary.json, and what sinks add
    (metrics.jsonl: one object per logged step)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._identity = _identity(self.path)  # the dir itself, whatever later lies at its path

    def gone(self) -> str | None:
        """None while `path` is the dir it was when this RunDir was made; else what became of it, in words."""
        now = _identity(self.path)
        if now == self._identity:
            return None
        return "deleted or moved away" if now is None else "replaced by another"

    def check_in_place(self, step: int) -> None:
        """Raise RunDirGone if the run dir is no longer at its path (`step`: the run's step, for the message).
        One stat; nothing is created, so a deleted dir is not made again."""
        what = self.gone()
        if what is not None:
            raise RunDirGone(
                f"the run dir {self.path} was {what} during the run (noticed at step {step}): the run stopped there; "
                "what it had written (metrics.jsonl, config.json, normlab.log, checkpoints) went with that dir, "
                "and nothing more is written at this path", what, step
            )

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    def write_config(self, config: dict[str, Any]) -> None:
        """The run's resolved config as nested JSON (RunConfig.to_dict()), written atomically."""
        write_json_atomic(self.config_path, config)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json, written atomically; the room reserve() kept is given back first, so the summary
        of a run that filled the disk still fits."""
        (self.path / RESERVE_NAME).unlink(missing_ok=True)
        write_json_atomic(self.summary_path, {k: jsonable(v) for k, v in summary.items()})

    def reserve(self) -> None:
        """Keep RESERVE_BYTES of disk for summary.json (a hidden file that write_summary removes)."""
        path = self.path / RESERVE_NAME
        try:
            with open(path, "wb") as fh:
                fh.write(bytes(RESERVE_BYTES))
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the run dir's lock (an flock on the directory itself, so no file is added) for the duration;
        raise RunDirBusy at once if another process holds it. The kernel drops the lock when its process
        dies, however it dies."""
        release = self.hold()
        try:
            yield
        finally:
            release()

    def hold(self) -> Callable[[], None]:
        """Hold the run dir's lock (as lock() does) until the function returned is called, from any thread; holds
        in this process share the lock, and the last one released unlocks it."""
        key = self.path.resolve()
        with _HELD_LOCK:
            if key not in _HELD:
                held = contextlib.ExitStack()
                try:
                    held.enter_context(exclusive(key, wait=False))
                except BlockingIOError:
                    holder = lock_holder(key)
                    who = f"another normlab run (PID {holder})" if holder else "another normlab run"
                    raise RunDirBusy(
                        f"{self.path} is in use: {who} is writing it; wait for that run to end, or choose another run dir",
                        holder,
                    ) from None
                _HELD[key] = [0, held]
            _HELD[key][0] += 1
        released = False

        def release() -> None:
            nonlocal released
            with _HELD_LOCK:
                if released:
                    return
                released = True
                entry = _HELD[key]
                entry[0] -= 1
                if entry[0] == 0:
                    del _HELD[key]
                    entry[1].close()

        return release

    def write_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> Path:
        """Write a table as `<name>.csv` in the run dir ('telemetry/layers' -> telemetry/layers.csv); None is an empty cell."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
        return self._write_atomic(f"{name}.csv", buffer.getvalue().encode())

    def write_image(self, name: str, png: bytes) -> Path:
        """Write PNG bytes as `<name>.png` in the run dir."""
        return self._write_atomic(f"{name}.png", png)

    def _write_atomic(self, relative: str, data: bytes) -> Path:
        path = self.path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, data)
        return path


class AppendOnlyLines:
    """A file that grows by whole lines only: each line goes to the file in one write() and, if that write
    fails or falls short (a full disk), the file is cut back to its last complete line before the error is raised."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size

    def write_line(self, line: str) -> None:
        data = line.encode()
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        except BaseException:
            os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
