"""Where a run starts: a fresh start or which checkpoint it resumes (resolve_resume), the checks that keep
a run dir to one run's records, and rewinding a run dir to a checkpoint's step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from normlab.config import RunConfig, flatten_config
from normlab.train.checkpoint.file import CHECKPOINT_DIR, Checkpoint, CheckpointError, latest_checkpoint, list_checkpoints
from normlab.train.checkpoint.identity import config_difference
from normlab.util.files import write_bytes_atomic


def holds_records(run_dir: str | os.PathLike) -> bool:
    """Whether `run_dir` holds a run's records (a non-empty metrics.jsonl)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def check_same_run(cfg: RunConfig, run_dir: str | os.PathLike) -> None:
    """Raise CheckpointError if `run_dir` holds the records of a run whose config.json trains differently
    from `cfg` (or that has no readable config.json): starting there would replace them."""
    run_dir = Path(run_dir)
    if not holds_records(run_dir):
        return
    start_over = "use another run dir, or overwrite=true to start over (its records are deleted)"
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{run_dir} holds the records of a run without a readable config.json: {start_over}") from None
    differ = config_difference(flatten_config(saved) if isinstance(saved, dict) else {}, cfg)
    if differ:
        raise CheckpointError(f"{run_dir} holds the records of another run, with {differ}: {start_over}")


# The statuses of a run that has nothing left to train.
ENDED = ("completed", "diverged")


def ended_run(cfg: RunConfig, run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The summary of the run `run_dir` holds if that run ended (completed or diverged) with `cfg`'s config
    and `cfg` asks for resume=auto: nothing is left to train, so a re-run returns this instead."""
    run_dir = Path(run_dir)
    if cfg.resume != "auto" or cfg.overwrite:
        return None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("status") not in ENDED or not isinstance(saved, dict):
        return None
    return summary if config_difference(flatten_config(saved), cfg) is None else None


def ended_message(cfg: RunConfig, run_dir: str | os.PathLike, ended: dict[str, Any]) -> str:
    """The line for a run that already ended in `run_dir` (its summary `ended`, ended_run's): not trained again."""
    return (f"normlab: {cfg.run_name} already {ended['status']} in {run_dir}: not trained again "
            "(overwrite=true trains it afresh)")


def resolve_resume(cfg: RunConfig, run_dir: str | os.PathLike) -> Checkpoint | None:
    """The checkpoint this run continues from, per `cfg.resume`, checked against `cfg`; None for a fresh start.

    overwrite=true: a fresh start whatever `run_dir` holds (train() then deletes its records).
    null: a fresh start, refused if `run_dir` already holds metrics (that run would be overwritten).
    auto: the newest checkpoint in `run_dir`; or a fresh start if it has none, refused if `run_dir`
    holds the records of a run with another config.
    PATH: that checkpoint file, or the newest checkpoint of that run dir.
    Raises CheckpointError (one line) before any file of the run is touched.
    """
    run_dir = Path(run_dir)
    if cfg.overwrite:
        return None
    if cfg.resume is None:
        if holds_records(run_dir):
            raise CheckpointError(
                f"{run_dir} already holds a run (metrics.jsonl): resume=null would write a second run over it; "
                "use resume=auto to continue it, overwrite=true to start over, or a new run dir"
            )
        return None
    if cfg.resume == "auto":
        checkpoint = load_newest(run_dir)
    elif Path(cfg.resume).is_dir():
        find_checkpoint(cfg.resume)  # one line if it holds none
        checkpoint = load_newest(cfg.resume)
    else:
        checkpoint = Checkpoint.load(find_checkpoint(cfg.resume))
    if checkpoint is None:
        check_same_run(cfg, run_dir)
        return None
    checkpoint.check_config(cfg)
    return checkpoint


class UnreadableCheckpoint(CheckpointError):
    """The newest checkpoint of a run dir does not load; `readable` is the newest older one that does (None if
    none does), `error` what the newest one's load said. The message is one line."""

    def __init__(self, error: CheckpointError, readable: Checkpoint | None, command: str | None = None):
        """`command`: the command that continues from `readable`, for the message (else resume=<its path>)."""
        self.error, self.readable = error, readable
        if readable is None:
            advice = "no older checkpoint of the run loads either: overwrite=true starts it over"
        else:
            how = f"to continue from it: {command}" if command else f"resume={readable.path} continues from it"
            advice = (f"the newest readable checkpoint is {readable.path} (step {readable.step}); {how} "
                      "(the later checkpoints are removed)")
        super().__init__(f"{error}; {advice}")


def load_newest(run_dir: str | os.PathLike) -> Checkpoint | None:
    """The newest checkpoint of `run_dir`, loaded; None if it has none. UnreadableCheckpoint (naming the newest
    one that loads) if the newest does not load; nothing on disk changes."""
    found = list_checkpoints(run_dir)
    if not found:
        return None
    try:
        return Checkpoint.load(found[-1][1])
    except CheckpointError as err:
        for _, older in reversed(found[:-1]):
            try:
                readable = Checkpoint.load(older)
            except CheckpointError:
                continue
            raise UnreadableCheckpoint(err, readable) from None
        raise UnreadableCheckpoint(err, None) from None


def find_checkpoint(spec: str | os.PathLike) -> Path:
    """`spec` itself if it is a file, else the newest checkpoint of the run dir `spec`; CheckpointError if neither."""
    path = Path(spec)
    if path.is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"resume={spec}: no such file or directory")
    newest = latest_checkpoint(path)
    if newest is None:
        raise CheckpointError(f"resume={spec}: no checkpoint in {path / CHECKPOINT_DIR}")
    return newest


def run_dir_of(checkpoint: str | os.PathLike) -> Path | None:
    """The run dir a checkpoint file belongs to (<run dir>/checkpoints/step-N.pt), or None if it lies elsewhere."""
    path = Path(checkpoint)
    return path.parent.parent if path.parent.name == CHECKPOINT_DIR else None


def rewind(run_dir: str | os.PathLike, step: int) -> list[dict[str, Any]]:
    """Make `run_dir` look as it did when step `step`'s checkpoint was taken: metrics rows with
    step >= `step` go (the resumed run measures them again), and so do checkpoints of later steps.
    Returns the rows that remain."""
    run_dir = Path(run_dir)
    kept = rewind_metrics(run_dir / "metrics.jsonl", step)
    for later, path in list_checkpoints(run_dir):
        if later > step:
            path.unlink(missing_ok=True)
    for stale in (run_dir / CHECKPOINT_DIR).glob(".step-*.tmp"):
        stale.unlink(missing_ok=True)  # left by a process killed while writing
    return kept


def rewind_metrics(path: Path, first_step: int) -> list[dict[str, Any]]:
    """Drop the rows of metrics.jsonl whose step is >= `first_step`, and a last line torn by a kill;
    return the rows kept.

    The file is replaced atomically (temporary file, flush, rename): a crash leaves either the old
    rows or the kept ones, never fewer.
    """
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    kept, rows = [], []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue  # the process was killed in the middle of writing this line
            raise CheckpointError(f"{path}: line {number} is not JSON; repair or remove it before resuming") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] < first_step:
            kept.append(line if line.endswith("\n") else line + "\n")
            rows.append(row)
    if kept == lines:
        return rows
    write_bytes_atomic(path, "".join(kept).encode())
    return rows
