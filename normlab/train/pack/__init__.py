"""Packed arms: the runs of a sweep that differ only in lr and seed, trained together as one packed model.

`train_pack([(cfg, run_dir), ...])` trains every member in one process (normlab.nn.packed: stacked
weights, batched kernels, per-member AdamW and clipping) and writes each member's run dir as
`train.train` writes an unpacked run's: config.json, metrics.jsonl (the same rows), summary.json, the
wandb run, the telemetry and the per-layer products. A reader cannot tell a member from a run.

What a member shares with the pack and what it keeps (so that each member is its unpacked run):
- shared: the architecture and every setting but lr and seed, the held-out batches, the step clock;
- its own: the initialization (its seed, drawn exactly as an unpacked run draws it), the training
  batches (drawn from a generator seeded by its seed, as an unpacked run's: members with one seed
  see one stream, members with different seeds their own; one order for all members would make a
  member differ from its unpacked run), its lr schedule, its clipping, its AdamW moments, its
  BatchNorm statistics, its divergence: a member that diverges is recorded as diverged at its step
  and frozen (lr 0, gradient 0), and the others go on.

Packing is refused (ConfigError, one line) where it cannot be exact: members that differ in a key
other than lr and seed, fp16 (one GradScaler would skip every member's step when one overflows),
compile=true, and torchrun (a pack is one process).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, field

from types import SimpleNamespace
from typing import Any, Sequence

import torch

from normlab.train import distributed, preempt
from normlab.train.callbacks import BatchNormSteps, RunReport, TelemetryProducts, ThroughputClock, progress
from normlab.config.packing import PACKABLE_KEYS, shared_settings
from normlab.train.checkpoint import Checkpoint, Checkpointer, resolve_resume, rewind
from normlab.config import ConfigError, RunConfig
from normlab.data import Corpus, load_corpus
from normlab.nn.flops import model_flops_per_token, peak_flops
from normlab.nn.model import GPT
from normlab.train.pack.checkpoint import OptimizerLayout, Saved, guard_state, member_checkpoint_state, restore_member
from normlab.train.pack.telemetry import PackedProbe
from normlab.nn.packed import PackedAdamW, PackedModel, clip_members
from normlab.train.preempt import Preempted
from normlab.train.sinks import RunDir, Sink, SinkContext, open_sinks
from normlab.train.loop import HeldOut, batch_loader, held_out_batches, loss_fn
from normlab.train.optim import lr_at, param_groups
from normlab.train.run import record_end, summary_head, with_model_vocab
from normlab.train.runtime import (
    autocast, configure_determinism, configure_host_allocator, configure_matmul, resolve_device, resolve_precision,
    seed_everything,
)

log = logging.getLogger("normlab")

# The top-level keys a pack's members may differ in.
def check_pack(cfgs: Sequence[RunConfig]) -> None:
    """Raise ConfigError (one line) unless `cfgs` can train as one exact pack."""
    if not cfgs:
        raise ConfigError("pack=true: a pack needs at least one run")
    first = shared_settings(cfgs[0])
    for cfg in cfgs[1:]:
        other = shared_settings(cfg)
        differ = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
        if differ:
            key = differ[0]
            raise ConfigError(
                f"pack=true: runs {cfgs[0].run_name} and {cfg.run_name} differ in {key} ({first.get(key)!r} and "
                f"{other.get(key)!r}): the runs of a pack may differ only in {', '.join(PACKABLE_KEYS)}"
            )
    cfg = cfgs[0]
    if cfg.compile:
        raise ConfigError("pack=true with compile=true: a pack trains eager; set compile=false, or pack=false to compile each run")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or distributed.is_active():
        raise ConfigError("pack=true under torchrun: a pack trains in one process; run it without torchrun, or pack=false for DDP")
    try:
        device = resolve_device(cfg.device)
    except RuntimeError:  # device=cuda without one: training says so; fp16 cannot be the precision then
        device = torch.device("cpu")
    if resolve_precision(cfg.precision, device) == "fp16":
        raise ConfigError(
            "pack=true with precision=fp16: one GradScaler would skip every member's step when one member "
            "overflows; use precision=bf16 or fp32, or pack=false"
        )


@dataclass
class Member:
    """One run of the pack: its config, run dir and sinks, its counters (a TrainState's), and how it ended."""

    cfg: RunConfig
    run_dir: RunDir
    sinks: list[Sink] = field(default_factory=list)
    tokens: int = 0
    best_val: float = math.inf
    last_val: float = math.nan
    diverged_step: int | None = None
    products: TelemetryProducts | None = None
    report: RunReport | None = None
    resumed: Checkpoint | None = None
    checkpointer: Checkpointer | None = None

    @property
    def active(self) -> bool:
        return self.diverged_step is None

    def emit(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)
        if self.products is not None:
            self.products.on_step_end(None, record)


def train_pack(members: Sequence[tuple[RunConfig, str | os.PathLike]]) -> list[dict[str, Any]]:
    """Train `members` (config, run dir) as one pack; write each run dir as train.train does; return their
    summaries in order. Every run dir is locked for the pack. On an exception every member's summary.json
    records the failure, and the exception propagates."""
    cfgs = [cfg for cfg, _ in members]
    check_pack(cfgs)
    run_dirs = [RunDir(path) for _, path in members]
    with contextlib.ExitStack() as held:
        for run_dir in run_dirs:
            held.enter_context(run_dir.lock())
        held.enter_context(preempt.starting())
        return _train_pack_in([Member(cfg, run_dir) for cfg, run_dir in zip(cfgs, run_dirs)])


def _train_pack_in(members: list[Member]) -> list[dict[str, Any]]:
    """train_pack() inside the run dirs' locks: refuse, or start (or resume) every member, train, record the ends."""
    started = time.time()
    _resume_points(members)
    summaries = [summary_head(m.cfg) for m in members]
    exit_code = 1
    try:
        corpus = load_corpus(members[0].cfg.data, members[0].cfg.tokenizer)
        for member, summary in zip(members, summaries):
            summary.update(corpus=corpus.source, corpus_bytes=corpus.n_bytes, corpus_sha256=corpus.sha256,
                           tokenizer=corpus.tokenizer.identity)
            if member.resumed is not None:
                member.resumed.check_corpus(corpus.sha256)
        with preempt.deferred():  # from here the run dirs change: no signal leaves one halfway
            for member in members:
                _open_run(member, corpus)
        results = _fit_pack(members, corpus)
        for summary, result in zip(summaries, results):
            summary.update(result)
        exit_code = 0
    except Preempted as stop:
        start = members[0].resumed.step if members[0].resumed else 0
        for summary in summaries:
            summary.update(status=stop.status, preempted_step=start if stop.step is None else stop.step)
        exit_code = 128 + stop.signum
        raise
    except BaseException as err:
        for summary in summaries:
            summary["status"] = "failed"
            summary["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        preempt.training_started()
        troubles = []
        for member, summary in zip(members, summaries):
            summary["wall_time_s"] = round(time.time() - started, 3)
            troubles.append(record_end(member.run_dir, summary, member.sinks, exit_code))
    trouble = next((t for t in troubles if t is not None), None)
    if trouble is not None:
        raise trouble
    return summaries


def _resume_points(members: list[Member]) -> None:
    """Each member's checkpoint to resume from (resolve_resume, which refuses in one line before anything
    changes); a pack resumes only when every member has one, all of one step."""
    for member in members:
        member.resumed = resolve_resume(member.cfg, member.run_dir.path)
    steps = {None if m.resumed is None else m.resumed.step for m in members}
    if len(steps) > 1:
        found = ", ".join(f"{m.cfg.run_name}: {'none' if m.resumed is None else m.resumed.step}" for m in members)
        raise ConfigError(
            f"pack=true: the members' checkpoints are at different steps ({found}): a pack resumes from one step; "
            "resume these runs with pack=false, or start them afresh (overwrite=true)"
        )


def _open_run(member: Member, corpus: Corpus) -> None:
    """Start (or, resuming, rewind) a member's run dir as train() does: reserve room, config.json, sinks."""
    run_dir, cfg, resumed = member.run_dir, member.cfg, member.resumed
    run_dir.reserve()
    run_dir.write_config(cfg.to_dict())
    if corpus.tokenizer.kind != "byte":
        corpus.tokenizer.save(run_dir.path / "tokenizer.json")
    start_step = resumed.step if resumed else None
    history = rewind(run_dir.path, start_step or 0)
    wandb_run_id = (resumed.wandb_run_id if resumed else None) or secrets.token_hex(4)
    member.checkpointer = Checkpointer(run_dir.path, cfg, wandb_run_id=wandb_run_id, corpus_sha256=corpus.sha256)
    open_sinks(SinkContext(cfg, run_dir, cfg.run_name, wandb_run_id, start_step, history), into=member.sinks)
    member.products = TelemetryProducts(member.sinks)
    member.report = RunReport(cfg.run_name, "", str(run_dir.path))


def build_pack(cfgs: Sequence[RunConfig], device: torch.device) -> tuple[PackedModel, PackedAdamW]:
    """The packed model, each member initialized as an unpacked run of its config is (seed_everything(seed),
    then GPT(cfg)), and AdamW over it with the weight-decay groups of train.optim.param_groups."""
    models = []
    for cfg in cfgs:
        seed_everything(cfg.seed)
        models.append(GPT(cfg).to(device))
    pack = PackedModel(models)
    base = cfgs[0]
    names = {id(p): name for name, p in pack.template.named_parameters()}
    decay = {names[id(p)] for p in param_groups(pack.template, base.optim.weight_decay)[0]["params"]}
    optimizer = PackedAdamW(pack.params, decay, base.optim.betas, base.optim.eps, base.optim.weight_decay)
    return pack, optimizer


def _fit_pack(members: list[Member], corpus: Corpus) -> list[dict[str, Any]]:
    """Build the pack, run its steps, and return each member's results."""
    cfgs = [with_model_vocab(m.cfg, corpus) for m in members]
    base = cfgs[0]
    device = resolve_device(base.device)
    precision = resolve_precision(base.precision, device)
    configure_matmul(device, base.tf32)
    configure_determinism(base.deterministic)
    configure_host_allocator()
    pack, optimizer = build_pack(cfgs, device)
    generators = {seed: torch.Generator().manual_seed(seed) for seed in dict.fromkeys(c.seed for c in cfgs)}
    loaders = {seed: batch_loader(corpus.train, base, gen, device) for seed, gen in generators.items()}
    held_out = held_out_batches(corpus, base)
    batchnorm = BatchNormSteps(pack.template, base)
    batchnorm.on_train_start(None)
    clock = ThroughputClock(base.batch_size * base.seq_len, 0, model_flops_per_token(base),
                            peak_flops(device, precision, base.tf32), device)
    clock.on_train_start(None)
    log.info("pack of %d runs (%s, lr %s, seeds %s): %s, %s, %s parameters each", len(members), base.label,
             ", ".join(f"{c.lr:g}" for c in cfgs), ", ".join(str(s) for s in generators), device, precision,
             f"{sum(p[0].numel() for p in pack.params.values()):,}")
    probe = PackedProbe(pack, base.telemetry.every, base.max_steps)
    loop = PackLoop(cfgs, members, pack, optimizer, probe, held_out, precision, clock)
    loop.checkpoints(OptimizerLayout(pack.template, base, device), generators)
    if members[0].resumed is not None:
        loop.restore()
    loop.run(lambda: _next_batches(cfgs, loaders))
    return [loop.result(i, batchnorm, corpus) for i in range(len(members))]


def _next_batches(cfgs: Sequence[RunConfig], loaders) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's training batches, (M, B, T): one draw per seed, shared by the members with that seed."""
    drawn = {seed: loader() for seed, loader in loaders.items()}
    return (torch.stack([drawn[c.seed][0] for c in cfgs]), torch.stack([drawn[c.seed][1] for c in cfgs]))


class PackLoop:
    """The packed training loop: train.loop.run_steps for M members at once, with per-member records."""

    def __init__(self, cfgs: list[RunConfig], members: list[Member], pack: PackedModel, optimizer: PackedAdamW,
                 probe: PackedProbe, held_out: HeldOut, precision: str, clock: ThroughputClock):
        self.cfgs, self.members, self.pack, self.optimizer, self.probe = cfgs, members, pack, optimizer, probe
        self.held_out, self.precision, self.clock = held_out, precision, clock
        self.base = cfgs[0]
        self.device = next(iter(pack.params.values())).device
        self.eval_time = 0.0
        self.limit: torch.Tensor | None = None  # each member's divergence threshold (factor × its first loss)
        self.first_bad = torch.full((pack.size,), -1, dtype=torch.long, device=self.device)
        self.bar = progress(self.base.max_steps, f"pack of {pack.size} ({self.base.label})") if self.base.progress else None
        self.start_step = 0

    def checkpoints(self, layout: OptimizerLayout, generators: dict[int, torch.Generator]) -> None:
        """What saving needs beside the pack: the optimizer's state_dict layout and the data generators by seed."""
        self.layout, self.generators = layout, generators

    def restore(self) -> None:
        """Continue from the members' checkpoints (all of one step): each restored as an unpacked run restores."""
        limits = []
        for i, member in enumerate(self.members):
            restored = restore_member(self.pack, self.optimizer, i, member.resumed, self.cfgs[i])
            self.start_step = restored.step
            member.tokens = restored.counters["tokens"]
            member.best_val, member.last_val = restored.counters["best_val"], restored.counters["last_val"]
            self.eval_time = restored.counters["eval_time"]
            self.generators[self.cfgs[i].seed].set_state(restored.generator_state)
            limits.append(restored.guard["limit"])
            self.first_bad[i] = restored.guard["first_bad"].to(self.device)
            member.products.load_state_dict({"records": restored.records})
            if i == 0:
                self.clock.load_state_dict(restored.clock)
        if all(limit is not None for limit in limits):
            self.limit = torch.stack(limits).to(self.device)

    def save(self, step: int) -> None:
        """Write every member still training a checkpoint of `step`, each into its run dir, as an unpacked run's."""
        for i, member in enumerate(self.members):
            if not member.active:
                continue
            cfg = self.cfgs[i]
            counters = {"tokens": member.tokens, "best_val": member.best_val, "last_val": member.last_val,
                        "eval_time": self.eval_time}
            state = member_checkpoint_state(self.pack, self.optimizer, self.layout, i, step=step,
                                            lr=lr_at(step - 1, cfg), generator=self.generators[cfg.seed], counters=counters)
            member.checkpointer.save(state, [
                Saved("divergence_guard", guard_state(cfg.diverge_factor, self.limit, self.first_bad, i)),
                Saved("throughput", self.clock.state_dict()),
                Saved("telemetry_products", member.products.state_dict()),
            ])

    def run(self, next_batches) -> None:
        """Train every member from step 0 to max_steps (or until it diverges), emitting its records."""
        base, clock_state = self.base, SimpleNamespace(watched=False, tokens=0, step=self.start_step)
        self.pack.template.train()
        if self.bar is not None:
            self.bar.on_train_start(clock_state)
        preempt.training_started()
        for step in range(self.start_step, base.max_steps + 1):
            records = {i: {"step": step, "tokens": m.tokens} for i, m in enumerate(self.members) if m.active}
            evaluated = (base.eval_every > 0 and step % base.eval_every == 0) or step == base.max_steps
            if evaluated:
                self._evaluate_into(step, records)
            if step == base.max_steps:
                self._emit(records)
                break
            if not any(m.active for m in self.members):
                break
            self.clock.on_step_start(clock_state)
            watched = self.probe.active(step)
            loss, grad_norm = self._train_step(step, next_batches, watched)
            stats = self.probe.collect() if watched else None
            logged = step % base.log_every == 0 or step == base.max_steps - 1 or evaluated or watched
            timing: dict[str, Any] | None = {} if logged else None
            self.clock.after_optimizer_step(clock_state, timing)
            if logged:
                self._fill(step, records, loss, grad_norm, stats, timing["tokens_per_s"])
                self._diverged_at_log(records)
                self._emit(records)
            if self.bar is not None:
                self.bar.on_step_end(clock_state, self._bar_record(records) if logged and records else None)
            self._step_boundary(step + 1)
        self.save(base.max_steps)  # the members that completed (diverged ones keep their last periodic checkpoint)
        clock_state.tokens = max(m.tokens for m in self.members)
        self.clock_summary: dict[str, Any] = {}
        self.clock.on_train_end(clock_state, self.clock_summary)
        if self.bar is not None:
            self.bar.on_train_end(clock_state, {})

    def _step_boundary(self, step: int) -> None:
        """After `step` updates: a periodic checkpoint when due, and on a preemption signal a checkpoint and Preempted."""
        signum = preempt.requested()
        if signum is not None or self.members[0].checkpointer.due(step):
            self.save(step)
        if signum is not None:
            raise Preempted(signum, step)

    def _train_step(self, step: int, next_batches, watched: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step of every member, measured by the probe when `watched`; returns their losses and
        gradient norms (M,), on the device."""
        base, pack = self.base, self.pack
        lrs = [lr_at(step, c) if m.active else 0.0 for c, m in zip(self.cfgs, self.members)]
        x, y = next_batches()
        total = torch.zeros(pack.size, device=self.device)
        with self.probe.watch() if watched else contextlib.nullcontext():
            for xm, ym in zip(x.chunk(base.grad_accum, dim=1), y.chunk(base.grad_accum, dim=1)):
                with autocast(self.device, self.precision):
                    loss = pack.losses(loss_fn, xm, ym, watcher=self.probe if watched else None)
                (loss / base.grad_accum).sum().backward()
                total += loss.detach()
        loss = total / base.grad_accum
        self._observe(step, loss)
        if watched:
            self.probe.measure_gradients()
        frozen = [i for i, m in enumerate(self.members) if not m.active]
        if frozen:  # a frozen member's gradient (NaN, perhaps) is dropped
            frozen_index = torch.tensor(frozen, device=self.device)
            for p in pack.params.values():
                if p.grad is not None:
                    p.grad.index_fill_(0, frozen_index, 0.0)
        max_norm = base.optim.grad_clip if base.optim.grad_clip > 0 else math.inf
        grad_norm = clip_members(list(pack.params.values()), max_norm)
        pack.advance_running_statistics()
        if watched:
            self.probe.before_update()
        self.optimizer.step(lrs)
        self.optimizer.zero_grad()
        for member in self.members:
            if member.active:
                member.tokens += base.batch_size * base.seq_len
        return loss, grad_norm

    def _observe(self, step: int, loss: torch.Tensor) -> None:
        """train.DivergenceGuard, per member: remember each member's first step with a non-finite loss or
        one above diverge_factor × its first loss."""
        factor = self.base.diverge_factor
        if self.limit is None:
            self.limit = loss * factor if factor > 0 else torch.full_like(loss, math.inf)
        bad = ~torch.isfinite(loss) | (loss > self.limit)
        self.first_bad = torch.where(bad & (self.first_bad < 0), step, self.first_bad)

    def _diverged_at_log(self, records: dict[int, dict[str, Any]]) -> None:
        """On a logged step, end every member whose guard has fired (its record of this step is not emitted)."""
        for i, first_bad in enumerate(self.first_bad.tolist()):
            if first_bad >= 0 and self.members[i].active:
                self._diverge(i, first_bad)
                records.pop(i, None)

    def _diverge(self, i: int, step: int) -> None:
        member = self.members[i]
        member.diverged_step = step
        member.last_val = math.nan
        cfg = self.cfgs[i]
        for sink in member.sinks:
            sink.log({"step": step, "tokens": step * cfg.batch_size * cfg.seq_len, "status": "diverged"})

    def _evaluate_into(self, step: int, records: dict[int, dict[str, Any]]) -> None:
        started = time.perf_counter()
        losses = evaluate_pack(self.pack, self.held_out.batches, self.device, self.precision).tolist()
        self.eval_time += time.perf_counter() - started
        for i in list(records):
            member, val = self.members[i], losses[i]
            if not math.isfinite(val):
                self._diverge(i, step)
                records.pop(i)
                continue
            member.last_val, member.best_val = val, min(member.best_val, val)
            records[i].update(val_loss=val, val_bpb=self.held_out.bits_per_byte(val))

    def _fill(self, step: int, records: dict[int, dict[str, Any]], loss: torch.Tensor, grad_norm: torch.Tensor,
              stats: list[dict[str, float]] | None, tokens_per_s: float) -> None:
        """A logged step's figures, in the order an unpacked record has them: the member's loss, lr and gradient
        norm, its telemetry, and its own throughput (its tokens over the pack's step time)."""
        losses, norms = loss.tolist(), grad_norm.tolist()
        for i, record in records.items():
            record.update(loss=losses[i], lr=lr_at(step, self.cfgs[i]), grad_norm=norms[i])
            record.update(stats[i] if stats is not None else {})
            record["tokens_per_s"] = tokens_per_s

    def _emit(self, records: dict[int, dict[str, Any]]) -> None:
        for i, record in records.items():
            self.members[i].emit(record)

    def _bar_record(self, records: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The progress bar's figures: the lowest loss among the members still training, the pack's throughput."""
        best = min(records.values(), key=lambda r: r["loss"])
        return {**best, "tokens_per_s": best["tokens_per_s"] * self.pack.size}

    def result(self, i: int, batchnorm: BatchNormSteps, corpus: Corpus) -> dict[str, Any]:
        """Member i's part of summary.json, as train.run._fit makes it, and the pack's size and throughput."""
        member, cfg = self.members[i], self.cfgs[i]
        out: dict[str, Any] = {"status": "completed"}
        if member.resumed is not None:
            out["resumed_from_step"] = member.resumed.step
        if member.diverged_step is not None:
            out.update(status="diverged", diverged_step=member.diverged_step)
        out.update(
            final_val_loss=member.last_val,
            best_val_loss=member.best_val,
            final_val_bpb=self.held_out.bits_per_byte(member.last_val),
            best_val_bpb=self.held_out.bits_per_byte(member.best_val),
            steps=cfg.max_steps if member.diverged_step is None else member.diverged_step,
            tokens=member.tokens,
            n_params=sum(p[i].numel() for p in self.pack.params.values()),
            device=self.device.type,
            precision=self.precision,
            eval_time_s=round(self.eval_time, 3),
        )
        out.update(self.clock_summary)
        # The device ran every member's step at once: its utilization is the pack's.
        out["pack_size"] = self.pack.size
        out["pack_tokens_per_s"] = out["tokens_per_s"] * self.pack.size
        if "mfu" in out:
            out["mfu"] = round(out["mfu"] * self.pack.size, 4)
        batchnorm.on_train_end(None, out)
        if member.products is not None:
            member.products.on_train_end(None, out)
        if member.report is not None:
            member.report.on_train_end(None, out)
        return out


@torch.no_grad()
def evaluate_pack(pack: PackedModel, batches, device: torch.device, precision: str) -> torch.Tensor:
    """Each member's mean loss over the fixed held-out batches, (M,), in eval mode (as train.loop.evaluate)."""
    was_training = pack.template.training
    pack.template.eval()
    total = torch.zeros(pack.size, device=device)
    for x, y in batches:
        with autocast(device, precision):
            total += pack.losses(loss_fn, x.to(device), y.to(device), shared=True)
    pack.template.train(was_training)
    return total / len(batches)
