"""Preparing a tokenized corpus: peak memory and throughput of normlab's preparation against the path before it,
and batch assembly from memory-mapped token shards.

    python scripts/bench/data_prep.py                                  # 0.25 and 2 GB of text, 10 GB of shards
    python scripts/bench/data_prep.py --encode-max-gb 0.25             # the same, 2 GB prepared only (its memory)
    python scripts/bench/data_prep.py --gb 0.02 --windows-gb 0.1 --old-max-gb 0.02    # a quick check
    python scripts/bench/data_prep.py --gb 0.05 --windows-gb 0 --machinery --vocab 50257   # the machinery compared

The corpus: this Python's standard library .py files that are UTF-8, joined and repeated to `--gb` GB of text
(one file, data=text). Each measurement runs in a child process of its own, with the token cache in a fresh
dir; the parent samples the memory of the child and of every process under it (the preparation's workers)
every 50 ms and prints the peak of their sum: `tree RSS` counts a page that forked workers share with their
parent once in each (so it errs high), PSS divides it among them.

1. `prepare`: `normlab.data.load_corpus(data=text, tokenizer=bpe)` from an empty cache: the byte cache, the BPE
   learned, both splits encoded into shards. Peak memory, and wall time.
2. `encode`: only the encoding of the two splits, the BPE and the byte cache already in place: MB of text per
   second at 1 and 2 workers (data.workers), against the path before shards in the same run; and the
   preparing process's own share alone (the text read and cut into pieces, no encoding), the pace past which
   more workers cannot go ("old": a faithful
   copy, below, of `cached_encoding` as it was: each split's bytes copied, decoded whole, cut in newline chunks
   and encoded in one `encode_batch_fast` call on tokenizers' own threads). The old path's peak memory is
   measured up to `--old-max-gb` (at 2 GB it needs some 80 GB). With --machinery, also the other ways to run
   tokenizers on the cores: its own threads (Rayon) in one process, and datasets.map(num_proc=N).
3. `windows`: random windows drawn and stacked (`TokenShards.sample`, one core) from uint16 shards of
   `--windows-gb` GB written for it (100M ids a shard, as normlab's and llm.c's): tokens per second.

Each line also gives the CPU time the work took (the child and the workers it waited for): on a shared
machine it varies less than the wall time. Figures vary with the machine's load: say which machine and how
loaded when quoting them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, nargs="+", default=[0.25, 2.0], help="GB of text to prepare")
    parser.add_argument("--old-max-gb", type=float, default=0.25, help="run the old path up to this size")
    parser.add_argument("--encode-max-gb", type=float, default=float("inf"),
                        help="run the encode comparison (1 and 2 workers, the old path) up to this size; larger "
                        "sizes are prepared only (their peak memory)")
    parser.add_argument("--windows-gb", type=float, default=10.0, help="GB of token shards to draw windows from")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--window-seconds", type=float, default=10.0, help="how long windows are drawn")
    parser.add_argument("--vocab", type=int, default=4096, help="the BPE's ids (4096: tokenizer=bpe's default; "
                        "50257: GPT-2's size)")
    parser.add_argument("--machinery", action="store_true", help="also encode with tokenizers' own threads and "
                        "with datasets.map(num_proc), at 1 and 2 processes or threads")
    parser.add_argument("--work", default=None, help="a dir for the corpora and caches (default: a temp dir)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](*args.child[1:])))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="normlab-data-prep-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, work dir {work}")
    for gb in args.gb:
        corpus = make_corpus(work / f"text-{gb:g}GB.txt", gb)
        size_mb = corpus.stat().st_size / 1e6
        bench_prepare(work, corpus, size_mb, args.vocab)
        if gb <= args.encode_max_gb:
            bench_encode(work, corpus, size_mb, args.vocab, old=gb <= args.old_max_gb, machinery=args.machinery)
    if args.windows_gb > 0:
        bench_windows(work, args.windows_gb, args.batch_size, args.seq_len, args.window_seconds)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


def make_corpus(path: Path, gb: float) -> Path:
    """This Python's standard library .py files that are UTF-8, joined with newlines, repeated to `gb` GB."""
    if path.is_file():
        return path
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for file in sorted(root.rglob("*.py")):
        if {"site-packages", "dist-packages"} & set(file.parts):
            continue
        data = file.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        texts.append(data)
    block = b"\n".join(texts)
    target = int(gb * 1e9)
    with open(path, "wb") as fh:
        while fh.tell() < target:
            fh.write(block[: target - fh.tell()])
    return path


