"""The training loop: `train(cfg, run_dir)` trains one model and returns its summary.

Knows nothing of Hydra. It reads a validated RunConfig, builds data, model and the TrainState
(normlab.train.state), runs AdamW with warmup + cosine decay, evaluates on fixed held-out batches, and
hands every record to the sinks the config names (normlab.train.sinks). The loop (`run_steps`) reads top
to bottom; everything beside training (telemetry, the divergence guard, checkpoints and
preemption, the progress bar, the throughput clock) is a callback (normlab.train.callbacks) with hooks
at fixed points of the step. The loop owns the run dir: it writes config.json and summary.json.

Step convention: record `step` s holds what was measured at the weights after s
updates: the training loss and gradient of batch s, and val_loss when evaluated.
So step 0 is initialization, and the final evaluation is logged at step max_steps.
Telemetry steps (0, every telemetry.every steps, max_steps - 1) are always logged steps.

Speed: with `compile=true` the other training steps run a torch.compile'd module, while
watched (telemetry) steps and evaluation run the eager one (hooks attach to eager modules);
`compile_mode=reduce-overhead` also captures the compiled steps in CUDA graphs (compile_model). The
host reads device values (`.item()`) on logged steps only, each batch is drawn, pinned and copied
(non-blocking) while the previous step may still run on the device, and under DDP the ranks agree
on a preemption request every PREEMPT_CHECK_EVERY steps (callbacks.py), not with a collective per step.
On glibc, freed host memory is kept for reuse (configure_host_allocator), so CPU steps do not
page-fault on their activations.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import random
import secrets
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from normlab.train import distributed
from normlab.train.callbacks import BatchNormSteps
from normlab.train.callbacks import (
    Callback, Checkpointing, DivergenceGuard, Diverged, RunReport, Telemetry, TelemetryProducts, ThroughputClock, progress,
)
from normlab.train.checkpoint import Checkpoint, CheckpointError, Checkpointer, resolve_resume, rewind
from normlab.config import RunConfig
from normlab.data import Corpus, bits_per_byte, eval_batches, load_corpus, model_vocab_size, sample_batch, target_bytes
from normlab.nn.flops import model_flops_per_token, peak_flops
from normlab.nn.model import GPT
from normlab.train import preempt
from normlab.train.preempt import Preempted
from normlab.train.sinks import RunDir, Sink, SinkContext, finish_all, open_sinks
from normlab.train.state import TrainState
from normlab.train.probe import Probe


def run_name(cfg: RunConfig) -> str:
    """A readable run name, e.g. 'rms-pre-d6-lr1e-3-s0' or 'layer_nobias-mix0.25-qk-d4-lr1e-3-s0'."""
    return cfg.run_name


def lr_at(step: int, cfg: RunConfig) -> float:
    """The learning rate of the update taken at step `step` (0-based; the run takes steps 0 … max_steps − 1).

    Warmup: lr·(step + 1)/W for step < W = optim.warmup_steps, so step W − 1 already takes the peak lr.
    Then cosine decay over the N − W steps from W to N = max_steps: with progress p = (step − W)/(N − W),
    floor + (lr − floor)·(1 + cos(πp))/2, floor = optim.min_lr_ratio·lr. Convention: p = 1, the floor
    itself, falls on step N, where no update is taken; the last update (step N − 1) is taken at
    floor + (lr − floor)·(1 − cos(π/(N − W)))/2 ≈ floor + (lr − floor)·π²/(4(N − W)²), just above it.
    """
    warmup = cfg.optim.warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    floor = cfg.lr * cfg.optim.min_lr_ratio
    progress = min(1.0, (step - warmup) / max(1, cfg.max_steps - warmup))
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def batch_loader(tokens: torch.Tensor, cfg: RunConfig, generator: torch.Generator, device: torch.device):
    """A function returning the next training batch, drawn from `generator`, this rank's share, on `device`.

    On CUDA the batch goes through pinned host memory with a non-blocking copy, so the copy overlaps
    whatever the GPU is still running. Draws happen only when called: the generator's state is
    always the one after the batches handed out so far.
    """
    pin = device.type == "cuda"

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = sample_batch(tokens, cfg.batch_size, cfg.seq_len, generator)
        x, y = distributed.rank_share(x, y, cfg.grad_accum)
        if pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    return next_batch


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto`: bf16 on a CUDA device that supports it, else fp16 on CUDA, fp32 on the CPU."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def configure_matmul(device: torch.device, tf32: bool) -> None:
    """On CUDA, let float32 matmuls and convolutions use TF32 tensor cores when `tf32` (Ampere and later).
    Changes nothing on the CPU, where float32 stays IEEE float32."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


