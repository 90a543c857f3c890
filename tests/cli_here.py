"""`normlab ARGS` through normlab.cli.main in the test's own process: what `python -m normlab ARGS` runs, without
a fresh Python's start-up (torch, Hydra and wandb imported again: 6-10 s of CPU a command). For commands whose
test is not about the process itself (a signal, a kill, a lock held by another process, two at once)."""

import contextlib
import io
import logging
import os
import subprocess
import sys

import pytest

from normlab.cli import main


def _main(args) -> int:
    try:
        return main(list(args))
    except SystemExit as stopped:  # a Hydra job's sys.exit, argparse's refusals
        return stopped.code


def normlab_here(*args, cwd, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """`normlab ARGS` run in `cwd`, as a CompletedProcess: the exit code main returns, or that a sys.exit
    gives, and what was written to stdout and stderr. The cwd and sys.argv (the Hydra layer sets it) are
    restored after the test."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    capsys.readouterr()
    code = _main(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["normlab", *args], code, out, err)


def normlab_in_fixture(*args, cwd) -> subprocess.CompletedProcess:
    """normlab_here for a fixture of a wider scope than a test's (no monkeypatch or capsys there): the cwd,
    sys.argv, the environment and the handlers of the root and normlab loggers are restored on return."""
    loggers = [logging.getLogger(), logging.getLogger("normlab")]
    handlers = [list(logger.handlers) for logger in loggers]
    out, err, environ = io.StringIO(), io.StringIO(), dict(os.environ)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        patch.setattr(sys, "argv", list(sys.argv))
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = _main(args)
        finally:
            os.environ.clear()
            os.environ.update(environ)
            for logger, before in zip(loggers, handlers):
                for handler in [h for h in logger.handlers if h not in before]:
                    logger.removeHandler(handler)
    return subprocess.CompletedProcess(["normlab", *args], code, out.getvalue(), err.getvalue())
