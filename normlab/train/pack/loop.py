"""The packed training loop: PackLoop runs train.loop.run_steps for every member of a pack at once, with
per-member records, divergence, checkpoints and results; `evaluate_pack` is train.loop.evaluate per member.
A Member is one run of the pack: its config, run dir, sinks, counters and how it ended.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import normlab.train.preempt as preempt
from normlab.config import RunConfig
from normlab.data import Corpus
from normlab.nn.packed import PackedAdamW, PackedModel, clip_members
from normlab.train.callbacks import BatchNormSteps, RunReport, TelemetryProducts, ThroughputClock, progress
from normlab.train.checkpoint import Checkpoint, Checkpointer
from normlab.train.loop import HeldOut, loss_fn, z_loss_term
from normlab.train.optim import lr_at
from normlab.train.phases import RunClock
from normlab.train.pack.checkpoint import OptimizerLayout, Saved, guard_state, member_checkpoint_state, restore_member
from normlab.telemetry.packed import PackedProbe
from normlab.train.preempt import Preempted
from normlab.telemetry.norms import EpsWarnings
from normlab.train.runtime import autocast
from normlab.train.sinks import RunDir, RunDirGone, Sink
from normlab.util.errors import one_line

log = logging.getLogger("normlab")


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
    clock: RunClock | None = None  # its wall time across segments (a pack resumed)
    gone: RunDirGone | None = None  # its run dir went mid-run: it stopped there, and writes nothing more

    @property
    def active(self) -> bool:
        return self.diverged_step is None and self.gone is None

    def emit(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)
        if self.products is not None:
            self.products.on_step_end(None, record)


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
        self.eps_warnings = [EpsWarnings() for _ in members]
        self.final_writes: list[tuple[Path, Future]] = []  # the final checkpoints' paths and writes, until finish_saves

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

    def save(self, step: int, writer: ThreadPoolExecutor | None = None) -> None:
        """Write every member still training a checkpoint of `step`, each into its run dir, as an unpacked run's. With
        `writer`, each checkpoint is taken now and written by it, its write kept in final_writes as it is handed over
        (should a later member's checkpoint fail to be taken, finish_saves still waits for the earlier ones)."""
        for i, member in enumerate(self.members):
            if not member.active:
                continue
            cfg = self.cfgs[i]
            counters = {"tokens": member.tokens, "best_val": member.best_val, "last_val": member.last_val,
                        "eval_time": self.eval_time}
            state = member_checkpoint_state(self.pack, self.optimizer, self.layout, i, step=step,
                                            lr=lr_at(step - 1, cfg), generator=self.generators[cfg.seed], counters=counters)
            saved = [
                Saved("divergence_guard", guard_state(cfg.diverge_factor, self.limit, self.first_bad, i)),
                Saved("throughput", self.clock.state_dict()),
                Saved("telemetry_products", member.products.state_dict()),
            ]
            if writer is None:
                member.checkpointer.save(state, saved)
            elif member.checkpointer.writes:
                path, payload = member.checkpointer.payload(state, saved)
                self.final_writes.append((path, writer.submit(member.checkpointer.write, path, payload)))

    def finish_saves(self, raise_errors: bool = True) -> None:
        """Wait until the final checkpoints are written; then the first write that failed raises (with raise_errors).
        Without, every write that failed is said on the log: another error stops the pack, and is the one recorded."""
        writes, self.final_writes = self.final_writes, []
        failed = [(path, error) for path, write in writes if (error := write.exception()) is not None]
        if failed and raise_errors:
            raise failed[0][1]
        for path, error in failed:
            log.error("%s: not written: %s: %s", path, type(error).__name__, one_line(error))

    def run(self, next_batches) -> None:
        """Train every member from step 0 to max_steps (or until it diverges), emitting its records."""
        base, clock_state = self.base, SimpleNamespace(watched=False, tokens=0, step=self.start_step)
        self.pack.template.train()
        if self.bar is not None:
            self.bar.on_train_start(clock_state)
        preempt.training_started()
        self._check_dirs(self.start_step)
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
            loss, grad_norm, terms = self._train_step(step, next_batches, watched)
            stats = self.probe.collect() if watched else None  # this step's wait for the device, as _fill's losses
            if stats is not None:
                self._warn_eps(step, stats)
            logged = step % base.log_every == 0 or step == base.max_steps - 1 or evaluated or watched
            timing: dict[str, Any] | None = {} if logged else None
            self.clock.after_optimizer_step(clock_state, timing)
            if logged:
                self._fill(step, records, (loss, grad_norm, terms), stats, timing["tokens_per_s"])
                self._diverged_at_log(records)
                self._emit(records)
            if self.bar is not None:
                self.bar.on_step_end(clock_state, self._bar_record(records) if logged and records else None)
            self._step_boundary(step + 1)
        self._check_dirs(base.max_steps)
        clock_state.tokens = max(m.tokens for m in self.members)
        self.clock_summary: dict[str, Any] = {}
        # Before the final checkpoints are taken, as an unpacked run's clock ends before its Checkpointing: on CUDA its
        # peak memory is the training's, not that plus every member's copies held until the thread has written them.
        self.clock.on_train_end(clock_state, self.clock_summary)
        # The members that completed (diverged ones keep their last periodic checkpoint). Nothing changes their state
        # after this: the checkpoints are written by a thread while the members' ends (heatmaps, reports) run, and
        # finish_saves waits for them before any summary is written.
        writer = ThreadPoolExecutor(1, thread_name_prefix="pack-checkpoints")
        try:
            self.save(base.max_steps, writer)
        finally:
            writer.shutdown(wait=False)  # its thread ends when the last write is done
        if self.bar is not None:
            self.bar.on_train_end(clock_state, {})

    def _warn_eps(self, step: int, stats: list[dict[str, float]]) -> None:
        """Each member's warning about its eps-dominated norms, as an unpacked run's Telemetry logs it."""
        for i, member_stats in enumerate(stats):
            warning = self.eps_warnings[i].line(member_stats, step) if self.members[i].active else None
            if warning:
                log.warning("%s: %s", self.cfgs[i].run_name, warning)

    def _check_dirs(self, step: int) -> None:
        """An unpacked run's RunDirWatch, per member: a member whose run dir went (deleted, moved or replaced:
        RunDir.check_in_place) stops at `step`, trains no more and writes nothing more, not even at its end
        (its RunDirGone is how it ended); the other members train on. One stat per member."""
        for member in self.members:
            if member.gone is None:
                try:
                    member.run_dir.check_in_place(step)
                except RunDirGone as gone:
                    member.gone = gone

    def _step_boundary(self, step: int) -> None:
        """After `step` updates: each member's run dir still in place (_check_dirs), a periodic checkpoint when due,
        and on a preemption signal a checkpoint and Preempted."""
        self._check_dirs(step)
        signum = preempt.requested()
        if signum is not None or self.members[0].checkpointer.due(step):
            self.save(step)
        if signum is not None:
            raise Preempted(signum, step)

    def _train_step(self, step: int, next_batches, watched: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One optimizer step of every member, measured by the probe when `watched`; returns their losses
        (cross-entropy), gradient norms and the objective's other terms ({'z_loss': ...} under z_loss > 0),
        each (M,), on the device."""
        base, pack = self.base, self.pack
        lrs = [lr_at(step, c) if m.active else 0.0 for c, m in zip(self.cfgs, self.members)]
        x, y = next_batches()
        total, z_total = torch.zeros(pack.size, device=self.device), torch.zeros(pack.size, device=self.device)
        with self.probe.watch() if watched else contextlib.nullcontext():
            for xm, ym in zip(x.chunk(base.grad_accum, dim=1), y.chunk(base.grad_accum, dim=1)):
                with autocast(self.device, self.precision):
                    loss, z = self._member_losses(xm, ym, watched)
                ((loss if z is None else loss + z) / base.grad_accum).sum().backward()
                total += loss.detach()
                if z is not None:
                    z_total += z.detach()
        loss = total / base.grad_accum
        terms = {"z_loss": z_total / base.grad_accum} if base.z_loss else {}
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
        return loss, grad_norm, terms

    def _member_losses(self, xm: torch.Tensor, ym: torch.Tensor, watched: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each member's cross-entropy on its micro-batch, and its z-loss term (None under z_loss=0), (M,) each."""
        watcher = self.probe if watched else None
        coefficient = self.base.z_loss
        if not coefficient:
            return self.pack.losses(loss_fn, xm, ym, watcher=watcher), None

        def objective(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return loss_fn(logits, targets), z_loss_term(logits, coefficient)

        return self.pack.losses(objective, xm, ym, watcher=watcher)

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

    def _fill(self, step: int, records: dict[int, dict[str, Any]], measured: tuple[torch.Tensor, torch.Tensor, dict],
              stats: list[dict[str, float]] | None, tokens_per_s: float) -> None:
        """A logged step's figures, in the order an unpacked record has them: the member's loss, lr, gradient
        norm and the objective's other terms, its telemetry, and its own throughput (its tokens over the
        pack's step time). `measured`: _train_step's losses, gradient norms and terms."""
        loss, grad_norm, terms = measured
        losses, norms = loss.tolist(), grad_norm.tolist()
        term_values = {key: term.tolist() for key, term in terms.items()}
        for i, record in records.items():
            record.update(loss=losses[i], lr=lr_at(step, self.cfgs[i]), grad_norm=norms[i])
            record.update({key: values[i] for key, values in term_values.items()})
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