# The values of CUBLAS_WORKSPACE_CONFIG under which cuBLAS is deterministic (CUDA's documentation).
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def configure_determinism(deterministic: bool) -> None:
    """With `deterministic`, torch runs deterministic kernels only (an op that has none raises) and cuBLAS
    a fixed workspace, so a run on a GPU repeats its numbers, and a killed and resumed run the rows of an
    uninterrupted one. Without, torch's fastest kernels. Process-wide, and set for every run, so a
    sweep's next job undoes it. cuBLAS reads its workspace setting at its first call in the process:
    this runs before the run's first matmul, and a deterministic run sets it where it is unset.
    On the CPU, normlab's ops are deterministic either way."""
    if deterministic and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(deterministic)


def compile_model(net: nn.Module, mode: str):
    """`net` compiled with torch.compile's `mode` (config key compile_mode). Under reduce-overhead torch
    captures the compiled forward and backward in CUDA graphs (on CUDA; elsewhere it compiles alone):
    every call then starts a new graph step, since the loop reads a call's outputs before the next call
    and keeps none of them longer."""
    fast = torch.compile(net, mode=None if mode == "default" else mode)
    if mode != "reduce-overhead":
        return fast

    def graphed(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return fast(*args)

    return graphed


def compile_steps(cfg: RunConfig, device: torch.device) -> int:
    """How many of the first compiled steps are compilation (and, under CUDA graphs, warm-up and capture)."""
    if not cfg.compile:
        return 0
    return 2 if cfg.compile_mode == "reduce-overhead" and device.type == "cuda" else 1


# glibc's mallopt parameters (malloc.h) and the values normlab sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD = 2**30


def configure_host_allocator() -> bool:
    """Let glibc's malloc keep freed host memory for reuse instead of giving it back to the OS.

    With glibc's defaults, a CPU step's activations of a few MiB are mapped and unmapped again and
    again, so a step touches thousands of fresh pages (2,400-4,000 page faults per step for the
    default model in scripts/bench.py, varying from process to process), and zeroing them costs a
    few percent of the step. With blocks of up to 32 MiB served from the heap and up to 1 GiB of free heap kept,
    steps stop faulting. Numerics are unchanged; the process's memory stays at its peak instead of
    shrinking between steps. Process-wide; a no-op (returning False) without glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[precision])


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrix weights of linear layers only; never on norm gains, biases or embeddings."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue  # the tied head shares the embedding's weight
            seen.add(id(p))
            (decay if isinstance(module, nn.Linear) and p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats, computed in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def accumulate_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    grad_accum: int,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    precision: str,
) -> torch.Tensor:
    """Forward and backward the batch as `grad_accum` equal micro-batches; return the batch's mean loss.

    Each micro-batch loss is scaled by 1/grad_accum, so the accumulated gradient is
    the full-batch gradient (times the GradScaler's scale under fp16). Under DDP the
    gradients are all-reduced on the last micro-batch only: the others run, forward
    and backward, inside `no_sync`.
    """
    total = torch.zeros((), device=device)
    for i, (xm, ym) in enumerate(zip(x.chunk(grad_accum), y.chunk(grad_accum))):
        with distributed.grad_sync(model, last=i == grad_accum - 1):
            with autocast(device, precision):
                loss = loss_fn(model(xm), ym)
            scaler.scale(loss / grad_accum).backward()
        total += loss.detach()
    return total / grad_accum


@torch.no_grad()
def evaluate(model: nn.Module, batches, device: torch.device, precision: str) -> float:
    """Mean loss over fixed held-out batches, in eval mode (BatchNorm uses running statistics: causal).

    Under DDP every rank evaluates its share of the batches with rank 0's running statistics,
    and the losses are summed over ranks: every rank returns the mean over all the batches.
    """
    was_training = model.training
    model.eval()
    distributed.broadcast_buffers(model)
    total = torch.zeros((), device=device)
    for x, y in batches[distributed.rank() :: distributed.world_size()]:
        with autocast(device, precision):
            total += loss_fn(model(x.to(device)), y.to(device))
    model.train(was_training)
    return (distributed.total(total) / len(batches)).item()


def train(
    cfg: RunConfig, run_dir: str | RunDir, sinks: list[Sink] | None = None, callbacks: Sequence[Callback] = ()
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
    """
    run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    writes = distributed.is_main()
    with run_dir.lock() if writes else contextlib.nullcontext(), preempt.starting():
        return _train_in(cfg, run_dir, sinks, callbacks, writes)


def summary_head(cfg: RunConfig) -> dict[str, Any]:
    """The first fields of every summary.json: what the run is, and status `running`."""
    return {
        "name": run_name(cfg),
        "norm": cfg.norm.label,
        "placement": cfg.placement,
        "qk_norm": cfg.qk_norm,
        "depth": cfg.depth,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "group": cfg.wandb.group,
        "status": "running",
    }


def _train_in(cfg: RunConfig, run_dir: RunDir, sinks: list[Sink] | None, callbacks: Sequence[Callback],
              writes: bool) -> dict[str, Any]:
    """train() inside the run dir's lock: refuse, or change the run dir, train, and record how it ended."""
    started = time.time()
    resumed = resolve_resume(cfg, run_dir.path)
    summary = summary_head(cfg)
    opened: list[Sink] = []
    exit_code = 1
    try:
        corpus = load_corpus(cfg.data, cfg.tokenizer)
        summary.update(corpus=corpus.source, corpus_bytes=corpus.n_bytes, corpus_sha256=corpus.sha256,
                       tokenizer=corpus.tokenizer.identity)
        if resumed is not None:
            resumed.check_corpus(corpus.sha256)
            check_resumable(cfg, resumed, callbacks)
        wandb_run_id = (resumed.wandb_run_id if resumed else None) or secrets.token_hex(4)
        checkpointer = Checkpointer(run_dir.path, cfg, wandb_run_id=wandb_run_id, corpus_sha256=corpus.sha256,
                                    world_size=distributed.world_size(), writes=writes)
        if writes:
            with preempt.deferred():  # from here the run dir changes: no signal leaves it halfway
                run_dir.reserve()
                run_dir.write_config(cfg.to_dict())
                if corpus.tokenizer.kind != "byte":
                    corpus.tokenizer.save(run_dir.path / "tokenizer.json")  # `normlab sample` decodes with it
                start_step = resumed.step if resumed else None
                history = rewind(run_dir.path, start_step or 0)
                context = SinkContext(cfg, run_dir, summary["name"], wandb_run_id, start_step, history)
                if sinks is None:
                    open_sinks(context, into=opened)
                else:
                    opened.extend(sinks)
        summary.update(_fit(cfg, corpus, opened, checkpointer, resumed, callbacks))
        exit_code = 0  # a diverged run is an outcome, not a failure
    except Preempted as stop:
        if stop.step is None:  # stopped before the first step: the run is where it started
            stop.step = resumed.step if resumed else 0
        summary.update(status=stop.status, preempted_step=stop.step)
        exit_code = 128 + stop.signum
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
        summary["wall_time_s"] = round(time.time() - started, 3)
        trouble = _record_end(run_dir if writes else None, summary, opened, exit_code)
    if trouble is not None:
        raise trouble  # training went well, but its records could not all be written
    return summary


def _record_end(run_dir: RunDir | None, summary: dict[str, Any], sinks: list[Sink], exit_code: int) -> BaseException | None:
    """Write summary.json (into `run_dir`, when given) and finish every sink, whatever fails on the way;
    return the first failure, or None."""
    trouble: BaseException | None = None
    if run_dir is not None:
        try:
            run_dir.write_summary(summary)
        except Exception as err:
            trouble = err
    return trouble or finish_all(sinks, summary, exit_code)


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


@dataclass(frozen=True)
class HeldOut:
    """The fixed evaluation windows, and how many UTF-8 bytes their target tokens stand for."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    n_tokens: int
    n_bytes: int

    def bits_per_byte(self, mean_nats_per_token: float) -> float:
        """A val loss in nats per token as bits per byte of the same text: comparable across tokenizers."""
        return bits_per_byte(mean_nats_per_token, self.n_tokens, self.n_bytes)


def held_out_batches(corpus: Corpus, cfg: RunConfig) -> HeldOut:
    """The fixed evaluation windows (they depend on batch_size alone), cut into micro-batches to bound memory."""
    batches = [
        (xm, ym)
        for x, y in eval_batches(corpus.val, cfg.eval_batches, cfg.batch_size, cfg.seq_len)
        for xm, ym in zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum))
    ]
    return HeldOut(batches, *target_bytes(batches, corpus.token_bytes))


def standard_callbacks(cfg: RunConfig, state: TrainState, sinks: list[Sink], checkpointer: Checkpointer,
                       device: torch.device, extra: Sequence[Callback] = ()) -> list[Callback]:
    """The loop's callbacks in hook order, `extra` ones before checkpointing (which saves them all).

    The guard comes first (it stops a diverged step before anything measures it), then telemetry, then
    the clock (whose step time so includes telemetry's cost), then what reads the finished record.
    """
    callbacks: list[Callback] = [
        DivergenceGuard(cfg.diverge_factor, device),
        BatchNormSteps(state.model, cfg),  # before telemetry, which reads the step's running statistics
        Telemetry(Probe(state.model, cfg.telemetry.every, cfg.max_steps)),
        ThroughputClock(cfg.batch_size * cfg.seq_len, compile_steps(cfg, device), model_flops_per_token(cfg),
                        peak_flops(device, resolve_precision(cfg.precision, device), cfg.tf32), device),
        TelemetryProducts(sinks),
    ]
    if distributed.is_main():
        callbacks.append(RunReport(run_name(cfg), resolve_precision(cfg.precision, device), str(checkpointer.run_dir)))
        if cfg.progress:
            callbacks.append(progress(cfg.max_steps, run_name(cfg)))
    callbacks += extra
    callbacks.append(Checkpointing(checkpointer, callbacks, cfg.max_steps))
    return callbacks


def _fit(cfg: RunConfig, corpus: Corpus, sinks: list[Sink], checkpointer: Checkpointer, resumed: Checkpoint | None,
         extra: Sequence[Callback]) -> dict[str, Any]:
    """Build everything, restore a checkpoint if resuming, run the steps; return the run's results."""
    cfg = with_model_vocab(cfg, corpus)
    device = distributed.local_device(resolve_device(cfg.device))
    precision = resolve_precision(cfg.precision, device)
    seed_everything(cfg.seed)
    configure_matmul(device, cfg.tf32)
    configure_determinism(cfg.deterministic)
    configure_host_allocator()
    state = build_state(cfg, device, precision)
    net = distributed.wrap(state.model, device, sync_batchnorm=cfg.norm.sync)  # the model itself for one process
    # Watched steps and evaluation run eager `net`/`model`; checkpoints hold `model`, so no `_orig_mod.` keys.
    fast = compile_model(net, cfg.compile_mode) if cfg.compile else net
    callbacks = standard_callbacks(cfg, state, sinks, checkpointer, device, extra)
    if resumed is not None:
        resumed.restore(state, callbacks)
    for callback in callbacks:
        callback.on_train_start(state)
    next_batch = batch_loader(corpus.train, cfg, state.data_gen, device)
    held_out = held_out_batches(corpus, cfg)
    diverged_step = run_steps(cfg, state, (net, fast), next_batch, held_out, callbacks, sinks, precision)

    result: dict[str, Any] = {"status": "completed"}
    if resumed is not None:
        result["resumed_from_step"] = resumed.step
    if diverged_step is not None:
        _emit(sinks, {"step": diverged_step, "tokens": diverged_step * cfg.batch_size * cfg.seq_len, "status": "diverged"})
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
    for callback in callbacks:
        callback.on_train_end(state, result)
    return result


def run_steps(cfg: RunConfig, state: TrainState, models: tuple[nn.Module, nn.Module], next_batch, held_out: HeldOut,
              callbacks: Sequence[Callback], sinks: Sequence[Sink], precision: str) -> int | None:
    """Train from `state.step` to cfg.max_steps, evaluating and logging on the way; return the step at
    which the run diverged, or None.

    `models`: the eager model (DDP-wrapped under torchrun) and the one to run on steps no callback
    watches (compiled under compile=true). Record `step` s holds what was measured at the weights after
    s updates: the training loss and gradient of batch s, and val_loss when evaluated; the last record
    (step max_steps) holds the final evaluation alone.
    """
    eager, fast = models
    device = next(state.model.parameters()).device
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    state.model.train()
    try:
        for step in range(state.step, cfg.max_steps + 1):
            record: dict[str, Any] = {"step": step, "tokens": state.tokens}
            if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.max_steps:
                record["val_loss"] = _evaluate_into(state, held_out.batches, precision)
                record["val_bpb"] = held_out.bits_per_byte(record["val_loss"])
            if step == cfg.max_steps:
                _emit(sinks, record)
                break

            state.lr, state.watched = lr_at(step, cfg), False
            _call(callbacks, "on_step_start", state)
            x, y = next_batch()
            for group in state.optimizer.param_groups:
                group["lr"] = state.lr
            model = eager if state.watched else fast
            state.loss = distributed.mean(accumulate_gradients(model, x, y, cfg.grad_accum, state.scaler, device, precision))
            state.scaler.unscale_(state.optimizer)
            _call(callbacks, "after_backward", state)
            state.grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), max_norm)
            _call(callbacks, "before_optimizer_step", state)
            state.scaler.step(state.optimizer)
            state.scaler.update()
            state.optimizer.zero_grad(set_to_none=True)
            state.step, state.tokens = step + 1, state.tokens + cfg.batch_size * cfg.seq_len

            logged = step % cfg.log_every == 0 or step == cfg.max_steps - 1 or "val_loss" in record or state.watched
            if logged:  # the step's host syncs; other steps keep their figures on the device
                record.update(loss=state.loss.item(), lr=state.lr, grad_norm=state.grad_norm.item())
            _call(callbacks, "after_optimizer_step", state, record if logged else None)
            if logged:
                _emit(sinks, record)
            _call(callbacks, "on_step_end", state, record if logged else None)
    except Diverged as stop:
        return stop.step
    return None


def _evaluate_into(state: TrainState, val_batches, precision: str) -> float:
    """Evaluate the eager model, keep the last and best val loss and the evaluation time in `state`;
    raise Diverged if the loss is not finite."""
    started = time.perf_counter()
    state.last_val = evaluate(state.model, val_batches, next(state.model.parameters()).device, precision)
    state.eval_time += time.perf_counter() - started
    if not math.isfinite(state.last_val):
        raise Diverged(state.step)
    state.best_val = min(state.best_val, state.last_val)
    return state.last_val


def _call(callbacks: Sequence[Callback], hook: str, *args) -> None:
    for callback in callbacks:
        getattr(callback, hook)(*args)


def _emit(sinks: Sequence[Sink], record: dict[str, Any]) -> None:
    for sink in sinks:
        sink.log(record)
