"""`normlab prepare OVERRIDES`: prepare the tokens of the corpus that `normlab train OVERRIDES` would train on,
and say where they are and which `normlab train` lines read them.

The overrides are `normlab train`'s and are checked as it checks them (one line, exit 2). The corpus goes
through the same cache as training (normlab.data.load_corpus), with a progress bar on stderr (off with
progress=false): a `normlab train` with the same data and tokenizer overrides afterwards finds it prepared, and a
prepare that was stopped (Ctrl-C, a kill, a full disk) resumes from its last complete shard when run again.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from normlab.config import ConfigError
from normlab.launch.prechecks import CONFIG_MODULE, check_command
from normlab.launch.resolvers import register_resolvers
from normlab.launch.rundir import compose_run
from normlab.util.errors import fail

USAGE = """usage: normlab prepare [overrides]

Prepare the tokens `normlab train [overrides]` would train on (the data.* and tokenizer.* overrides decide
which), print where they are and the `normlab train` lines that read them. Run again after a stop, it resumes.

examples:
  normlab prepare tokenizer=bpe
  normlab prepare data=hf data.name=HuggingFaceFW/fineweb-edu data.config_name=sample-10BT data.holdout=hash \\
      tokenizer=hf tokenizer.name=gpt2
"""


def main(argv: list[str]) -> int:
    """`normlab prepare ARGV`; returns the exit code."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE, end="")
        return 0
    options = [arg for arg in argv if arg.startswith("-")]
    if options:
        return fail(f"prepare: {options[0]}: prepare takes the overrides of one run (normlab prepare tokenizer=bpe), "
                    "not options; `normlab prepare --help` says more")
    register_resolvers()
    try:
        check_command(argv, [], False, None)
        cfg = compose_run(argv, [], CONFIG_MODULE)[0]
    except ConfigError as err:
        return fail(err)
    except Exception as err:  # Hydra's override grammar: one line is enough
        return fail(f"could not parse the overrides: {str(err).splitlines()[0]}")
    from normlab.data import DataError, load_corpus  # torch, numpy: once the command line holds

    try:
        corpus = load_corpus(cfg.data, cfg.tokenizer, seq_len=cfg.seq_len, progress=cfg.progress)
    except (DataError, ConfigError) as err:
        return fail(err)
    except KeyboardInterrupt:
        print("normlab: prepare interrupted; the same command resumes from the last complete shard", file=sys.stderr)
        return 130
    print(report(corpus, argv))
    return 0


def report(corpus, argv: list[str]) -> str:
    """Where `corpus`'s tokens are, how many, and the `normlab train` lines that read them."""
    train_files, val_files = (_files(split) for split in (corpus.train, corpus.val))
    lines = [f"{corpus.source}, tokenizer {corpus.tokenizer.identity}: {len(corpus.train):,} training and "
             f"{len(corpus.val):,} validation tokens, {corpus.n_bytes:,} bytes of text"]
    if train_files:
        folder = train_files[0].parent
        lines.append(f"in {folder}: {len(train_files)} training and {len(val_files)} validation shard(s)")
    lines.append("train on them: normlab train " + shlex.join(argv))
    tokenizer = train_files[0].parent / "tokenizer.json" if train_files else None
    if tokenizer is not None and tokenizer.is_file():
        folder = train_files[0].parent
        shards = {split: shlex.quote(f"data.{split}=[{folder}/{split}-*.bin]") for split in ("train", "val")}
        lines.append(f"or as token shards: normlab train data=tokens {shards['train']} {shards['val']} "
                     f"tokenizer=hf {shlex.quote(f'tokenizer.name={tokenizer}')}")
    return "\n".join(lines)


def _files(shards) -> list[Path]:
    """The files of a split's memory-mapped shards, in order (none for a split read otherwise)."""
    names = [getattr(shard, "filename", None) for shard in shards.shards]
    return [Path(name) for name in names if name] if all(names) else []
