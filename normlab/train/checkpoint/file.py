"""A checkpoint file: its format and name, the atomic write, reading and restoring one (Checkpoint), and
writing one run's checkpoints as it trains (Checkpointer)."""

from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import nn

from normlab.config import RunConfig, flatten_config
from normlab.train.checkpoint.identity import config_difference
from normlab.train.checkpoint.rng import capture_rng, restore_rng
from normlab.util.errors import one_line
from normlab.util.files import atomic_path

FORMAT = "normlab-checkpoint/2"
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step-(\d+)\.pt$")


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
            with warnings.catch_warnings():
                # A pickle of another protocol than torch's own (a crafted file) makes torch warn in two lines
                # before it refuses or reads it: the refusal below, or the checks after, say what matters.
                warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
                payload = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such checkpoint") from None
        except Exception as err:
            # torch's refusal of a non-weights pickle is a paragraph of advice; the gist fits in the line below.
            # torch's account of a cut file is its first sentence; the rest is advice (a "miniz error"...).
            detail = "" if isinstance(err, pickle.UnpicklingError) else f" ({type(err).__name__}: {_first_sentence(err)})"
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

    @property
    def segments(self) -> list[dict[str, Any]]:
        """The run's segments up to this checkpoint (normlab.train.phases.RunClock): from_step, to_step, wall_time_s;
        [] for a checkpoint that holds none (or none readable), as an older normlab's."""
        segments = self.payload.get("segments")
        keys = {"from_step": int, "to_step": int, "wall_time_s": (int, float)}
        if not isinstance(segments, list) or not all(
                isinstance(s, dict) and all(isinstance(s.get(k), t) for k, t in keys.items()) for s in segments):
            return []
        return [{k: s[k] for k in keys} for s in segments]

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
                 corpus_sha256: str, world_size: int = 1, writes: bool = True, clock=None):
        """`clock`: the run's normlab.train.phases.RunClock, whose segments each checkpoint keeps (None: none kept)."""
        self.run_dir, self.clock = Path(run_dir), clock
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
        return self.write(*self.payload(state, callbacks)) if self.writes else None

    def payload(self, state: TrainStateLike, callbacks: Sequence[NamedStateful] = ()) -> tuple[Path, dict[str, Any]]:
        """The checkpoint of `state` and its callbacks as `write` takes it, with its path: what they and the RNGs
        hold now (its tensors are the state's own, not copies)."""
        payload = {
            "format": FORMAT,
            "step": state.step,
            "state": state.state_dict(),
            "callbacks": {callback.name: callback.state_dict() for callback in callbacks},
            "rng": capture_rng(),
            **self._identity,
        }
        if self.clock is not None:  # the run's time so far, which a run resuming from this checkpoint adds to its own
            payload["segments"] = self.clock.segments(state.step)
        return checkpoint_path(self.run_dir, state.step), payload

    def write(self, path: Path, payload: dict[str, Any]) -> Path:
        """Write a checkpoint made by `payload` atomically, then keep only the newest `ckpt.keep`."""
        write_atomic(path, payload)
        for _, old in list_checkpoints(self.run_dir)[: -self.keep]:
            old.unlink(missing_ok=True)
        return path


def _first_sentence(err: BaseException) -> str:
    """An error's first sentence, on one line (one_line): what went wrong, without the advice after it."""
    text = one_line(err, limit=10_000)
    return one_line(text.split(". ", 1)[0], limit=200)


def _missing(err: BaseException) -> str:
    """The error in a few words; a missing key as "it has no 'scaler'" (a checkpoint of an older normlab)."""
    if isinstance(err, KeyError) and err.args:
        return f"it has no {err.args[0]!r} (written by an older normlab?)"
    return one_line(err, limit=200)
