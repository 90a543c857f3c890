"""ThroughputClock: times the training steps; tokens per second, compile time, MFU and peak memory."""

from __future__ import annotations

import time
from typing import Any

import torch

from normlab.train.callbacks.base import Callback
from normlab.train.state import TrainState


class ThroughputClock(Callback):
    """Times the training steps (batch fetch to the step's figures, evaluation excluded).

    The record's tokens_per_s is over the steps since the last logged one, whatever they cost. The
    summary's tokens_per_s is the steady rate: the process's first step (lazy initialization, on CUDA
    the kernels' first launches), the first `compile_steps` steps that run the compiled model
    (compilation; under CUDA graphs also the graphs' warm-up and capture) and as many telemetry steps (their own
    compiled graph's) are left out; their time is compile_time_s (with
    compile=true), and train_time_s counts every step. The summary also gets
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
        self._compiled_seen, self._watched_seen, self._warm = 0, 0, False
        self._t0 = 0.0

    def on_train_start(self, state: TrainState) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # a sweep's earlier job ran in this process

    def on_step_start(self, state: TrainState) -> None:
        self._t0 = time.perf_counter()

    def after_optimizer_step(self, state: TrainState, record: dict[str, Any] | None) -> None:
        elapsed = time.perf_counter() - self._t0
        if state.watched:  # a telemetry step: its own compiled graph, compiled (and captured) at the first ones
            compiling = self._watched_seen < self.compile_steps
            self._watched_seen += compiling
        else:
            compiling = self._compiled_seen < self.compile_steps
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
