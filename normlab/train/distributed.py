"""Training on several processes: `torchrun --nproc_per_node=N -m normlab train ...`.

torchrun starts one process per device and sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; `init_from_env` joins them into one process group (NCCL for CUDA tensors, gloo for
CPU tensors, so `device=cpu` works on a GPU machine too).
Without a process group every helper here acts as for a single process: rank 0 of a world of 1.

- The batch: every rank draws the whole global batch from the shared seeded generator and keeps
  its share (`rank_share`), so the data equal a single-process run's for any number of ranks.
  `batch_size` is the global batch; `grad_accum` micro-batches per rank.
- Gradients: DDP averages them over ranks on the last micro-batch only (`grad_sync`).
- BatchNorm: with `norm.sync=true` (the default) `wrap` gives normlab's BatchNorm layers the
  process group, and they compute their statistics over the global micro-batch (see
  `norms.BatchNorm`); with `norm.sync=false` each rank normalizes with its own share's statistics.
- Values a user reads as global (loss, val loss) are averaged over ranks (`mean`, `total`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from normlab.config import ConfigError, RunConfig
from normlab.nn.norms import needs_ddp_sync
from normlab.train.ranks import launched_by_torchrun, slurm_tasks


def is_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_active() else 0


def world_size() -> int:
    return dist.get_world_size() if is_active() else 1


def is_main() -> bool:
    """True on the process that logs and writes files (rank 0, or the only process)."""
    return rank() == 0


def export_slurm_tasks() -> None:
    """In a submitit job of several tasks (hydra.launcher.tasks_per_node > 1 or nodes > 1), which SLURM
    starts with SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID, set what torchrun would: RANK, WORLD_SIZE,
    LOCAL_RANK, and MASTER_ADDR/MASTER_PORT (the job's first node, a port drawn from the job id).
    Every task keeps seeing all the node's GPUs and drives the one of its LOCAL_RANK, as under torchrun."""
    if slurm_tasks():
        from submitit.helpers import TorchDistributedEnvironment  # present in a submitit job, optional elsewhere

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def init_from_env() -> bool:
    """Join the process group torchrun (or a SLURM job of several tasks, see `export_slurm_tasks`)
    describes in the environment; False (and nothing done) without one.

    It touches no CUDA device: the run's device is not known yet (Hydra composes the config later).
    `local_device` picks this rank's GPU once the run's device is CUDA, so `device=cpu` runs gloo
    alone even on a host with fewer GPUs than ranks. Object collectives and barriers of a
    "cpu:gloo,cuda:nccl" group go through gloo; NCCL starts at the first CUDA collective.
    """
    export_slurm_tasks()
    if not launched_by_torchrun() or is_active():
        return is_active()
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return True


def shutdown() -> None:
    # No barrier: a rank that failed must exit (so torchrun stops the others), not wait for them.
    if is_active():
        dist.destroy_process_group()


def local_device(device: torch.device) -> torch.device:
    """Under torchrun each process drives the GPU of its LOCAL_RANK: for a CUDA run it becomes the
    current device here. Any other device is returned as it is, and CUDA is left alone."""
    if device.type == "cuda" and is_active():
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        return local
    return device


def check_batch_split(cfg: RunConfig) -> None:
    """The global batch must split into world_size × grad_accum equal micro-batches."""
    parts = world_size() * cfg.grad_accum
    if cfg.batch_size % parts:
        raise ConfigError(
            f"batch_size={cfg.batch_size} does not split into {world_size()} processes × grad_accum={cfg.grad_accum} "
            f"equal micro-batches: choose a batch_size divisible by {parts}"
        )


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not is_active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_share(x: torch.Tensor, y: torch.Tensor, grad_accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a global batch: its slice of each of the `grad_accum` micro-batches.

    Micro-batch j of the run is the same rows as micro-batch j of a single-process run, spread over
    the ranks, so global BatchNorm statistics of micro-batch j equal the single-process ones.
    """
    if not is_active():
        return x, y
    r, n = rank(), world_size()

    def share(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([micro.chunk(n)[r] for micro in t.chunk(grad_accum)])

    return share(x), share(y)


def wrap(model: nn.Module, device: torch.device, sync_batchnorm: bool) -> nn.Module:
    """The module to train with: `model` itself for one process, else DDP around it, its BatchNorms
    made global when `sync_batchnorm`. Parameters and buffers stay `model`'s (checkpoint `model`)."""
    if not is_active():
        return model
    if sync_batchnorm:
        for module in model.modules():
            if needs_ddp_sync(module):
                module.process_group = dist.group.WORLD
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def grad_sync(model: nn.Module, last: bool):
    """Context for one micro-batch's forward and backward: DDP skips the gradient all-reduce unless `last`."""
    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def total(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over ranks (a new tensor)."""
    if not is_active():
        return t
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of `t` over ranks (gloo has no AVG, so a sum divided by the world size)."""
    return total(t) / world_size() if is_active() else t


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any one: all ranks take the same branch."""
    if not is_active():
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics), so all ranks evaluate and save one model."""
    if not is_active():
        return
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def barrier() -> None:
    if is_active():
        dist.barrier()