def run_child(*args: str) -> dict:
    """This script's `--child ARGS` in a process of its own: its printed result and peak tree RSS."""
    child = subprocess.Popen([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    peak_rss = peak_pss = 0
    while child.poll() is None:
        rss, pss = tree_memory(child.pid)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    out = child.stdout.read()
    if child.returncode:
        raise SystemExit(f"child {args} failed with exit code {child.returncode}")
    return {**json.loads(out.strip().splitlines()[-1]), "tree_rss_gb": peak_rss / 2**30, "tree_pss_gb": peak_pss / 2**30}


def tree_memory(pid: int) -> tuple[int, int]:
    """Bytes of (RSS, PSS) of `pid` and every process under it: RSS counts a page shared by forked processes once
    in each, PSS divides it among them."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    rss = pss = 0
    for member in tree:
        try:
            for line in Path(f"/proc/{member}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def bench_prepare(work: Path, corpus: Path, size_mb: float, vocab: int) -> None:
    cache = fresh(work / "cache-prepare")
    result = run_child("prepare", str(corpus), str(cache), "0", str(vocab))
    print(f"prepare {size_mb:,.1f} MB, tokenizer=bpe ({vocab} ids), data.workers={os.cpu_count()} (empty cache): "
          f"{result['seconds']:.1f} s ({result['cpu_seconds']:.0f} CPU-s), peak tree RSS {result['tree_rss_gb']:.2f} GB "
          f"(PSS {result['tree_pss_gb']:.2f} GB), {result['tokens']:,} tokens")


LABELS = {"pieces": "the preparing process alone, cutting pieces (no encoding)", "new": "normlab, {} worker process(es)", "old": "old path (one encode_batch_fast, tokenizers' threads)",
          "threads": "tokenizers' own threads, {} (RAYON_NUM_THREADS)", "datasets": "datasets.map(num_proc={})"}


def bench_encode(work: Path, corpus: Path, size_mb: float, vocab: int, old: bool, machinery: bool) -> None:
    """Encoding alone (byte cache and BPE in place): new at 1 and 2 workers, old, and the other machinery."""
    seed = work / "cache-prepare"  # holds the byte cache and the BPE the prepare step made
    runs = [("pieces", "0"), ("new", "1"), ("new", "2")] + ([("old", "0")] if old else [])
    runs += [(kind, n) for kind in ("threads", "datasets") for n in ("1", "2")] if machinery else []
    for kind, workers in runs:
        cache = fresh(work / f"cache-{kind}-{workers}")
        for item in seed.iterdir():
            if item.name.startswith(("text-", "bpe-")):
                shutil.copy(item, cache / item.name)
        result = run_child(kind, str(corpus), str(cache), workers, str(vocab))
        print(f"encode {size_mb:,.1f} MB, {LABELS[kind].format(workers)}: {result['seconds']:.1f} s, "
              f"{size_mb / result['seconds']:.2f} MB/s, {result['tokens'] / result['seconds'] / 1e6:.2f}M tokens/s, "
              f"{result['cpu_seconds'] / size_mb * 1000:.0f} CPU-s/GB, peak tree RSS {result['tree_rss_gb']:.2f} GB "
              f"(PSS {result['tree_pss_gb']:.2f} GB), sha256 {result['sha256'][:12]}")
        shutil.rmtree(cache, ignore_errors=True)


def bench_windows(work: Path, gb: float, batch_size: int, seq_len: int, seconds: float) -> None:
    folder = work / f"shards-{gb:g}GB"
    result = run_child("windows", str(folder), str(gb), str(batch_size), str(seq_len), str(seconds))
    print(f"windows from {gb:g} GB of uint16 shards ({result['shards']} shards), batch {batch_size} x {seq_len}, "
          f"one core: {result['tokens_per_s'] / 1e6:.1f}M tokens/s ({result['batches']} batches in "
          f"{result['seconds']:.1f} s)")


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# ---------------------------------------------------------------- children


def cpu_seconds() -> float:
    """CPU time of this process and of the processes it has waited for (the preparation's workers)."""
    import resource

    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def child_prepare(corpus: str, cache: str, workers: str, vocab: str) -> dict:
    from normlab.config import DataConfig, TokenizerConfig
    from normlab.data import load_corpus

    start, cpu = time.perf_counter(), cpu_seconds()
    loaded = load_corpus(DataConfig(source="text", files=[corpus], cache_dir=cache, workers=int(workers) or None),
                         TokenizerConfig(kind="bpe", vocab_size=int(vocab)))
    return {"seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - cpu,
            "tokens": len(loaded.train) + len(loaded.val), "sha256": loaded.sha256}


def child_new(corpus: str, cache: str, workers: str, vocab: str) -> dict:
    return child_prepare(corpus, cache, workers, vocab)


def split_text(corpus: str, cache: str, vocab: str):
    """The byte cache's two splits and the BPE, both already in `cache`."""
    from normlab.config import DataConfig, TokenizerConfig
    from normlab.data import corpus as corpus_module

    cfg = DataConfig(source="text", files=[corpus], cache_dir=cache)
    text = corpus_module._split_text(cfg, Path(cache), char_aligned=True, utf8=True)
    return text, corpus_module._build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=int(vocab)), Path(cache), text)


def finish(start: float, cpu: float, ids: dict) -> dict:
    import hashlib

    digest = hashlib.sha256(ids["train"])
    digest.update(ids["val"])
    return {"seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - cpu,
            "tokens": int(sum(map(len, ids.values()))), "sha256": digest.hexdigest()}


def child_pieces(corpus: str, cache: str, _: str, vocab: str) -> dict:
    """What the preparing process does for every byte besides waiting for the workers: the text read and cut into
    pieces (normlab.data.pieces), no encoding: the pace beyond which more workers cannot help."""
    from normlab.data.pieces import text_pieces

    text, _tok = split_text(corpus, cache, vocab)
    start, cpu = time.perf_counter(), cpu_seconds()
    for part in ("train", "val"):
        for _ in text_pieces((getattr(text, part),)):
            pass
    return {"seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - cpu, "tokens": 0,
            "sha256": "(no tokens)"}


def child_old(corpus: str, cache: str, _: str, vocab: str) -> dict:
    """The path before shards, on the byte cache and BPE already in `cache`: a faithful copy of its encoding."""
    text, tok = split_text(corpus, cache, vocab)
    start, cpu = time.perf_counter(), cpu_seconds()
    ids = {"train": old_encode(tok, text.train.tobytes()), "val": old_encode(tok, text.val.tobytes())}
    for part, array in ids.items():  # as the old path wrote them (write_bytes_atomic of the whole array)
        (Path(cache) / f"old.{part}.bin").write_bytes(array.tobytes())
    return finish(start, cpu, ids)


def child_threads(corpus: str, cache: str, threads: str, vocab: str) -> dict:
    """The pieces normlab encodes, in batches of 1 MB, by tokenizers' own threads (Rayon) in this process."""
    os.environ["RAYON_NUM_THREADS"] = threads  # read when tokenizers first starts its threads
    import numpy as np

    from normlab.data.pieces import text_pieces

    text, tok = split_text(corpus, cache, vocab)
    start, cpu, ids = time.perf_counter(), cpu_seconds(), {}
    for part in ("train", "val"):
        pieces, out = [], []
        for piece, _, _ in text_pieces((getattr(text, part),)):
            pieces.append(piece)
            if len(pieces) == 16:
                out += [np.asarray(e.ids, tok.dtype) for e in tok.backend.encode_batch_fast(pieces, False)]
                pieces = []
        out += [np.asarray(e.ids, tok.dtype) for e in tok.backend.encode_batch_fast(pieces, False)] if pieces else []
        ids[part] = np.concatenate(out)
    return finish(start, cpu, ids)


def child_datasets(corpus: str, cache: str, processes: str, vocab: str) -> dict:
    """The pieces as a datasets.Dataset, encoded by datasets.map(batched, num_proc), as nanoGPT's prepare.py does."""
    import datasets
    import numpy as np

    from normlab.data.pieces import text_pieces

    datasets.disable_caching()
    datasets.disable_progress_bars()
    text, tok = split_text(corpus, cache, vocab)
    backend = tok.backend

    def encode(batch: dict) -> dict:
        return {"ids": [e.ids for e in backend.encode_batch_fast(batch["text"], False)]}

    start, cpu, ids = time.perf_counter(), cpu_seconds(), {}
    for part in ("train", "val"):
        pieces = datasets.Dataset.from_dict({"text": [p for p, _, _ in text_pieces((getattr(text, part),))]})
        mapped = pieces.map(encode, batched=True, batch_size=16, remove_columns=["text"],
                            num_proc=int(processes) if int(processes) > 1 else None)
        ids[part] = np.concatenate([np.asarray(row, tok.dtype) for row in mapped["ids"]])
    return finish(start, cpu, ids)


def old_encode(tok, data: bytes):
    """HFTokenizer.encode as the old path called it: the split decoded whole, newline chunks, one batch call."""
    import numpy as np

    from normlab.data.pieces import newline_chunks

    pieces = list(newline_chunks(data.decode("utf-8", errors="replace")))
    encodings = tok.backend.encode_batch_fast(pieces, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids, dtype=tok.dtype) for e in encodings])


