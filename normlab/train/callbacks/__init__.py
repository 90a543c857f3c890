"""Callbacks: everything the training loop does beside training, each a class with named hooks.

The loop calls the hooks in the order of a step (see normlab.train):

    on_train_start(state)                 before the first step (after a resume's restore)
    on_step_start(state)                  the step begins: `state.step` is its number
    after_backward(state)                 gradients accumulated and un-scaled, before clipping
    before_optimizer_step(state)          gradients clipped, weights not yet changed
    after_optimizer_step(state, record)   update taken (`state.step` is now s + 1): measure, add to the
                                          record (None on a step that is not logged); raise Diverged to stop
    on_step_end(state, record)            the record, as the sinks got it (None if not logged)
    on_train_end(state, summary)          the run completed or diverged: add to the summary, write products

Every hook does nothing unless a callback overrides it. A callback's `state_dict()` goes into every
checkpoint under its `name`, so a resumed run's callbacks continue as they were. A new monitor is
one class here (or anywhere), passed to train(); the loop does not change.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import time
from typing import Any, Sequence

import torch

from normlab.train import distributed
from normlab import keys
from normlab.train.checkpoint import Checkpointer
from normlab.config import ConfigError, RunConfig
from normlab.nn.norms import StepStatistics
from normlab.train.preempt import Preempted, requested, training_started
from normlab.train.sinks import Sink
from normlab.train.state import TrainState
from normlab.train.probe import Probe

log = logging.getLogger("normlab")  # Hydra's job logging writes it to the terminal and the run dir's normlab.log

# Under DDP, asking every rank whether any was signalled is a collective (a host sync): ask every
# this many steps, at checkpoint steps and at the last step. A preempted DDP run so stops up to this
# many steps after the signal: keep the scheduler's warning time above that many step times.
PREEMPT_CHECK_EVERY = 10


class Diverged(Exception):
    """Raised by a callback (or the loop) to end the run as diverged at `step`."""

    def __init__(self, step: int):
        super().__init__(f"diverged at step {step}")
        self.step = step


class Callback:
    """A part of the loop with named hooks, all no-ops here, and its own checkpointed state."""

    name = "callback"  # the key of its state in a checkpoint; unique within a run

    def on_train_start(self, state: TrainState) -> None: ...

    def on_step_start(self, state: TrainState) -> None: ...

    def after_backward(self, state: TrainState) -> None: ...

    def before_optimizer_step(self, state: TrainState) -> None: ...

    def after_optimizer_step(self, state: TrainState, record: dict[str, Any] | None) -> None: ...

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None: ...

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class DivergenceGuard(Callback):
    """Remembers, on the device, the first step whose training loss is non-finite or above
    `factor` × the initial loss (factor 0: only non-finite counts). The host reads it on logged steps only."""

    name = "divergence_guard"

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

    def after_backward(self, state: TrainState) -> None:
        self.observe(state.step, state.loss)

    def after_optimizer_step(self, state: TrainState, record: dict[str, Any] | None) -> None:
        if record is not None and (step := self.diverged_at()) is not None:
            raise Diverged(step)

    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "limit": self.limit, "first_bad": self.first_bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.first_bad.device
        self.limit = None if state["limit"] is None else state["limit"].to(device)
        self.first_bad = state["first_bad"].to(device)


class Telemetry(Callback):
    """Runs the Probe on its steps: hooks around forward and backward, gradient and weight statistics,
    and the step's statistics added to its record (one host transfer). Telemetry steps are watched:
    they run the eager model (hooks attach to eager modules) and are always logged."""

    name = "telemetry"

    def __init__(self, probe: Probe):
        self.probe = probe
        self._watching: contextlib.ExitStack | None = None
        self._active = False

    def on_step_start(self, state: TrainState) -> None:
        self._active = self.probe.active(state.step)
        if self._active:
            state.watched = True
            self._watching = contextlib.ExitStack()
            self._watching.enter_context(self.probe.watch())

    def after_backward(self, state: TrainState) -> None:
        if self._watching is not None:
            self._watching.close()  # the hooks live for the forward and backward passes only
            self._watching = None
        if self._active:
            self.probe.measure_gradients(state.scaler)  # the accumulated, un-scaled gradient, before clipping

    def before_optimizer_step(self, state: TrainState) -> None:
        if self._active:
            self.probe.before_update()

    def after_optimizer_step(self, state: TrainState, record: dict[str, Any] | None) -> None:
        if self._active:
            stats = self.probe.collect()  # telemetry's one host transfer
            if record is not None:
                record.update(stats)


class ThroughputClock(Callback):
    """Times the training steps (batch fetch to the step's figures, evaluation excluded).

    The record's tokens_per_s is over the steps since the last logged one, whatever they cost. The
    summary's tokens_per_s is the steady rate: the process's first step (lazy initialization, on CUDA
    the kernels' first launches) and the first `compile_steps` steps that run the compiled model
    (compilation; under CUDA graphs also the graphs' warm-up and capture) are left out; their time is
    compile_time_s (with compile=true), and train_time_s counts every step. The summary also gets
    flops_per_token, where the device's peak is known mfu (against it), and on CUDA the peak memory
    the run allocated (peak_memory_gib).
    """

    name = "throughput"

    def __init__(self, tokens_per_step: int, compile_steps: int = 0, flops_per_token: float | None = None,
                 peak_flops: float | None = None, device: torch.device | None = None):
        self.tokens_per_step, self.compile_steps = tokens_per_step, compile_steps
        self.flops_per_token, self.peak_flops, self.device = flops_per_token, peak_flops, device
        self.train_time, self.window_tokens, self.window_time = 0.0, 0, 0.0
        self.steady_time, self.steady_tokens, self.compile_time = 0.0, 0, 0.0
        self._compiled_seen, self._warm = 0, False
        self._t0 = 0.0

    def on_train_start(self, state: TrainState) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # a sweep's earlier job ran in this process

    def on_step_start(self, state: TrainState) -> None:
        self._t0 = time.perf_counter()

    def after_optimizer_step(self, state: TrainState, record: dict[str, Any] | None) -> None:
        elapsed = time.perf_counter() - self._t0
        compiling = not state.watched and self._compiled_seen < self.compile_steps
        self._compiled_seen += compiling
        if compiling:
            self.compile_time += elapsed
        elif self._warm:
            self.steady_time += elapsed
            self.steady_tokens += self.tokens_per_step
        self._warm = True
        self.train_time += elapsed
        self.window_time += elapsed
        self.window_tokens += self.tokens_per_step
        if record is not None:
            record["tokens_per_s"] = self.window_tokens / self.window_time
            self.window_tokens, self.window_time = 0, 0.0

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        if self.steady_time > 0:
            tokens_per_s = self.steady_tokens / self.steady_time
        else:  # too few steps for a steady state: every step counts
            tokens_per_s = state.tokens / self.train_time if self.train_time > 0 else 0.0
        summary["tokens_per_s"] = tokens_per_s
        summary["train_time_s"] = round(self.train_time, 3)  # every step's time, warm-up and compilation included
        if self.compile_steps:
            summary["compile_time_s"] = round(self.compile_time, 3)
        if self.flops_per_token is not None:
            summary["flops_per_token"] = self.flops_per_token
            if self.peak_flops:
                summary["mfu"] = round(tokens_per_s * self.flops_per_token / self.peak_flops, 4)
        if self.device is not None and self.device.type == "cuda":
            summary["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)

    def state_dict(self) -> dict[str, Any]:
        return {"train_time": self.train_time, "window_tokens": self.window_tokens, "window_time": self.window_time,
                "steady_time": self.steady_time, "steady_tokens": self.steady_tokens, "compile_time": self.compile_time}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_time, self.window_tokens, self.window_time = state["train_time"], state["window_tokens"], state["window_time"]
        # Checkpoints written before the steady-state counters have none: the steps resumed count alone.
        self.steady_time, self.steady_tokens = state.get("steady_time", 0.0), state.get("steady_tokens", 0)
        self.compile_time = state.get("compile_time", 0.0)


class TelemetryProducts(Callback):
    """Keeps the per-layer part of every record and, when the run completes, hands the sinks the
    per-layer table ('telemetry/layers') and layer × step heatmaps ('telemetry/resid_rms',
    'telemetry/grad_norm'), made from those records as compare makes its plots."""

    name = "telemetry_products"
    HEATMAPS = {keys.RESID_RMS: "telemetry/resid_rms", keys.GRAD_NORM: "telemetry/grad_norm"}

    def __init__(self, sinks: Sequence[Sink]):
        self.sinks = sinks
        self.records: list[dict[str, Any]] = []

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None:
        per_layer = {k: v for k, v in (record or {}).items() if keys.parse(k) is not None}
        if per_layer:
            self.records.append({"step": record["step"], **per_layer})

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        if summary.get("status") != "completed" or not self.records or not self.sinks:
            return
        from normlab.analysis.plots import layer_heatmap

        columns, rows = keys.layer_table(self.records)
        titles = {stat: title for stat, _, title in keys.LAYER_PROFILES}
        images = {name: layer_heatmap(self.records, stat, titles[stat]) for stat, name in self.HEATMAPS.items()}
        for sink in self.sinks:
            sink.log_table("telemetry/layers", columns, rows)
            for name, png in images.items():
                sink.log_image(name, png)

    def state_dict(self) -> dict[str, Any]:
        return {"records": [dict(record) for record in self.records]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = [dict(record) for record in state["records"]]


class ProgressBar(Callback):
    """A tqdm bar over the steps, with the last logged loss, lr and throughput."""

    name = "progress"

    def __init__(self, total: int, desc: str):
        self.total, self.desc = total, desc
        self.bar = None

    def on_train_start(self, state: TrainState) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.total, initial=state.step, desc=self.desc, unit="step", dynamic_ncols=True)

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None:
        if record is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        self.bar.update(1)

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        self.bar.close()


class ProgressLog(Callback):
    """The progress bar's stand-in when output is not a terminal (a batch job's log): a line at the first
    logged step past each tenth of the run, with the step, loss, val loss when evaluated, lr and throughput."""

    name = "progress"

    def __init__(self, total: int, desc: str, lines: int = 10):
        self.total, self.desc = total, desc
        self.every = max(1, total // lines)
        self._next = 0

    def on_train_start(self, state: TrainState) -> None:
        self._next = state.step

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None:
        if record is None or record["step"] < self._next:
            return
        val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        log.info("%s: step %d/%d loss %.4f%s lr %.2e %.0f tokens/s", self.desc, record["step"], self.total,
                 record["loss"], val, record["lr"], record["tokens_per_s"])
        self._next = (record["step"] // self.every + 1) * self.every


def progress(total: int, desc: str) -> Callback:
    """A tqdm bar when stderr is a terminal, else periodic log lines (ProgressLog)."""
    return ProgressBar(total, desc) if sys.stderr.isatty() else ProgressLog(total, desc)


class RunReport(Callback):
    """Says what the run does, on the `normlab` logger: at the start one line with the run's name, device,
    precision, parameter count and run dir; at the end one with its status, final and best validation loss
    (nats per token and bits per byte), throughput and wall time."""

    name = "run_report"

    def __init__(self, desc: str, precision: str, run_dir: str):
        self.desc, self.precision, self.run_dir = desc, precision, run_dir
        self._started = time.monotonic()

    def on_train_start(self, state: TrainState) -> None:
        self._started = time.monotonic()
        first = next(state.model.parameters())
        n_params = sum(p.numel() for p in state.model.parameters())
        resumed = f", resuming at step {state.step}" if state.step else ""
        log.info("%s: %s, %s, %s parameters%s, run dir %s", self.desc, first.device, self.precision,
                 f"{n_params:,}", resumed, self.run_dir)

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        log.info("%s %s: final val loss %.4f (%.4f bits/byte), best %.4f (%.4f bits/byte), %.0f tokens/s, "
                 "wall time %.1f s", self.desc, summary["status"], summary["final_val_loss"],
                 summary["final_val_bpb"], summary["best_val_loss"], summary["best_val_bpb"],
                 summary.get("tokens_per_s", math.nan), time.monotonic() - self._started)


class Checkpointing(Callback):
    """Saves the train state and every callback's state at step boundaries (every ckpt.every steps and
    at the end of a completed run), and stops the run with Preempted, after a checkpoint, once a
    preemption signal has arrived (preempt.py). Under DDP all ranks agree on stopping at the same step.
    Until the first step starts, a signal stops start-up at once (preempt.starting); from then on it
    waits for a step boundary, the one before an evaluation included (one process only): a signal
    received while the model is evaluated stops the run before the next training step."""

    name = "checkpointing"

    def __init__(self, checkpointer: Checkpointer, callbacks: Sequence[Callback], max_steps: int):
        self.checkpointer, self.callbacks, self.max_steps = checkpointer, callbacks, max_steps

    def on_step_start(self, state: TrainState) -> None:
        training_started()
        if requested() is not None and not distributed.is_active():
            # Signalled during this step's evaluation: its record is not out yet, so the step's boundary
            # is still here, and the run resumes by evaluating again.
            self.checkpointer.save(state, self.callbacks)
            raise Preempted(requested(), state.step)

    def on_step_end(self, state: TrainState, record: dict[str, Any] | None) -> None:
        # A step boundary: state.step updates are done and every record before it is emitted.
        due = self.checkpointer.due(state.step)
        stop = requested() is not None
        if distributed.is_active():
            # A collective: all ranks ask at the same steps, so all stop at the same step.
            asks = due or state.step % PREEMPT_CHECK_EVERY == 0 or state.step == self.max_steps
            stop = asks and distributed.any_rank(stop)
        if stop or due:
            self.checkpointer.save(state, self.callbacks)
        if stop:
            distributed.barrier()  # no rank exits before rank 0's checkpoint is on disk
            raise Preempted(requested() or signal.SIGTERM, state.step)

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        if summary.get("status") == "completed":
            self.checkpointer.save(state, self.callbacks)


class BatchNormSteps(Callback):
    """Makes the optimizer step the unit of BatchNorm's running statistics: every training forward of the
    step adds its statistic groups' statistics, and before the optimizer step the running statistics move
    once, by `momentum`, toward their mean (norms.StepStatistics). So with a fixed norm.stat_rows a run
    is the same model at any grad_accum. Warns once when grad_accum changes what BatchNorm sees
    (stat_rows null: a statistic spans the micro-batch); records the rows per statistic in the summary."""

    name = "batchnorm_steps"

    def __init__(self, model: torch.nn.Module, cfg: RunConfig):
        self.norms = [m for m in model.modules() if isinstance(m, StepStatistics)]
        self.cfg = cfg

    def on_train_start(self, state: TrainState) -> None:
        if not self.norms:
            return
        stat_rows, grad_accum = self.cfg.norm.stat_rows, self.cfg.grad_accum
        if stat_rows is not None and distributed.is_active():
            raise ConfigError(
                f"norm.stat_rows={stat_rows} under torchrun: statistic groups are single-process only; "
                "use norm.stat_rows=null (statistics over the micro-batch, see norm.sync)"
            )
        if stat_rows is None and grad_accum > 1 and distributed.is_main():
            logging.getLogger("normlab").warning(
                "norm=%s with grad_accum=%d and norm.stat_rows=null: BatchNorm takes its statistics over each "
                "micro-batch of %d sequences, so grad_accum changes the model; set norm.stat_rows to fix them",
                self.cfg.norm.label, grad_accum, self.cfg.micro_batch_size,
            )
        for norm in self.norms:
            norm.per_step = True

    def before_optimizer_step(self, state: TrainState) -> None:
        for norm in self.norms:
            norm.advance_running_statistics()

    def on_train_end(self, state: TrainState, summary: dict[str, Any]) -> None:
        if self.norms:
            summary["norm_stat_rows"] = self.cfg.norm.stat_rows or self.cfg.micro_batch_size
