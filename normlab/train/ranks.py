"""Whether this process is one of several ranks, read from the environment alone: no torch, so that a process
that is one rank of one (a sweep's launching process, `normlab train --help`) never waits for torch's import.
normlab.train.distributed joins the ranks' process group."""

from __future__ import annotations

import os


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def slurm_tasks() -> bool:
    """A submitit job of several SLURM tasks not yet given torchrun's variables (distributed.export_slurm_tasks)."""
    return (os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and "WORLD_SIZE" not in os.environ
            and int(os.environ.get("SLURM_NTASKS", "1")) > 1)


def several_ranks() -> bool:
    """True where distributed.init_from_env would join a process group."""
    return launched_by_torchrun() or slurm_tasks()