def child_windows(folder: str, gb: str, batch_size: str, seq_len: str, seconds: str) -> dict:
    import numpy as np
    import torch

    from normlab.data.shards import TokenShards, header, read_shard

    torch.set_num_threads(1)
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    per_shard, total = 100_000_000, int(float(gb) * 1e9 / 2)
    rng = np.random.default_rng(0)
    shards = []
    for index in range(-(-total // per_shard)):
        file = path / f"shard-{index:06d}.bin"
        count = min(per_shard, total - index * per_shard)
        if not file.is_file() or file.stat().st_size != 1024 + 2 * count:
            with open(file, "wb") as fh:
                fh.write(header(np.dtype("<u2"), count))
                for start in range(0, count, 1 << 24):
                    fh.write(rng.integers(0, 50257, min(1 << 24, count - start), dtype=np.uint16).tobytes())
        shards.append(read_shard(file))
    tokens = TokenShards(shards)
    generator = torch.Generator().manual_seed(0)
    batches, start = 0, time.perf_counter()
    while time.perf_counter() - start < float(seconds):
        tokens.sample(int(batch_size), int(seq_len), generator)
        batches += 1
    seconds = time.perf_counter() - start
    return {"shards": len(shards), "batches": batches, "seconds": seconds,
            "tokens_per_s": batches * int(batch_size) * int(seq_len) / seconds}


CHILDREN = {"prepare": child_prepare, "pieces": child_pieces, "new": child_new, "old": child_old, "threads": child_threads,
            "datasets": child_datasets, "windows": child_windows}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
