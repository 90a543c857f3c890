"""`normlab ARGS` through normlab.cli.main in the test's own process: what `python -m normlab ARGS` runs, without
a fresh Python's start-up (torch, Hydra and wandb imported again: 6-10 s of CPU a command). For commands whose
test is not about the process itself (a signal, a kill, a lock held by another process, two at once).
tests/inprocess.py runs scripts, and the commands scripts start, the same way."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

from normlab.cli import main


def normlab_here(*args, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    """`normlab ARGS` in `cwd`, with `env` added to the environment: its exit code (a job's sys.exit too),
    stdout and stderr, as `normlab` run in a subprocess gives them. Everything the command may change in this
    process is put back on return (see `in_process`), so it serves a test and a wider-scoped fixture alike."""
    return in_process(["normlab", *map(str, args)], lambda: main([str(a) for a in args]), cwd,
                      {**os.environ, **(env or {})})


def exit_code(call: Callable[[], int | None]) -> int:
    """What `call` gives as a process's exit code: its return value, or its SystemExit's code."""
    try:
        return call() or 0
    except SystemExit as stopped:  # a Hydra job's sys.exit, argparse's refusals
        return stopped.code if isinstance(stopped.code, int) else (0 if stopped.code is None else 1)


def in_process(argv: list[str], call: Callable[[], int | None], cwd, env: dict) -> subprocess.CompletedProcess:
    """`call()` run in `cwd` under the environment `env`, as a CompletedProcess named `argv`: its exit code and
    what it wrote to stdout and stderr, at the file descriptors too (what the launcher's worker processes inherit);
    torch's threads as OMP_NUM_THREADS in `env` sets them for a new process.
    The cwd, the environment, sys.argv and sys.path, torch's threads, determinism and TF32 flag, and the handlers,
    level and state of the root and normlab loggers (Hydra's job logging replaces them) are put back after."""
    saved = os.getcwd(), dict(os.environ), sys.argv, list(sys.path)
    torch_state = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                   torch.backends.cuda.matmul.allow_tf32)
    loggers = {logger: (list(logger.handlers), logger.level, logger.disabled)
               for logger in (logging.getLogger(), logging.getLogger("normlab"))}
    with tempfile.TemporaryDirectory() as captured:
        out, err = Path(captured, "stdout"), Path(captured, "stderr")
        try:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
                torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # as a process started with it would
            sys.argv = list(sys.argv)
            with _written_to(out, 1, "stdout"), _written_to(err, 2, "stderr"):
                code = exit_code(call)
        finally:
            os.chdir(saved[0])
            os.environ.clear()
            os.environ.update(saved[1])
            sys.argv, sys.path[:] = saved[2], saved[3]
            torch.set_num_threads(torch_state[0])
            torch.use_deterministic_algorithms(torch_state[1])
            torch.backends.cuda.matmul.allow_tf32 = torch_state[2]
            for logger, (handlers, level, disabled) in loggers.items():  # Hydra's dictConfig replaced them
                logger.handlers[:], logger.level, logger.disabled = handlers, level, disabled
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


@contextlib.contextmanager
def _written_to(path: Path, fd: int, stream: str):
    """For the duration, sys.<stream> and the file descriptor `fd` both append to `path`, in the order they write."""
    getattr(sys, stream).flush()
    saved = os.dup(fd)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(target, fd)
    try:
        with open(target, "w", buffering=1, encoding="utf-8", errors="replace") as text, \
                (contextlib.redirect_stdout if fd == 1 else contextlib.redirect_stderr)(text):
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
