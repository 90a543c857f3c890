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

The modules: file (the file, Checkpoint, Checkpointer), rng (the generators' states), identity (which
config keys a resume may change), resume (where a run starts, rewinding a run dir to a checkpoint).
"""

from normlab.train.checkpoint.file import (
    CHECKPOINT_DIR,
    FORMAT,
    Checkpoint,
    CheckpointError,
    Checkpointer,
    NamedStateful,
    Stateful,
    TrainStateLike,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    write_atomic,
)
from normlab.train.checkpoint.identity import (
    ABSENT, MAY_CHANGE_ON_RESUME, config_difference, config_differences, may_change,
)
from normlab.train.checkpoint.resume import (
    ENDED,
    check_same_run,
    ended_message,
    ended_run,
    find_checkpoint,
    UnreadableCheckpoint,
    holds_records,
    load_newest,
    resolve_resume,
    rewind,
    rewind_metrics,
    run_dir_of,
)
from normlab.train.checkpoint.rng import capture_rng, restore_rng

__all__ = [
    "ABSENT", "CHECKPOINT_DIR", "ENDED", "FORMAT", "MAY_CHANGE_ON_RESUME",
    "Checkpoint", "CheckpointError", "Checkpointer", "UnreadableCheckpoint", "NamedStateful", "Stateful", "TrainStateLike",
    "capture_rng", "check_same_run", "checkpoint_path", "config_difference", "config_differences", "ended_message", "ended_run",
    "find_checkpoint",
    "holds_records", "latest_checkpoint", "list_checkpoints", "load_newest", "may_change", "resolve_resume", "restore_rng", "rewind",
    "rewind_metrics", "run_dir_of", "write_atomic",
]
