"""The `normlab` command: `normlab train ...` (a Hydra app), `normlab resume ...` (the same, continuing a run),
`normlab compare ...`, `normlab ls ...`, `normlab sample ...` and `normlab prepare ...`.

Heavy modules (torch, wandb, datasets) are imported only once a subcommand
needs them, so `normlab --help` answers at once.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys

from normlab.util.errors import fail

USAGE = """usage: normlab <command> [args]

options:
  --version  print normlab's version

commands:
  train     train one model, or a sweep with -m (Hydra overrides: norm=rms placement=pre lr=1e-3)
            `normlab train --help` lists the config groups and their options
  resume    continue a stopped run in its own dir, with its saved config (= normlab train resume=RUN_DIR)
            `normlab resume RUN_DIR [overrides]`; overrides may change bookkeeping keys only (ckpt.*, wandb.*, ...)
  compare   compare runs: report.md (ranked arms, runs, LR sensitivity, seeds), plots and CSV/JSON tables
            `normlab compare PATH... [--out DIR] [--format png,svg,pdf] [--wandb]`
            PATH: a run dir, a sweep dir or outputs/
  ls        list runs: status (running while its lock is held), step of max_steps, val loss, wall, age
            `normlab ls [DIR...] [--json]`; DIR: a run dir, a sweep dir or outputs/ (the default)
  sample    print text from a trained model
            `normlab sample RUN_DIR_OR_CHECKPOINT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K]`
  prepare   prepare the tokens a run would train on, resumably, and print where they are
            `normlab prepare [overrides]`: the data.* and tokenizer.* overrides of `normlab train`

examples:
  normlab train norm=rms placement=pre
  normlab train norm=batch placement=post depth=12 lr=3e-4
  normlab train -m norm=none,layer,rms,batch placement=pre,post
  normlab resume outputs/runs/2026-11-22_14-03-12_rms-pre-d4-lr3e-3-s0_3f9a1c
  normlab compare outputs/sweeps/2026-11-22_14-05-40_a81b2e
  normlab ls outputs/sweeps/2026-11-22_14-05-40_a81b2e
  normlab sample outputs/runs/2026-11-22_14-05-40_rms-pre-d4-lr3e-3-s0_a81b2e --prompt "def "
"""


def main(argv: list[str] | None = None) -> int:
    # Registered first, so run last, after wandb's own exit handler: what is still alive is left to the process's
    # end, not walked by the interpreter's last collection (a second of CPU once torch._dynamo is imported).
    atexit.register(gc.freeze)
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if argv[0] in ("--version", "-V"):
        from normlab import __version__

        print(f"normlab {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("-sc", "--shell-completion"):  # what the installed tab completion asks
        from normlab.launch.app import run_train

        return run_train(argv)
    if command == "train":
        from normlab.launch.workers import start_early

        # A CPU sweep's workers' forkserver, importing beside this process's own imports (Hydra's, torch's).
        start_early("-m" in rest or "--multirun" in rest, rest)
        from normlab.launch.app import run_train

        return run_train(rest)
    if command == "resume":
        return _resume(rest)
    if command == "prepare":
        from normlab.launch.prepare import main as run_prepare

        return run_prepare(rest)
    if command in READERS:
        try:
            code = READERS[command]()(rest)
            sys.stdout.flush()  # here, not at exit: a reader gone early (`| head`) is caught below
            return code
        except KeyboardInterrupt:  # Ctrl-C: one line and 128 + SIGINT, the shell's code, not a traceback
            print(f"normlab: {command} interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            return _reader_gone()
    return fail(f"unknown command {command!r}: choose one of train, resume, compare, ls, sample, prepare")


def _reader_gone() -> int:
    """stdout's reader went away (`normlab sample RUN | head`): stop quietly, as a Unix tool does, with 128 + SIGPIPE,
    the shell's code for it. What is left in stdout's buffer goes to /dev/null, so Python's flush at exit does
    not raise again (the recipe of Python's signal module docs, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _compare():
    from normlab.analysis.compare import main as run_compare

    return run_compare


def _ls():
    from normlab.analysis.listing import main as run_ls

    return run_ls


def _sample():
    from normlab.sample import main as run_sample

    return run_sample


# The commands that only read runs, by name: each gives its main(argv) (imported when asked for).
READERS = {"compare": _compare, "ls": _ls, "sample": _sample}


def _resume(rest: list[str]) -> int:
    """`normlab resume RUN_DIR [overrides]`: `normlab train resume=RUN_DIR [overrides]`."""
    if rest[:1] in (["-h"], ["--help"]):
        print("usage: normlab resume RUN_DIR [overrides]: continue the run in RUN_DIR with its saved config")
        return 0
    if not rest or rest[0].startswith("-") or "=" in rest[0] and not os.path.exists(rest[0]):
        return fail("resume: give the run dir to continue first: normlab resume RUN_DIR [overrides]")
    from normlab.launch.app import run_train
    from normlab.launch.overrides import quoted_value

    return run_train(["resume=" + quoted_value(rest[0]), *rest[1:]])


if __name__ == "__main__":
    sys.exit(main())
