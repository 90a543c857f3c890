"""Checkpoints of a pack: one per member, in that member's run dir, in the format an unpacked run writes.

A member's checkpoint (normlab.train.checkpoint, format normlab-checkpoint/2) holds its slice of the pack: its
weights and buffers under the model's state_dict keys, its AdamW moments in torch.optim.AdamW's
state_dict layout, its data generator, its counters, and the state of the callbacks an unpacked run
checkpoints (divergence guard, throughput clock, telemetry records). So a member resumes packed or
unpacked alike, and a pack resumes from its members' checkpoints, each restored through the unpacked
run's own restore (which checks every piece) and copied into its slices.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from normlab.train.callbacks import DivergenceGuard, TelemetryProducts, ThroughputClock
from normlab.train.checkpoint import Checkpoint
from normlab.config import RunConfig
from normlab.nn.packed import PackedAdamW, PackedModel
from normlab.train.optim import param_groups
from normlab.train.run import build_state


@dataclass
class Saved:
    """A callback's name and state, as Checkpointer.save takes callbacks."""

    name: str
    state: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return self.state


@dataclass
class MemberState:
    """What Checkpointer.save takes as the train state: the step and the TrainState.state_dict() layout."""

    step: int
    state: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return self.state


class OptimizerLayout:
    """torch.optim.AdamW's state_dict layout for the template model (the groups and parameter indices an unpacked
    run's optimizer has), filled with one member's moments."""

    def __init__(self, template: torch.nn.Module, cfg: RunConfig, device: torch.device):
        reference = torch.optim.AdamW(param_groups(template, cfg.optim.weight_decay), lr=cfg.lr,
                                      betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, fused=device.type == "cuda")
        self.groups = reference.state_dict()["param_groups"]
        names = {id(p): name for name, p in template.named_parameters()}
        order = [p for group in reference.param_groups for p in group["params"]]
        self.names = [names[id(p)] for p in order]  # parameter index in the state_dict -> name in the pack

    def state_dict(self, optimizer: PackedAdamW, m: int, lr: float) -> dict[str, Any]:
        moments = optimizer.member_moments(m)
        state = {}
        if optimizer.step_count:
            state = {i: {"step": torch.tensor(float(optimizer.step_count)), "exp_avg": moments[name][0],
                         "exp_avg_sq": moments[name][1]} for i, name in enumerate(self.names)}
        groups = copy.deepcopy(self.groups)
        for group in groups:
            group["lr"] = lr
        return {"state": state, "param_groups": groups}


def member_checkpoint_state(pack: PackedModel, optimizer: PackedAdamW, layout: OptimizerLayout, m: int, *,
                            step: int, lr: float, generator: torch.Generator, counters: dict[str, Any]) -> MemberState:
    """Member m's train state at `step`, laid out as TrainState.state_dict() is."""
    return MemberState(step, {
        "model": pack.member_state_dict(m),
        "optimizer": layout.state_dict(optimizer, m, lr),
        "scaler": {},  # packs refuse fp16: the GradScaler is off, and a disabled scaler's state is empty
        "data_sampler": generator.get_state(),
        "step": step,
        **counters,
    })


def guard_state(factor: float, limit: torch.Tensor | None, first_bad: torch.Tensor, m: int) -> dict[str, Any]:
    """DivergenceGuard.state_dict() of member m, from the pack's per-member tensors."""
    return {"factor": factor, "limit": None if limit is None else limit[m].detach().clone(),
            "first_bad": first_bad[m].detach().clone()}


@dataclass
class Restored:
    """One member's state read back from its checkpoint through an unpacked run's restore."""

    step: int
    counters: dict[str, Any]
    generator_state: torch.Tensor
    guard: dict[str, Any]
    clock: dict[str, Any]
    records: list[dict[str, Any]]


def restore_member(pack: PackedModel, optimizer: PackedAdamW, m: int, checkpoint: Checkpoint, cfg: RunConfig) -> Restored:
    """Restore `checkpoint` into a fresh unpacked TrainState (every piece checked as a resumed run checks it),
    copy its weights, buffers and moments into member m's slices, and return the rest."""
    cpu = torch.device("cpu")
    state = build_state(cfg, cpu, "fp32")
    guard = DivergenceGuard(cfg.diverge_factor, cpu)
    clock = ThroughputClock(cfg.batch_size * cfg.seq_len)
    products = TelemetryProducts([])
    checkpoint.restore(state, [guard, clock, products])
    pack.load_member_state_dict(m, state.model.state_dict())
    names = {id(p): name for name, p in state.model.named_parameters()}
    moments, step_count = {}, 0
    for p, slot in state.optimizer.state.items():
        moments[names[id(p)]] = (slot["exp_avg"], slot["exp_avg_sq"])
        step_count = int(slot["step"])
    optimizer.load_member_moments(m, moments, step_count)
    counters = {name: getattr(state, name) for name in ("tokens", "best_val", "last_val", "eval_time")}
    return Restored(state.step, counters, state.data_gen.get_state(), guard.state_dict(), clock.state_dict(),
                    products.state_dict()["records"])
