"""Where and how a run computes: device, precision and autocast, TF32 matmuls, determinism,
torch.compile, the host allocator, and seeding.

Each is set once per run, before its first step. Several settings are process-wide (determinism, the
host allocator, the seeds), so every run sets them again and a sweep's next job undoes the last one's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import sys

import numpy as np
import torch
from torch import nn

from normlab.config import ConfigError, RunConfig


def check_device(name: str, key: str = "device") -> str:
    """The device type `name` ('auto', 'cpu' or 'cuda') computes on here ('cpu' or 'cuda'); ConfigError (one
    line, naming the setting as `key`: device, --device) for CUDA where torch sees none."""
    if name == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA"
        raise ConfigError(
            f"{key}=cuda, but torch sees no CUDA device here (torch {torch.__version__}, built for {built}): "
            f"use {key}=cpu, or {key}=auto to take CUDA when there is one"
        )
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto`: bf16 on a CUDA device that supports it, else fp16 on CUDA, fp32 on the CPU."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[precision])


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


_compiled_before = False  # whether this process compiled a run's model already


def compile_model(net: nn.Module, mode: str, device: torch.device):
    """`net` compiled with torch.compile's `mode` (config key compile_mode). Under reduce-overhead torch
    captures the compiled forward and backward in CUDA graphs (on CUDA): every call then starts a new graph
    step, since the loop reads a call's outputs before the next call and keeps none of them longer. Off CUDA
    there is nothing to capture: it compiles with the default mode's Inductor settings (the mode's only
    other one, triton.cudagraphs, would change the key of Inductor's on-disk cache, not the code), so a
    default-mode compile of the same model is reused from that cache."""
    global _compiled_before
    if _compiled_before:
        # A later job of a sweep in this process: Dynamo's cache holds the earlier jobs' graphs, and once one
        # function has recompile_limit (8) of them it runs eager without a word (the Probe's forward and the
        # model's): start the run with an empty cache (Inductor's on-disk cache still saves the compiling).
        torch._dynamo.reset()
    _compiled_before = True
    as_default = mode == "default" or (mode == "reduce-overhead" and device.type != "cuda")
    fast = torch.compile(net, mode=None if as_default else mode)
    if mode != "reduce-overhead":
        return fast

    def graphed(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return fast(*args)

    return graphed


def cuda_graphs(cfg: RunConfig, device: torch.device) -> bool:
    """Whether the compiled steps, plain and telemetry, run captured in CUDA graphs: compile_mode=reduce-overhead on
    CUDA (elsewhere it compiles as the default mode: compile_model)."""
    return cfg.compile and cfg.compile_mode == "reduce-overhead" and device.type == "cuda"


def keeps_gradients(cfg: RunConfig, device: torch.device) -> bool:
    """Whether the parameters' gradients stay allocated between steps (zeroed, not freed): under CUDA graphs with
    grad_accum > 1. A graph's backward output installed as a `.grad` would be overwritten by the next
    micro-batch's replay before the step uses it (torch's "accessing tensor output of CUDAGraphs that has been
    overwritten"); with the gradients allocated beforehand, every micro-batch adds into them in place."""
    return cuda_graphs(cfg, device) and cfg.grad_accum > 1


def hold_gradients(cfg: RunConfig, model: nn.Module, device: torch.device) -> bool:
    """Where keeps_gradients, give every trainable parameter that has none a zero gradient; return whether the
    gradients are to be zeroed rather than freed after each step."""
    if not keeps_gradients(cfg, device):
        return False
    for param in model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)
    return True


def compile_steps(cfg: RunConfig, device: torch.device) -> int:
    """How many of the first compiled steps are compilation (and, under CUDA graphs, warm-up and capture)."""
    if not cfg.compile:
        return 0
    return 2 if cuda_graphs(cfg, device) else 1


# glibc's mallopt parameters (malloc.h) and the values normlab sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD = 2**30


def configure_host_allocator() -> bool:
    """Let glibc's malloc keep freed host memory for reuse instead of giving it back to the OS.

    With glibc's defaults, a CPU step's activations of a few MiB are mapped and unmapped again and
    again, so a step touches thousands of fresh pages (2,400-4,000 page faults per step for the
    default model in scripts/bench/step_speed.py, varying from process to process), and zeroing them costs a
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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
