"""Training a pack: `train_pack` checks the members can pack exactly (check_pack), opens each member's run dir
as train() opens a run's, builds the packed model, runs normlab.train.pack.loop's PackLoop, and records every
member's end in its own summary.json.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from typing import Any, Sequence

import torch

import normlab.train.distributed as distributed
import normlab.train.preempt as preempt
from normlab.config import ConfigError, RunConfig
from normlab.config.packing import FP16_REFUSED, TORCHRUN_REFUSED, check_packable
from normlab.data import Corpus, load_corpus
from normlab.nn.flops import model_flops_per_token, peak_flops
from normlab.nn.model import GPT
from normlab.nn.packed import PackedAdamW, PackedModel
from normlab.train.callbacks import BatchNormSteps, RunReport, TelemetryProducts, ThroughputClock
from normlab.train.checkpoint import Checkpointer, resolve_resume, rewind
from normlab.train.loop import batch_loader, held_out_batches
from normlab.train.optim import param_groups
from normlab.train.pack.checkpoint import OptimizerLayout
from normlab.train.pack.loop import Member, PackLoop
from normlab.telemetry.packed import PackedProbe
from normlab.train.preempt import Preempted
from normlab.train.phases import Phases, RunClock, run_ended, startup_seconds
from normlab.train.run import record_end, summary_head, with_model_vocab
from normlab.train.runtime import (
    configure_determinism, configure_host_allocator, configure_matmul, resolve_device, resolve_precision, seed_everything,
)
from normlab.train.sinks import RunDir, RunDirGone, SinkContext, open_sinks

log = logging.getLogger("normlab")


def check_pack(cfgs: Sequence[RunConfig]) -> None:
    """Raise ConfigError (one line) unless `cfgs` can train as one exact pack: their configs (check_packable), this
    process's ranks, and the precision their device resolves."""
    check_packable(cfgs)
    if distributed.is_active():
        raise ConfigError(TORCHRUN_REFUSED)
    try:
        device = resolve_device(cfgs[0].device)
    except RuntimeError:  # device=cuda without one: training says so; fp16 cannot be the precision then
        device = torch.device("cpu")
    if resolve_precision(cfgs[0].precision, device) == "fp16":
        raise ConfigError(FP16_REFUSED)


def train_pack(members: Sequence[tuple[RunConfig, str | os.PathLike]]) -> list[dict[str, Any] | RunDirGone]:
    """Train `members` (config, run dir) as one pack; write each run dir as train.train does; return their
    summaries in order, or for a member whose run dir went mid-run, the RunDirGone that stopped it (nothing more
    is written at its path; the others trained on). Every run dir is locked for the pack. On an exception every
    member's summary.json records the failure, and the exception propagates."""
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
    started, phases = time.time(), Phases()  # the pack's, shared by its members (docs/sweeps.md)
    startup = startup_seconds(started)
    if startup is not None:
        phases.add("startup", startup)
    with phases.time("setup"):
        _resume_points(members, started)
    summaries = [summary_head(m.cfg) for m in members]
    exit_code = 1
    try:
        with phases.time("data"):
            first = members[0].cfg
            corpus = load_corpus(first.data, first.tokenizer, seq_len=first.seq_len, progress=first.progress)
        for member, summary in zip(members, summaries):
            summary.update(corpus=corpus.source, corpus_bytes=corpus.n_bytes, corpus_sha256=corpus.sha256,
                           tokenizer=corpus.tokenizer.identity)
            if member.resumed is not None:
                member.resumed.check_corpus(corpus.sha256)
        with preempt.deferred(), phases.time("sinks"):  # from here the run dirs change: no signal leaves one halfway
            for member in members:
                _open_run(member, corpus)
        with phases.time("train"):  # the packed model's build, steps, evaluations and checkpoints
            results = _fit_pack(members, corpus)
        for member, summary, result in zip(members, summaries, results):
            summary.update(result if member.gone is None else {"status": "failed", "error": f"RunDirGone: {member.gone}"})
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
            summary["phases_shared_by"] = len(members)  # the pack's phases: a sweep's totals count them once
            # A gone member's summary is not written (record_end): its sinks finish as a failed run's.
            troubles.append(record_end(member.run_dir, summary, member.sinks, 1 if member.gone else exit_code, phases,
                                       member.clock))
        run_ended()
    trouble = next((t for t in troubles if t is not None), None)
    if trouble is not None:
        raise trouble
    return [summary if member.gone is None else member.gone for member, summary in zip(members, summaries)]


def _resume_points(members: list[Member], started: float) -> None:
    """Each member's checkpoint to resume from (resolve_resume, which refuses in one line before anything
    changes), and its clock from `started` on; a pack resumes only when every member has one, all of one step."""
    for member in members:
        member.resumed = resolve_resume(member.cfg, member.run_dir.path)
        member.clock = RunClock.resuming(started, member.resumed)
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
    member.checkpointer = Checkpointer(run_dir.path, cfg, wandb_run_id=wandb_run_id, corpus_sha256=corpus.sha256,
                                       clock=member.clock)
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
    """Build the pack, run its steps, and return each member's results ({} for a member whose run dir went)."""
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
    try:
        try:
            loop.run(lambda: _next_batches(cfgs, loaders))
        except BaseException:
            if loop.bar is not None:
                loop.bar.on_train_stop(None)  # closed before the line that says why the pack stopped
            raise
        results = [loop.result(i, batchnorm, corpus) if member.gone is None else {} for i, member in enumerate(members)]
    except BaseException:
        loop.finish_saves(raise_errors=False)  # the final checkpoints land whole whatever stopped the ends
        raise
    loop.finish_saves()  # before any member's summary says it completed
    return results


def _next_batches(cfgs: Sequence[RunConfig], loaders) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's training batches, (M, B, T): one draw per seed, shared by the members with that seed."""
    drawn = {seed: loader() for seed, loader in loaders.items()}
    return (torch.stack([drawn[c.seed][0] for c in cfgs]), torch.stack([drawn[c.seed][1] for c in cfgs]))
