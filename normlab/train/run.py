"""The training run: `train(cfg, run_dir)` trains one model and returns its summary.

Knows nothing of Hydra. It reads a validated RunConfig, builds data, model and the TrainState
(normlab.train.state), runs AdamW with warmup + cosine decay (normlab.train.optim), evaluates on fixed
held-out batches, and hands every record to the sinks the config names (normlab.train.sinks). The steps
themselves are normlab.train.loop's `run_steps`; everything beside training (telemetry, the divergence
guard, checkpoints and preemption, the progress bar, the throughput clock) is a callback
(normlab.train.callbacks) with hooks at fixed points of the step. The run owns the run dir: it writes
config.json and summary.json, and records how the run ended even when training raised.

Under DDP the ranks agree on a preemption request every PREEMPT_CHECK_EVERY steps (normlab.train.callbacks),
not with a collective per step. On glibc, freed host memory is kept for reuse
(runtime.configure_host_allocator), so CPU steps do not page-fault on their activations.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import nn

import normlab.train.distributed as distributed
import normlab.train.preempt as preempt
from normlab.config import RunConfig
from normlab.data import Corpus, load_corpus, model_vocab_size
from normlab.nn.flops import model_flops_per_token, peak_flops
from normlab.nn.model import GPT
from normlab.train.callbacks import (
    BatchNormSteps, Callback, Checkpointing, DivergenceGuard, RunDirWatch, RunReport, Telemetry, TelemetryProducts,
    ThroughputClock, progress,
)
from normlab.train.checkpoint import Checkpoint, CheckpointError, Checkpointer, resolve_resume, rewind
from normlab.train.ending import RunEnd, drain, hand_over, record_end
from normlab.train.environment import run_environment
from normlab.train.loop import SET_ASIDE, batch_loader, emit, held_out_batches, run_steps
from normlab.train.optim import param_groups
from normlab.train.phases import Phases, RunClock, run_ended, startup_seconds
from normlab.train.preempt import Preempted
from normlab.telemetry.probe import Probe
from normlab.train.runlog import run_log
from normlab.train.runtime import (
    compile_model, compile_steps, configure_determinism, configure_host_allocator, configure_matmul, cuda_graphs,
    resolve_device, resolve_precision, seed_everything,
)
from normlab.train.sinks import RunDir, Sink, SinkContext, open_sinks
from normlab.train.state import TrainState


def train(
    cfg: RunConfig, run_dir: str | RunDir, sinks: list[Sink] | None = None, callbacks: Sequence[Callback] = (),
    echo: bool = True, defer_end: bool = False,
) -> dict[str, Any]:
    """Train one model as `cfg` says; write config.json and summary.json into `run_dir`; return the summary.

    The sinks are the ones `cfg.sinks` names (or, given, `sinks` as they are: pass them for a fresh
    run only, since a resumed run rewinds metrics.jsonl before it opens its own); every one that opened
    is finished, with a non-zero exit code if training raised, even when another fails to. `callbacks`
    run after the built-in ones at every hook, before checkpointing, and are checkpointed with them.

    The run dir is locked for the run (RunDirBusy if another process holds it). `cfg.resume` decides
    where training starts (see checkpoint.resolve_resume); everything that can refuse it (a checkpoint
    that does not restore, records of another config) raises CheckpointError before anything in
    `run_dir` changes. A preemption signal (preempt.py) raises Preempted:
    before the first step at once, later after the checkpoint is saved. Under torchrun only rank 0 writes files.

    The run says what it does as `normlab train` does: a first line (name, device, precision, parameters, run
    dir) and a last (status, losses, tokens/s), in the run dir's normlab.log and, with `echo`, on the terminal
    (normlab.train.runlog).

    With `defer_end` (a sweep's job), a completed run returns once its summary.json says how it ended, and the rest
    of its end (the end-of-run products, the sinks' finish, summary.json again with their time) runs in this
    process's end thread (normlab.train.ending), under the run dir's lock; `ending.drain()` waits for it.
    """
    run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    writes = distributed.is_main()
    with run_dir.lock() if writes else contextlib.nullcontext(), preempt.starting(), \
            run_log(run_dir.path, echo) if writes else contextlib.nullcontext():
        return _train_in(cfg, run_dir, sinks, callbacks, writes, RunEnd() if defer_end and writes else None)


def summary_head(cfg: RunConfig) -> dict[str, Any]:
    """The first fields of every summary.json: what the run is, status `running`, and the environment its
    numbers depend on (environment.run_environment), so a failed run's summary.json has it too."""
    return {
        "name": cfg.run_name,
        "norm": cfg.norm.label,
        "placement": cfg.placement,
        "qk_norm": cfg.qk_norm,
        "depth": cfg.depth,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "group": cfg.wandb.group,
        "status": "running",
        "environment": run_environment(cfg.device),
    }


def _train_in(cfg: RunConfig, run_dir: RunDir, sinks: list[Sink] | None, callbacks: Sequence[Callback],
              writes: bool, end: RunEnd | None) -> dict[str, Any]:
    """train() inside the run dir's lock: refuse, or change the run dir, train, and record how it ended."""
    started, phases = time.time(), Phases()
    startup = startup_seconds(started)
    if startup is not None:
        phases.add("startup", startup)
    with phases.time("setup"):
        resumed = resolve_resume(cfg, run_dir.path)
        summary = summary_head(cfg)
    clock = RunClock.resuming(started, resumed)
    opened: list[Sink] = []
    exit_code = 1
    try:
        with phases.time("data"):
            corpus = load_corpus(cfg.data, cfg.tokenizer, seq_len=cfg.seq_len, progress=cfg.progress)
        summary.update(corpus=corpus.source, corpus_bytes=corpus.n_bytes, corpus_sha256=corpus.sha256,
                       tokenizer=corpus.tokenizer.identity)
        with phases.time("setup"):
            if resumed is not None:
                resumed.check_corpus(corpus.sha256)
                check_resumable(cfg, resumed, callbacks)
            wandb_run_id = (resumed.wandb_run_id if resumed else None) or secrets.token_hex(4)
            checkpointer = Checkpointer(run_dir.path, cfg, wandb_run_id=wandb_run_id, corpus_sha256=corpus.sha256,
                                        world_size=distributed.world_size(), writes=writes, clock=clock)
        if writes:
            _open_run_dir(cfg, run_dir, corpus, resumed, wandb_run_id, sinks, opened, phases)
        summary.update(_fit(cfg, corpus, opened, checkpointer, resumed, callbacks, run_dir if writes else None, phases,
                            end))
        exit_code = 0  # a diverged run is an outcome, not a failure
    except Preempted as stop:
        if stop.step is None:  # stopped before the first step: the run is where it started
            stop.step = resumed.step if resumed else 0
        summary.update(status=stop.status, preempted_step=stop.step)
        exit_code = 128 + stop.signum
        drain()  # the process may end with the signal: the earlier runs' ends first
        raise
    except CheckpointError:
        writes = False  # the run dir stays as it was
        raise
    except BaseException as err:
        summary["status"] = "failed"
        summary["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        preempt.training_started()  # no signal may cut the records of the run's end short
        if end is not None and exit_code == 0:
            trouble = hand_over(run_dir, summary, opened, phases, clock, end)
        else:
            trouble = record_end(run_dir if writes else None, summary, opened, exit_code, phases, clock,
                                 end.tasks if end is not None else ())
        run_ended()
    if trouble is not None:
        raise trouble  # training went well, but its records could not all be written
    return summary


def _open_run_dir(cfg: RunConfig, run_dir: RunDir, corpus: Corpus, resumed: Checkpoint | None, wandb_run_id: str,
                  sinks: list[Sink] | None, opened: list[Sink], phases: Phases) -> None:
    """From here the run dir changes (no signal leaves it halfway): reserve it, write config.json (and the
    tokenizer), rewind its records to the checkpoint's step, and open the sinks into `opened`."""
    with preempt.deferred():
        with phases.time("setup"):
            run_dir.reserve()
            run_dir.write_config(cfg.to_dict())
            if corpus.tokenizer.kind != "byte":
                corpus.tokenizer.save(run_dir.path / "tokenizer.json")  # `normlab sample` decodes with it
            start_step = resumed.step if resumed else None
            history = rewind(run_dir.path, start_step or 0)
        context = SinkContext(cfg, run_dir, cfg.run_name, wandb_run_id, start_step, history)
        with phases.time("sinks"):
            if sinks is None:
                open_sinks(context, into=opened)
            else:
                opened.extend(sinks)


def check_resumable(cfg: RunConfig, checkpoint: Checkpoint, extra: Sequence[Callback] = ()) -> None:
    """Raise CheckpointError unless `checkpoint` restores into a run of `cfg`: a dry restore into a fresh
    state on the CPU and the loop's callbacks, so a checkpoint that lacks a piece is refused before the
    run dir changes. (It restores the RNG states too; the real restore sets them again.)"""
    cpu = torch.device("cpu")
    if cfg.model.vocab_size is None:  # the tokenizer's, which the checkpoint's embedding has
        try:
            vocab = int(checkpoint.payload["state"]["model"]["tok_emb.weight"].shape[0])
        except (KeyError, TypeError, AttributeError, IndexError):
            raise CheckpointError(f"{checkpoint.path}: holds no model embedding (state.model.tok_emb.weight)") from None
        cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    state = build_state(cfg, cpu, "fp32")
    checkpointer = Checkpointer(checkpoint.path.parent, cfg, wandb_run_id=None, corpus_sha256="", writes=False)
    checkpoint.restore(state, standard_callbacks(replace(cfg, progress=False), state, [], checkpointer, cpu, extra))


def check_same_corpus(cfg: RunConfig, checkpoint: Checkpoint) -> None:
    """Raise CheckpointError unless the corpus `cfg` reads now is the one `checkpoint` was trained on (its sha256), or
    DataError if it cannot be read: before a run dir changes, what train() checks once it has loaded its data. The
    corpus is read from the token cache where it is there, as train() then reads it."""
    if checkpoint.payload.get("corpus_sha256") is not None:
        checkpoint.check_corpus(load_corpus(cfg.data, cfg.tokenizer).sha256)


def with_model_vocab(cfg: RunConfig, corpus: Corpus) -> RunConfig:
    """`cfg` with the model's vocabulary resolved: the tokenizer's when model.vocab_size is null. A copy, so
    the config that checkpoints and config.json keep is the one given."""
    vocab = model_vocab_size(cfg.model.vocab_size, corpus)
    return replace(cfg, model=replace(cfg.model, vocab_size=vocab))


def build_state(cfg: RunConfig, device: torch.device, precision: str) -> TrainState:
    """A fresh TrainState: the seeded model on `device`, AdamW over its parameter groups, the GradScaler
    (active under fp16 only), and the data generator, whose draws depend on the seed alone (never on the
    model), so every arm of a sweep sees the same batches."""
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay),
        lr=cfg.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        fused=device.type == "cuda",
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    return TrainState(model, optimizer, scaler, torch.Generator().manual_seed(cfg.seed))


def standard_callbacks(cfg: RunConfig, state: TrainState, sinks: list[Sink], checkpointer: Checkpointer,
                       device: torch.device, extra: Sequence[Callback] = (), run_dir: RunDir | None = None,
                       net: nn.Module | None = None, end: RunEnd | None = None) -> list[Callback]:
    """The loop's callbacks in hook order, `extra` ones before checkpointing (which saves them all); given the
    `run_dir` the run writes, first of all its watch (RunDirWatch), so no callback writes into a vanished dir.
    `net`: what telemetry steps run (the DDP wrapper under torchrun; by default the model).

    The guard comes first (it stops a diverged step before anything measures it), then telemetry, then
    the clock (whose step time so includes telemetry's cost), then what reads the finished record. Given the run's
    `end`, the end-of-run products are made there (normlab.train.ending), not in on_train_end.
    """
    callbacks: list[Callback] = [RunDirWatch(run_dir)] if run_dir is not None else []
    callbacks += [
        DivergenceGuard(cfg.diverge_factor, device),
        BatchNormSteps(state.model, cfg),  # before telemetry, which reads the step's running statistics
        Telemetry(Probe(state.model, cfg.telemetry.every, cfg.max_steps, net, compiled=cfg.compile,
                        graphs=cuda_graphs(cfg, device))),
        ThroughputClock(cfg.batch_size * cfg.seq_len, compile_steps(cfg, device), model_flops_per_token(cfg),
                        peak_flops(device, resolve_precision(cfg.precision, device), cfg.tf32), device),
        TelemetryProducts(sinks, later=end.add if end is not None else None),
    ]
    if distributed.is_main():
        callbacks.append(RunReport(cfg.run_name, resolve_precision(cfg.precision, device), str(checkpointer.run_dir)))
        if cfg.progress:
            callbacks.append(progress(cfg.max_steps, cfg.run_name))
    callbacks += extra
    callbacks.append(Checkpointing(checkpointer, callbacks, cfg.max_steps))
    return callbacks


def _fit(cfg: RunConfig, corpus: Corpus, sinks: list[Sink], checkpointer: Checkpointer, resumed: Checkpoint | None,
         extra: Sequence[Callback], run_dir: RunDir | None, phases: Phases, end: RunEnd | None) -> dict[str, Any]:
    """Build everything, restore a checkpoint if resuming, run the steps; return the run's results."""
    with phases.time("model"):
        cfg = with_model_vocab(cfg, corpus)
        device = distributed.local_device(resolve_device(cfg.device))
        precision = resolve_precision(cfg.precision, device)
        seed_everything(cfg.seed)
        configure_matmul(device, cfg.tf32)
        configure_determinism(cfg.deterministic)
        configure_host_allocator()
        state = build_state(cfg, device, precision)
        state.phases = phases
        net = distributed.wrap(state.model, device, sync_batchnorm=cfg.norm.sync)  # the model itself for one process
        # Evaluation runs eager `net`/`model` (telemetry steps the Probe's forward of `net`, compiled under
        # compile=true); checkpoints hold `model`, so no `_orig_mod.` keys.
        fast = compile_model(net, cfg.compile_mode, device) if cfg.compile else net
        callbacks = standard_callbacks(cfg, state, sinks, checkpointer, device, extra, run_dir, net, end)
        if resumed is not None:
            resumed.restore(state, callbacks)
        for callback in callbacks:
            callback.on_train_start(state)
    with phases.time("data"):
        next_batch = batch_loader(corpus.train, cfg, state.data_gen, device)
        held_out = held_out_batches(corpus, cfg)
    diverged_step = _timed_steps(cfg, state, (net, fast), next_batch, held_out, callbacks, sinks, precision)

    result: dict[str, Any] = {"status": "completed"}
    if resumed is not None:
        result["resumed_from_step"] = resumed.step
    if diverged_step is not None:
        emit(sinks, {"step": diverged_step, "tokens": diverged_step * cfg.batch_size * cfg.seq_len, "status": "diverged"})
        result.update(status="diverged", diverged_step=diverged_step)
        state.last_val = math.nan
    result.update(
        final_val_loss=state.last_val,
        best_val_loss=state.best_val,
        final_val_bpb=held_out.bits_per_byte(state.last_val),
        best_val_bpb=held_out.bits_per_byte(state.best_val),
        steps=cfg.max_steps if diverged_step is None else diverged_step,
        tokens=state.tokens,
        n_params=sum(p.numel() for p in state.model.parameters()),
        device=device.type,
        precision=precision,
        eval_time_s=round(state.eval_time, 3),
    )
    for callback in callbacks:  # checkpointing times its own save
        with contextlib.nullcontext() if isinstance(callback, Checkpointing) else phases.time("products"):
            callback.on_train_end(state, result)
    return result


def _timed_steps(cfg: RunConfig, state: TrainState, *args) -> int | None:
    """run_steps, its time split into `compile` (its first step), `train`, and the evaluations and checkpoints
    inside it (which they time themselves)."""
    aside = ("compile", *SET_ASIDE)
    before, started = state.phases.total(aside), time.perf_counter()
    try:
        return run_steps(cfg, state, *args)
    finally:
        state.phases.add("train", time.perf_counter() - started - (state.phases.total(aside) - before))
