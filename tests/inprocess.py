"""`normlab ...`, `python -m normlab ...` and `python SCRIPT.py ...` run in the test's own process, for tests that are
not about process behaviour (signals, exit codes of the real process, concurrency, kills): each such process
would import torch, Hydra and matplotlib again, 5 to 10 s of CPU each, which this process has paid already.

- `Commands.run(argv, cwd, env)`: one command, with its output and exit code, as a CompletedProcess;
- `Commands.intercept()`: a script's `subprocess.run` of a normlab command (or a Python script) runs it here;
- `Commands.bash(script, *args, cwd, env)`: a bash script, run by bash, whose `normlab` and `python` commands are
  shims (first on its PATH) that hand each command to this process and wait for its output and exit code.
"""

from __future__ import annotations

import os
import runpy
import select
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from cli_here import in_process
from normlab import cli

# A shim: the command's arguments, directory and environment go into a request folder, whose path goes to the queue
# (a FIFO the test process reads); the answer is the command's output in files and its exit code through a FIFO.
SHIM = """#!/usr/bin/env bash
req=$(mktemp -d "$INPROCESS_DIR/req.XXXXXX")
printf '%s\\0' "$(basename "$0")" "$@" > "$req/argv"
printf '%s' "$PWD" > "$req/cwd"
env -0 > "$req/env"
mkfifo "$req/done"
echo "$req" > "$INPROCESS_DIR/queue"
read -r code < "$req/done"
cat "$req/out"
cat "$req/err" >&2
exit "$code"
"""


def _normlab_args(argv: list[str]) -> list[str] | None:
    """The arguments after `normlab` when `argv` is a normlab command (`normlab ...`, `python -m normlab ...`)."""
    if Path(argv[0]).name == "normlab":
        return argv[1:]
    if Path(argv[0]).name.startswith("python") and argv[1:3] == ["-m", "normlab"]:
        return argv[3:]
    return None


def _python_script(argv: list[str]) -> bool:
    """Whether `argv` is `python SCRIPT.py ...`."""
    return Path(argv[0]).name.startswith("python") and len(argv) > 1 and argv[1].endswith(".py")


def _as_run_returns(done: subprocess.CompletedProcess, kwargs: dict) -> subprocess.CompletedProcess:
    """`done` as subprocess.run(**kwargs) returns it: output captured or passed on, text or bytes, checked."""
    if kwargs.get("check") and done.returncode:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    text = kwargs.get("text") or kwargs.get("universal_newlines") or kwargs.get("encoding")
    captured = []
    for name, value, stream in (("stdout", done.stdout, sys.stdout), ("stderr", done.stderr, sys.stderr)):
        where = subprocess.PIPE if kwargs.get("capture_output") else kwargs.get(name)
        if where is None:
            stream.write(value)  # inherited
        captured.append((value if text else value.encode()) if where == subprocess.PIPE else None)
    return subprocess.CompletedProcess(done.args, done.returncode, *captured)


class Commands:
    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.real_run = subprocess.run

    def run(self, argv: list[str], cwd, env: dict | None = None) -> subprocess.CompletedProcess:
        """`argv` (a normlab command or `python SCRIPT.py ...`) in this process, in `cwd`, under `env` (default:
        this process's): its stdout, stderr and exit code, with this process's state put back after
        (cli_here.in_process)."""
        argv = [str(a) for a in argv]
        return in_process(argv, lambda: self._call(argv), cwd, dict(os.environ) if env is None else env)

    @staticmethod
    def _call(argv: list[str]) -> int:
        """Run `argv` as its process would, and return its exit code."""
        args = _normlab_args(argv)
        try:
            if args is not None:
                sys.argv = ["normlab", *args]
                return cli.main(args) or 0
            if not _python_script(argv):
                raise ValueError(f"not a normlab command or a Python script: {argv}")
            sys.argv = argv[1:]
            sys.path.insert(0, str(Path(argv[1]).resolve().parent))
            runpy.run_path(argv[1], run_name="__main__")
            return 0
        except SystemExit as exit:
            return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except Exception:  # as Python ends a process on an uncaught exception
            traceback.print_exc()
            return 1

    def intercept(self, scripts: bool = False) -> None:
        """From now on in this test, subprocess.run of a normlab command (with `scripts`, of `python SCRIPT.py`
        too) runs it here (through `run`); any other command runs as ever."""

        def run(args, **kwargs):
            argv = None if isinstance(args, (str, bytes, os.PathLike)) else [str(a) for a in args]
            if argv is None or not (_normlab_args(argv) is not None or scripts and _python_script(argv)):
                return self.real_run(args, **kwargs)
            return _as_run_returns(self.run(argv, kwargs.get("cwd") or os.getcwd(), kwargs.get("env")), kwargs)

        self.monkeypatch.setattr(subprocess, "run", run)

    def bash(self, script, *args, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
        """`bash SCRIPT ARGS` in `cwd` under `env`, its `normlab` and `python` commands run here, one after another."""
        with tempfile.TemporaryDirectory(prefix="inprocess-") as tmp:
            shims = Path(tmp)
            for name in ("normlab", "python"):
                (shims / name).write_text(SHIM)
                (shims / name).chmod(0o755)
            os.mkfifo(shims / "queue")
            env = {**env, "INPROCESS_DIR": tmp, "PATH": f"{tmp}{os.pathsep}{env['PATH']}"}
            queue = os.open(shims / "queue", os.O_RDWR)  # a writer of our own: reads wait for a request, never EOF
            with open(shims / "stdout", "w+") as out, open(shims / "stderr", "w+") as err:
                proc = subprocess.Popen(["bash", str(script), *args], cwd=cwd, env=env, stdout=out, stderr=err)
                try:
                    self._serve(proc, queue, time.monotonic() + timeout)
                finally:
                    os.close(queue)
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                out.seek(0), err.seek(0)
                return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())

    def _serve(self, proc: subprocess.Popen, queue: int, deadline: float) -> None:
        """Answer the shims' requests until the script ends."""
        pending = b""
        while proc.poll() is None or b"\n" in pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.args} ran past its time")
            if b"\n" not in pending:
                if select.select([queue], [], [], 0.05)[0]:
                    pending += os.read(queue, 4096)
                continue
            line, pending = pending.split(b"\n", 1)
            self._answer(Path(line.decode()))

    def _answer(self, req: Path) -> None:
        argv = req.joinpath("argv").read_bytes().decode().split("\0")[:-1]
        env = dict(item.split("=", 1) for item in req.joinpath("env").read_bytes().decode().split("\0") if "=" in item)
        done = self.run(argv, req.joinpath("cwd").read_text(), env)
        req.joinpath("out").write_text(done.stdout)
        req.joinpath("err").write_text(done.stderr)
        with open(req / "done", "w") as fifo:  # the shim is waiting on it
            fifo.write(f"{done.returncode}\n")
