"""The training loop: `train(cfg, run_dir)` trains one model and returns its summary.

Knows nothing of Hydra. It reads a validated RunConfig, builds data and model,
runs AdamW with warmup + cosine decay, evaluates on fixed held-out batches,
measures per-layer telemetry on its steps (normlab.telemetry), and hands every
record to the sinks (metrics.jsonl, wandb).

Step convention: record `step` s holds what was measured at the weights after s
updates: the training loss and gradient of batch s, and val_loss when evaluated.
So step 0 is initialization, and the final evaluation is logged at step max_steps.
Telemetry steps (0, every telemetry.every steps, max_steps - 1) are always logged steps.

Speed: with `compile=true` the other training steps run a torch.compile'd module, while
telemetry steps and evaluation run the eager one (hooks attach to eager modules). The host
reads device values (`.item()`) on logged steps only, the next batch is drawn, pinned and
copied (non-blocking) once the current step is queued and checkpointed, and under DDP the
ranks agree on a preemption request every PREEMPT_CHECK_EVERY steps, not with a collective per step.
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
import signal
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import distributed
from .checkpoint import Checkpoint, CheckpointError, Checkpointer, GeneratorState, resolve_resume, rewind
from .config import RunConfig
from .data import Corpus, eval_batches, load_corpus, sample_batch
from .model import GPT
from .preempt import Preempted, requested
from .sinks import MetricsFile, RunDir, Sink, WandbSink
from .telemetry import Probe


def run_name(cfg: RunConfig) -> str:
    """A readable run name, e.g. 'rms-pre-d6-lr1e-3-s0' or 'layer_nobias-mix0.25-qk-d4-lr1e-3-s0'."""
    return cfg.run_name


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup to cfg.lr over optim.warmup_steps, then cosine decay to min_lr_ratio·lr at max_steps."""
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

# Under DDP, asking every rank whether any was signalled is a collective (a host sync): ask every
# this many steps, at checkpoint steps and at the last step. A preempted DDP run so stops up to this
# many steps after the signal: keep the scheduler's warning time above that many step times.
PREEMPT_CHECK_EVERY = 10


