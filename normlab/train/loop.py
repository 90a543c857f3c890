"""The training steps: `run_steps` (it reads top to bottom), the loss and gradient accumulation, evaluation on
the fixed held-out batches, the training batches, and the calls into callbacks and sinks.

Step convention: record `step` s holds what was measured at the weights after s
updates: the training loss and gradient of batch s, and val_loss when evaluated.
So step 0 is initialization, and the final evaluation is logged at step max_steps.
Telemetry steps (0, every telemetry.every steps, max_steps - 1) are always logged steps.

Speed: with `compile=true` the training steps run a torch.compile'd module (telemetry steps run the
Probe's forward, compiled too), while evaluation runs the eager one;
`compile_mode=reduce-overhead` also captures the compiled steps in CUDA graphs (runtime.compile_model). The
host reads device values (`.item()`) on logged steps only, and each batch is drawn, pinned and copied
(non-blocking) while the previous step may still run on the device. A telemetry step's statistics are copied to
the host without blocking it too, and its row is written during the next step (normlab.train.rows).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import normlab.train.distributed as distributed
from normlab.config import RunConfig
from normlab.data import Corpus, bits_per_byte, eval_batches, sample_batch, target_bytes
from normlab.train.callbacks import Callback, Diverged
from normlab.train.optim import lr_at
from normlab.train.rows import Rows
from normlab.train.runtime import autocast, hold_gradients
from normlab.train.sinks import Sink
from normlab.train.state import TrainState

# Phases (normlab.train.phases) timed inside the training loop that are not its steps.
SET_ASIDE = ("eval", "checkpoint")


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
    n_tokens, n_bytes = target_bytes(batches, corpus.token_bytes)
    # the corpus's own bytes where a U+FFFD stands for bytes that are not UTF-8 (data.not_utf8=replace)
    n_bytes += corpus.held_out_correction(cfg.eval_batches, cfg.batch_size, cfg.seq_len)
    return HeldOut(batches, n_tokens, n_bytes)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats, computed in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def z_loss_term(logits: torch.Tensor, coefficient: float) -> torch.Tensor:
    """The z-loss, coefficient · mean over tokens of (log Z)², Z = Σ exp(logits) the softmax's partition
    function (PaLM, Chowdhery et al. 2022; Wortsman et al. 2023), in float32."""
    return coefficient * torch.logsumexp(logits.float(), dim=-1).square().mean()


def accumulate_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    grad_accum: int,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    precision: str,
    z_loss: float = 0.0,
    terms: dict[str, torch.Tensor] | None = None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Forward and backward the batch as `grad_accum` equal micro-batches; return the batch's mean loss
    (the cross-entropy).

    Each micro-batch loss is scaled by 1/grad_accum, so the accumulated gradient is
    the full-batch gradient (times the GradScaler's scale under fp16). Under DDP the
    gradients are all-reduced on the last micro-batch only: the others run, forward
    and backward, inside `no_sync`. With `z_loss` > 0 the objective adds z_loss_term, and its batch
    mean goes into `terms['z_loss']`. `forward` (telemetry's) runs the micro-batches in place of `model`.
    """
    total = torch.zeros((), device=device)
    z_total = torch.zeros((), device=device)
    for i, (xm, ym) in enumerate(zip(x.chunk(grad_accum), y.chunk(grad_accum))):
        with distributed.grad_sync(model, last=i == grad_accum - 1):
            with autocast(device, precision):
                logits = (forward or model)(xm)
                loss = loss_fn(logits, ym)
                z = z_loss_term(logits, z_loss) if z_loss else None
            scaler.scale((loss if z is None else loss + z) / grad_accum).backward()
        total += loss.detach()
        if z is not None:
            z_total += z.detach()
    if terms is not None and z_loss:
        terms["z_loss"] = z_total / grad_accum
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


