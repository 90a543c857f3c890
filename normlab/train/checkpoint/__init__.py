"""Checkpoints: what one holds, how it is written and read, and where a resumed run starts.

A checkpoint is taken at a step boundary. `step` k means: k optimizer updates are done and
every metrics record of steps < k has been emitted; the resumed loop continues at step k (it
evaluates at step k if due, trains on batch k, and logs record k). A checkpoint holds

  state           the TrainState (normlab.train.state): model, optimizer, GradScaler, data sampler
                  (the training-batch generator), the step and the loop's counters
  callbacks       callback name -> that callback's state_dict() (divergence guard, throughput
                  clock, telemetry records, ...), so a resumed run's callbacks go on as they were
  rng             python, numpy, torch and CUDA generator states
  config          the run's flattened config, checked against the resuming run's
  corpus_sha256, wandb_run_id, world_size

The learning-rate schedule is a pure function of the step (`lr_at`), so the step is its position.
Files live in <run dir>/checkpoints/step-000120.pt. Each is written to a temporary file, flushed
and renamed, so a crash never leaves half a checkpoint under a checkpoint's name, and each is read
with torch.load(weights_only=True): tensors and plain containers only, never arbitrary objects.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from normlab.config import RunConfig, bookkeeping_keys, flatten_config
from normlab.util.errors import one_line
from normlab.util.files import atomic_path, write_bytes_atomic

FORMAT = "normlab-checkpoint/2"
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step-(\d+)\.pt$")

# Config keys a resumed run may change: the schema's bookkeeping, which changes no number of the result.
MAY_CHANGE_ON_RESUME = bookkeeping_keys()


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (unreadable, or not this run's); the message is one line."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class TrainStateLike(Stateful, Protocol):
    model: nn.Module
    step: int


class NamedStateful(Stateful, Protocol):
    name: str  # the key of its state in the checkpoint


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:06d}.pt"


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in `run_dir`, oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint of `run_dir` with the highest step, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def capture_rng() -> dict[str, Any]:
    """Every generator a training step may draw from: python, numpy, torch (CPU) and CUDA."""
    _, key, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["key"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def write_atomic(path: Path, payload: dict[str, Any]) -> None:
    """torch.save `payload` to `path` atomically (normlab.util.files.atomic_path).

    On failure the temporary file goes and `path` (an earlier checkpoint's file too) is as it was; a
    write the disk refused raises that OSError (ENOSPC: the disk is full), not torch's own account of it.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        writer = _WriteErrors(fh)
        try:
            torch.save(payload, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None  # torch reports a refused write as "unexpected pos ..."
            raise


class _WriteErrors:
    """A binary file wrapper that remembers the first OSError its writes raised."""

    def __init__(self, fh):
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.fh.flush()


class Checkpoint:
    """A checkpoint read from disk: `step`, `wandb_run_id`, and `restore()` into a run's state and callbacks."""

    def __init__(self, path: Path, payload: dict[str, Any]):
        self.path = path
        self.payload = payload

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Checkpoint":
        """Read `path` safely (weights_only); raise CheckpointError naming the file if it is not a normlab checkpoint."""
        path = Path(path)
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such checkpoint") from None
        except Exception as err:
            # torch's refusal of a non-weights pickle is a paragraph of advice; the gist fits in the line below.
            detail = "" if isinstance(err, pickle.UnpicklingError) else f" ({type(err).__name__}: {one_line(err, limit=200)})"
            raise CheckpointError(f"{path}: unreadable checkpoint: corrupt, truncated, or not written by normlab{detail}") from None
        written = payload.get("format") if isinstance(payload, dict) else None
        if isinstance(written, str) and written.startswith("normlab-checkpoint/") and written != FORMAT:
            raise CheckpointError(
                f"{path}: written by another normlab version (format {written!r}, this one reads {FORMAT!r}): "
                "start afresh in a new run dir, or resume with the normlab that wrote it"
            )
        if written != FORMAT:
            raise CheckpointError(f"{path}: not a normlab checkpoint (expected format {FORMAT!r})")
        missing = [k for k in ("step", "state", "callbacks", "rng", "config") if k not in payload]
        if missing:
            raise CheckpointError(f"{path}: incomplete checkpoint, it has no {', '.join(missing)}")
        return cls(path, payload)

    @property
    def step(self) -> int:
        return int(self.payload["step"])

    @property
    def wandb_run_id(self) -> str | None:
        return self.payload.get("wandb_run_id")

    def check_config(self, cfg: RunConfig) -> None:
        """Raise CheckpointError if `cfg` trains differently from the run that wrote this checkpoint."""
        differ = config_difference(self.payload["config"], cfg)
        if differ:
            raise CheckpointError(
                f"{self.path}: written by a run with {differ}: resume with the same config, or start afresh in a new run dir"
            )

    def check_corpus(self, sha256: str) -> None:
        saved = self.payload.get("corpus_sha256")
        if saved is not None and saved != sha256:
            raise CheckpointError(
                f"{self.path}: written by a run on corpus sha256 {saved[:12]}…, this run's corpus is {sha256[:12]}…: "
                "the data changed, so the run cannot continue exactly"
            )

    def restore(self, state: TrainStateLike, callbacks: Sequence[NamedStateful] = ()) -> None:
        """Load the train state, every callback's state and the RNG states.

        A callback the checkpoint holds no state for keeps its fresh state if that is empty (a
        stateless callback added on resume); otherwise the checkpoint does not fit this run.
        """
        saved = self.payload["state"]
        if "model" in saved:
            self._check_module("model", state.model, saved["model"])
        self._load("train", state, saved)
        held = self.payload["callbacks"]
        for callback in callbacks:
            if callback.name in held:
                self._load(f"{callback.name} callback", callback, held[callback.name])
            elif callback.state_dict():
                raise CheckpointError(
                    f"{self.path}: holds no state for the {callback.name} callback "
                    f"(it holds {', '.join(sorted(held)) or 'none'})"
                )
        try:
            restore_rng(self.payload["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{self.path}: its random generator states do not fit this run: {_missing(err)}") from None

    def _load(self, what: str, target: Stateful, state: Any) -> None:
        try:
            target.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{self.path}: the {what} state does not fit this run: {_missing(err)}") from None

    def _check_module(self, name: str, module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        expected = module.state_dict()
        for key in expected:
            if key not in state:
                raise CheckpointError(f"{self.path}: {name} mismatch: this {name} has {key}, the checkpoint does not")
            if tuple(state[key].shape) != tuple(expected[key].shape):
                raise CheckpointError(
                    f"{self.path}: {name} mismatch: {key} has shape {list(state[key].shape)} in the checkpoint, "
                    f"{list(expected[key].shape)} in this run"
                )
        extra = sorted(set(state) - set(expected))
        if extra:
            raise CheckpointError(f"{self.path}: {name} mismatch: the checkpoint has {extra[0]}, this {name} does not")


class Checkpointer:
    """Writes one run's checkpoints into <run dir>/checkpoints, keeps the newest `ckpt.keep`, and
    knows when one is due. Only the writing process (rank 0) passes writes=True."""

    def __init__(self, run_dir: str | os.PathLike, cfg: RunConfig, *, wandb_run_id: str | None,
                 corpus_sha256: str, world_size: int = 1, writes: bool = True):
        self.run_dir = Path(run_dir)
        self.every, self.keep, self.max_steps = cfg.ckpt.every, cfg.ckpt.keep, cfg.max_steps
        self.writes = writes
        self._identity = {
            "config": flatten_config(cfg),
            "corpus_sha256": corpus_sha256,
            "wandb_run_id": wandb_run_id,
            "world_size": world_size,
        }

    def due(self, step: int) -> bool:
        """A periodic checkpoint after `step` updates; the final one is written by the caller at max_steps."""
        return self.every > 0 and step % self.every == 0 and step < self.max_steps

    def save(self, state: TrainStateLike, callbacks: Sequence[NamedStateful] = ()) -> Path | None:
        """Write the checkpoint of `state` (`state.step` updates done) and its callbacks atomically;
        return its path (None when not writing)."""
        if not self.writes:
            return None
        payload = {
            "format": FORMAT,
            "step": state.step,
            "state": state.state_dict(),
            "callbacks": {callback.name: callback.state_dict() for callback in callbacks},
            "rng": capture_rng(),
            **self._identity,
        }
        path = checkpoint_path(self.run_dir, state.step)
        write_atomic(path, payload)
        for _, old in list_checkpoints(self.run_dir)[: -self.keep]:
            old.unlink(missing_ok=True)
        return path


def config_difference(saved: Mapping[str, Any], cfg: RunConfig) -> str | None:
    """None if the flattened config `saved` trains as `cfg` does (bookkeeping keys aside), else the first
    difference in words: "lr=0.003, this run has lr=0.01 (and 2 more differences)"."""
    current = flatten_config(cfg)
    missing = object()
    differ = [
        key for key in sorted(set(saved) | set(current))
        if not _may_change(key) and saved.get(key, missing) != current.get(key, missing)
    ]
    if not differ:
        return None
    key = differ[0]
    more = f" (and {len(differ) - 1} more differences)" if len(differ) > 1 else ""
    return f"{key}={saved.get(key, '<absent>')!r}, this run has {key}={current.get(key, '<absent>')!r}{more}"


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
        path = latest_checkpoint(run_dir)
    else:
        path = find_checkpoint(cfg.resume)
    if path is None:
        check_same_run(cfg, run_dir)
        return None
    checkpoint = Checkpoint.load(path)
    checkpoint.check_config(cfg)
    return checkpoint


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


def _may_change(key: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in MAY_CHANGE_ON_RESUME)


def _missing(err: BaseException) -> str:
    """The error in a few words; a missing key as "it has no 'scaler'" (a checkpoint of an older normlab)."""
    if isinstance(err, KeyError) and err.args:
        return f"it has no {err.args[0]!r} (written by an older normlab?)"
    return one_line(err, limit=200)