def configure_matmul(device: torch.device, tf32: bool) -> None:
    """On CUDA, let float32 matmuls and convolutions use TF32 tensor cores when `tf32` (Ampere and later).
    Changes nothing on the CPU, where float32 stays IEEE float32."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


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


def build_sinks(cfg: RunConfig, run_dir: RunDir, name: str, wandb_run_id: str | None = None,
                history: list[dict[str, Any]] | None = None) -> list[Sink]:
    """metrics.jsonl and wandb. `history`: the records a resumed run already holds (None: a fresh run)."""
    sinks: list[Sink] = [MetricsFile(run_dir)]
    if cfg.wandb.mode != "disabled":
        tags = [f"norm={cfg.norm.label}", f"placement={cfg.placement}", f"qk_norm={str(cfg.qk_norm).lower()}"]
        sinks.append(WandbSink(cfg.wandb, run_dir, name, cfg.to_dict(), tags, run_id=wandb_run_id, history=history))
    return sinks


def train(cfg: RunConfig, run_dir: str | RunDir, sinks: list[Sink] | None = None) -> dict[str, Any]:
    """Train one model as `cfg` says; write metrics.jsonl and summary.json into `run_dir`; return the summary.

    The sinks are always finished, with a non-zero exit code if training raised. `cfg.resume`
    decides where training starts (see checkpoint.resolve_resume); a checkpoint that does not
    fit raises CheckpointError and leaves `run_dir` untouched. A preemption signal (preempt.py)
    raises Preempted after the checkpoint is saved. Under torchrun only rank 0 writes files.
    Given `sinks` are used as they are: pass them for a fresh run only, since a resumed run
    rewinds metrics.jsonl before it opens its own.
    """
    run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    name = run_name(cfg)
    started = time.time()
    writes = distributed.is_main()
    resumed = resolve_resume(cfg, run_dir.path)
    summary: dict[str, Any] = {
        "name": name,
        "norm": cfg.norm.label,
        "placement": cfg.placement,
        "qk_norm": cfg.qk_norm,
        "depth": cfg.depth,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "group": cfg.wandb.group,
        "status": "running",
    }
    built_sinks: list[Sink] = []
    exit_code = 1
    try:
        corpus = load_corpus(cfg.data)
        summary.update(corpus=corpus.source, corpus_bytes=corpus.n_bytes, corpus_sha256=corpus.sha256)
        if resumed is not None:
            resumed.check_corpus(corpus.sha256)
        wandb_run_id = (resumed.wandb_run_id if resumed else None) or secrets.token_hex(4)
        checkpointer = Checkpointer(run_dir.path, cfg, wandb_run_id=wandb_run_id, corpus_sha256=corpus.sha256,
                                    world_size=distributed.world_size(), writes=writes)
        if writes:
            history = rewind(run_dir.path, resumed.step if resumed else 0)
            if sinks is None:
                built_sinks = build_sinks(cfg, run_dir, name, wandb_run_id, history if resumed else None)
            else:
                built_sinks = sinks
        summary.update(_fit(cfg, corpus, built_sinks, checkpointer, resumed))
        exit_code = 0  # a diverged run is an outcome, not a failure
    except Preempted as stop:
        summary.update(status="preempted", preempted_step=stop.step)
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
        summary["wall_time_s"] = round(time.time() - started, 3)
        if writes and not built_sinks:
            run_dir.write_summary(summary)
        for sink in built_sinks:
            sink.finish(summary, exit_code)
    return summary


class DivergenceGuard:
    """Remembers, on the device, the first step whose training loss is non-finite or above
    `factor` × the initial loss (factor 0: only non-finite counts). The host reads it on logged steps only."""

    def __init__(self, factor: float, device: torch.device):
        self.factor = factor
        self.limit: torch.Tensor | None = None
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)

    def observe(self, step: int, loss: torch.Tensor) -> None:
        if self.limit is None:
            self.limit = loss * self.factor if self.factor > 0 else torch.full_like(loss, math.inf)
        bad = ~torch.isfinite(loss) | (loss > self.limit)
        self.first_bad = torch.where(bad & (self.first_bad < 0), step, self.first_bad)

    def diverged_at(self) -> int | None:
        step = int(self.first_bad.item())
        return None if step < 0 else step

    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "limit": self.limit, "first_bad": self.first_bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.first_bad.device
        self.limit = None if state["limit"] is None else state["limit"].to(device)
        self.first_bad = state["first_bad"].to(device)


def _fit(
    cfg: RunConfig, corpus: Corpus, sinks: list[Sink], checkpointer: Checkpointer, resumed: Checkpoint | None
) -> dict[str, Any]:
    device = distributed.local_device(resolve_device(cfg.device))
    precision = resolve_precision(cfg.precision, device)
    seed_everything(cfg.seed)
    configure_matmul(device, cfg.tf32)
    configure_host_allocator()
    model = GPT(cfg).to(device)
    net = distributed.wrap(model, device, sync_batchnorm=cfg.norm.sync)  # `model` itself for one process
    # Telemetry steps and evaluation run eager `net`/`model`; checkpoints hold `model`, so no `_orig_mod.` keys.
    fast = torch.compile(net) if cfg.compile else net
    compile_time: float | None = None
    eval_time = 0.0  # what the evaluations cost beside the steps (summary.json's eval_time_s)
    # Data order depends on the seed alone, never on the model: every arm of a sweep sees the same batches.
    data_gen = torch.Generator().manual_seed(cfg.seed)
    # The held-out windows depend on batch_size alone; evaluating them in micro-batches bounds memory.
    val_batches = [
        (xm, ym)
        for x, y in eval_batches(corpus.val, cfg.eval_batches, cfg.batch_size, cfg.seq_len)
        for xm, ym in zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum))
    ]
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay),
        lr=cfg.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        fused=device.type == "cuda",
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    probe = Probe(model, cfg.telemetry.every, cfg.max_steps)
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    tokens_per_step = cfg.batch_size * cfg.seq_len

    guard = DivergenceGuard(cfg.diverge_factor, device)
    diverged_step: int | None = None
    best_val, last_val = math.inf, math.nan
    tokens, train_time = 0, 0.0
    window_tokens, window_time = 0, 0.0

    # Everything a checkpoint saves and restores: any object with state_dict() and load_state_dict().
    components = {
        "model": model,
        "optimizer": optimizer,
        "scaler": scaler,
        "data_sampler": GeneratorState(data_gen),
        "divergence_guard": guard,
        "telemetry": probe,
    }

    def loop_counters() -> dict[str, Any]:
        return dict(tokens=tokens, best_val=best_val, last_val=last_val, train_time=train_time,
                    window_tokens=window_tokens, window_time=window_time, eval_time=eval_time)

    start_step = 0
    if resumed is not None:
        counters = resumed.restore(components)
        start_step = resumed.step
        tokens, best_val, last_val = counters["tokens"], counters["best_val"], counters["last_val"]
        train_time, window_tokens, window_time = counters["train_time"], counters["window_tokens"], counters["window_time"]
        eval_time = counters.get("eval_time", 0.0)  # absent from checkpoints written before it was counted

    bar = _progress(cfg, start_step) if distributed.is_main() else None
    next_batch = batch_loader(corpus.train, cfg, data_gen, device)
    batch = next_batch() if start_step < cfg.max_steps else None
    model.train()
    for step in range(start_step, cfg.max_steps + 1):
        record: dict[str, Any] = {"step": step, "tokens": tokens}
        if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.max_steps:
            t_eval = time.perf_counter()
            last_val = evaluate(model, val_batches, device, precision)
            eval_time += time.perf_counter() - t_eval
            if not math.isfinite(last_val):
                diverged_step = step
                break
            best_val = min(best_val, last_val)
            record["val_loss"] = last_val
        if step == cfg.max_steps:
            _emit(sinks, record)
            break

        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batch
        # Hooks exist only inside this block on telemetry steps, on the eager modules; other steps run
        # the bare (or compiled) model.
        watching = probe.active(step)
        first_compiled = cfg.compile and compile_time is None and not watching
        with probe.watch() if watching else contextlib.nullcontext():
            loss = distributed.mean(
                accumulate_gradients(net if watching else fast, x, y, cfg.grad_accum, scaler, device, precision)
            )
        guard.observe(step, loss)
        scaler.unscale_(optimizer)
        if watching:
            probe.measure_gradients(scaler)  # the accumulated, un-scaled gradient, before clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if watching:
            probe.before_update()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        tokens += tokens_per_step

        logged = step % cfg.log_every == 0 or step == cfg.max_steps - 1 or "val_loss" in record or watching
        if logged:
            diverged_step = guard.diverged_at()
            if diverged_step is not None:
                break
            loss_value = loss.item()
        telemetry = probe.collect(step) if watching else {}  # telemetry's one host transfer
        elapsed = time.perf_counter() - t0
        if first_compiled:
            compile_time = elapsed
        train_time += elapsed
        window_time += elapsed
        window_tokens += tokens_per_step
        if logged:
            record.update(
                loss=loss_value,
                lr=lr,
                grad_norm=grad_norm.item(),
                tokens_per_s=window_tokens / window_time,
            )
            record.update(telemetry)
            window_tokens, window_time = 0, 0.0
            _emit(sinks, record)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        if bar is not None:
            bar.update(1)

        # A step boundary: step + 1 updates are done and every record up to `step` is emitted.
        due = checkpointer.due(step + 1)
        stop = requested() is not None
        if distributed.is_active():
            # A collective: all ranks ask at the same steps, so all stop at the same step.
            asks = due or (step + 1) % PREEMPT_CHECK_EVERY == 0 or step + 1 == cfg.max_steps
            stop = asks and distributed.any_rank(stop)
        if stop or due:
            checkpointer.save(step + 1, components, loop_counters())
        if stop:
            distributed.barrier()  # no rank exits before rank 0's checkpoint is on disk
            raise Preempted(requested() or signal.SIGTERM, step + 1)
        if step + 1 < cfg.max_steps:
            # Drawn after the checkpoint, whose generator state is so the one before this batch.
            t_fetch = time.perf_counter()
            batch = next_batch()
            fetch_time = time.perf_counter() - t_fetch
            train_time += fetch_time
            window_time += fetch_time
    if bar is not None:
        bar.close()
    if diverged_step is None:
        checkpointer.save(cfg.max_steps, components, loop_counters())
    result: dict[str, Any] = {"status": "completed"}
    if resumed is not None:
        result["resumed_from_step"] = resumed.step
    if diverged_step is not None:
        _emit(sinks, {"step": diverged_step, "tokens": diverged_step * tokens_per_step, "status": "diverged"})
        result.update(status="diverged", diverged_step=diverged_step)
        last_val = math.nan
    elif probe.history:
        _emit_telemetry_products(sinks, probe)
    return {
        **result,
        "final_val_loss": last_val,
        "best_val_loss": best_val,
        "steps": cfg.max_steps if diverged_step is None else diverged_step,
        "tokens": tokens,
        "tokens_per_s": tokens / train_time if train_time > 0 else 0.0,
        "n_params": sum(p.numel() for p in model.parameters()),
        "device": device.type,
        "precision": precision,
        "eval_time_s": round(eval_time, 3),
        **({"compile_time_s": round(compile_time, 3)} if compile_time is not None else {}),
    }


def _emit(sinks: list[Sink], record: dict[str, Any]) -> None:
    for sink in sinks:
        sink.log(record)


def _emit_telemetry_products(sinks: list[Sink], probe: Probe) -> None:
    """The end-of-run per-layer table and layer × step heatmaps of residual RMS and gradient norm."""
    columns, rows = probe.layer_table()
    images = {
        "telemetry/resid_rms": probe.heatmap("act/resid_rms", "RMS of the residual stream after each block"),
        "telemetry/grad_norm": probe.heatmap("grad/norm", "L2 norm of each block's parameter gradient"),
    }
    for sink in sinks:
        sink.log_table("telemetry/layers", columns, rows)
        for name, png in images.items():
            sink.log_image(name, png)


def _progress(cfg: RunConfig, start_step: int = 0):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.max_steps, initial=start_step, desc=run_name(cfg), unit="step", dynamic_ncols=True)