def run_steps(cfg: RunConfig, state: TrainState, models: tuple[nn.Module, nn.Module], next_batch, held_out: HeldOut,
              callbacks: Sequence[Callback], sinks: Sequence[Sink], precision: str) -> int | None:
    """Train from `state.step` to cfg.max_steps, evaluating and logging on the way; return the step at
    which the run diverged, or None.

    `models`: the eager model (DDP-wrapped under torchrun) and the one to run on steps no callback
    watches (compiled under compile=true). Record `step` s holds what was measured at the weights after
    s updates: the training loss and gradient of batch s, and val_loss when evaluated; the last record
    (step max_steps) holds the final evaluation alone. Records go to the sinks through `state.rows`
    (normlab.train.rows): a telemetry step's row once its statistics have reached the host, during the next step.
    """
    eager, fast = models
    device = next(state.model.parameters()).device
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    keep_grads = hold_gradients(cfg, state.model, device)  # zeroed, not freed, after each step
    state.model.train()
    rows = state.rows = Rows(sinks)
    first, started, aside = state.step, time.perf_counter(), state.phases.total(SET_ASIDE)
    try:
        for step in range(state.step, cfg.max_steps + 1):
            if step == first + 1:  # the first step compiled and warmed up what the later ones reuse
                state.phases.add("compile", time.perf_counter() - started - (state.phases.total(SET_ASIDE) - aside))
            record: dict[str, Any] = {"step": step, "tokens": state.tokens}
            if (cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.max_steps:
                record["val_loss"] = _evaluate_into(state, held_out.batches, precision)
                record["val_bpb"] = held_out.bits_per_byte(record["val_loss"])
            if step == cfg.max_steps:
                rows.write(record)
                break

            state.lr, state.watched, state.forward = lr_at(step, cfg), False, None
            _call(callbacks, "on_step_start", state)
            x, y = next_batch()
            for group in state.optimizer.param_groups:
                group["lr"] = state.lr
            model, terms = (eager if state.watched else fast), {}
            state.loss = distributed.mean(accumulate_gradients(model, x, y, cfg.grad_accum, state.scaler, device, precision,
                                                               cfg.z_loss, terms, state.forward))
            _update(state, callbacks, max_norm, keep_grads)
            state.step, state.tokens = step + 1, state.tokens + cfg.batch_size * cfg.seq_len
            rows.flush(wait=False)  # a telemetry step's row before this one, read while the device runs this step

            logged = step % cfg.log_every == 0 or step == cfg.max_steps - 1 or "val_loss" in record or state.watched
            if logged:  # the step's host syncs; other steps keep their figures on the device
                record.update(loss=state.loss.item(), lr=state.lr, grad_norm=state.grad_norm.item())
                record.update({key: distributed.mean(term).item() for key, term in terms.items()})
            _call(callbacks, "after_optimizer_step", state, record if logged else None)
            if logged:
                rows.write(record)
            _call(callbacks, "on_step_end", state, record if logged else None)
    except Diverged as stop:
        rows.close()  # the rows so far, complete, before the run says how it stopped
        return stop.step
    except BaseException:
        rows.close()
        _call(callbacks, "on_train_stop", state)  # a signal's stop or an error: the progress bar closes before its line
        raise
    finally:
        state.rows = None
    return None


def _update(state: TrainState, callbacks: Sequence[Callback], max_norm: float, keep_grads: bool) -> None:
    """The step's update from its accumulated gradient: un-scaled (fp16), clipped to `max_norm` (the norm before
    clipping kept as state.grad_norm), the optimizer's step, and the gradients zeroed (kept allocated with
    `keep_grads`), with the callbacks' hooks on the way."""
    state.scaler.unscale_(state.optimizer)
    _call(callbacks, "after_backward", state)
    state.grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), max_norm)
    _call(callbacks, "before_optimizer_step", state)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=not keep_grads)


def _evaluate_into(state: TrainState, val_batches, precision: str) -> float:
    """Evaluate the eager model, keep the last and best val loss and the evaluation time in `state`;
    raise Diverged if the loss is not finite."""
    started = time.perf_counter()
    state.last_val = evaluate(state.model, val_batches, next(state.model.parameters()).device, precision)
    seconds = time.perf_counter() - started
    state.eval_time += seconds
    state.phases.add("eval", seconds)
    if not math.isfinite(state.last_val):
        raise Diverged(state.step)
    state.best_val = min(state.best_val, state.last_val)
    return state.last_val


def _call(callbacks: Sequence[Callback], hook: str, *args) -> None:
    for callback in callbacks:
        getattr(callback, hook)(*args)


def emit(sinks: Sequence[Sink], record: dict[str, Any]) -> None:
    """Hand `record` to every sink."""
    for sink in sinks:
        sink.log(record)
