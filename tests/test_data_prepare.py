"""Preparing tokens (normlab.data.prepare, .pieces, .holdout): the pieces read a block at a time are the whole
text's, the encoding is the same whatever the workers and batch size, memory is bounded by the batch, a killed
or disk-full preparation resumes, documents are held out by hash or count, and the stdlib corpus keeps the
tokens it had before shards."""

import errno
import hashlib
import json
import logging
import os
import random
import re
import subprocess
import sys
import sysconfig
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

from normlab.config import DataConfig, TokenizerConfig
from normlab.data import DataError, load_corpus
from normlab.data import prepare as prep
from normlab.data import tokenizer as tokenizer_module
from normlab.data.holdout import held_out
from normlab.data.pieces import NotUtf8, newline_chunks, text_pieces


def _code(n_lines: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["def", "return", "value", "naïve", "ünïcode", "日本", "x", "+", "(", ")", "🙂", "self", "import"]
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) + "\n" for _ in range(n_lines))


def _ids(corpus) -> tuple[np.ndarray, np.ndarray]:
    return corpus.train.numpy().copy(), corpus.val.numpy().copy()


def _config(tmp_path, files, cache="c", **keys) -> DataConfig:
    return DataConfig(source="text", files=[str(f) for f in files], cache_dir=str(tmp_path / cache), **keys)


BPE = TokenizerConfig(kind="bpe", vocab_size=300)


# ---------------------------------------------------------------- pieces


def test_pieces_read_a_block_at_a_time_are_the_whole_texts_and_resume_at_any_piece():
    rng = random.Random(1)
    for trial in range(60):
        raw = bytearray(_code(rng.randint(0, 80), seed=trial).encode())
        for _ in range(rng.randint(0, 4)):  # bytes that are not UTF-8
            raw[rng.randint(0, len(raw)):0] = bytes([rng.choice([0x80, 0xE9, 0xFF, 0xE2])])
        raw = bytes(raw)
        size, block, cut = rng.randint(1, 300), rng.randint(1, 64), rng.randint(0, len(raw))
        pieces = list(text_pieces((raw[:cut], raw[cut:]), replace=True, size=size, block=block))
        assert [p for p, _, _ in pieces] == list(newline_chunks(raw.decode("utf-8", "replace"), size))
        # each piece's replacements name its U+FFFDs, and with them its own bytes add up to the text's
        assert sum(len(p.encode()) + sum(k - 3 for _, k in r) for p, _, r in pieces) == len(raw)
        assert all(p[i] == "\ufffd" for p, _, r in pieces for i, _ in r)
        if len(pieces) > 1:
            at = rng.randrange(len(pieces) - 1)
            again = text_pieces((raw,), pieces[at][1], replace=True, size=size, block=block)
            assert [p for p, _, _ in again] == [p for p, _, _ in pieces[at + 1:]]
        try:
            raw.decode("utf-8")
            list(text_pieces((raw,), size=size, block=block))
        except UnicodeDecodeError as err:
            with pytest.raises(NotUtf8) as caught:
                list(text_pieces((raw,), size=size, block=block))
            assert caught.value.offset == err.start


# ---------------------------------------------------------------- the same tokens


def _old_bpe(train_text: bytes, vocab_size: int, budget: int) -> Backend:
    """A byte-level BPE as normlab learned it before the text was read a block at a time: the whole training text
    decoded, cut in newline chunks, every k-th chunk learned from (a faithful copy of that code)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    text = train_text.decode("utf-8", errors="replace")
    chunks = list(newline_chunks(text))
    sample = chunks if len(text) <= budget else chunks[:: max(1, round(len(text) / budget))]
    backend.train_from_iterator(sample, trainer=trainer)
    return backend


def test_tail_split_gives_the_merges_and_ids_of_the_whole_text_path(tmp_path, monkeypatch):
    """The BPE learned from a spread sample and the ids of both splits are those of the path that held the whole
    text in memory (its code copied above; the ids it encoded are HFTokenizer.encode's, which still does it)."""
    monkeypatch.setattr(tokenizer_module, "BPE_TRAIN_BYTES", 40_000)  # a spread sample of a 300 kB text
    monkeypatch.setattr(prep, "SHARD_TOKENS", 5_000)  # several shards per split
    path = tmp_path / "code.txt"
    path.write_bytes(_code(6000).encode())
    corpus = load_corpus(_config(tmp_path, [path], workers=2, batch_bytes=10_000), BPE)
    raw = path.read_bytes()
    cut = len(raw) - int(len(raw) * 0.1)
    old = _old_bpe(raw[:cut], 300, 40_000)
    assert corpus.tokenizer.backend.to_str() == old.to_str()
    train, val = _ids(corpus)
    assert len(corpus.train.shards) > 1
    assert np.array_equal(train, corpus.tokenizer.encode(raw[:cut]))
    assert np.array_equal(val, corpus.tokenizer.encode(raw[cut:]))
    assert corpus.sha256 == hashlib.sha256(train.tobytes() + val.tobytes()).hexdigest()


# The stdlib corpus with tokenizer=bpe (vocab 4096) as main's code encoded it (before shards), on this
# machine's Python 3.11.7: the byte corpus's sha256, and the tokenizer's identity, the ids' sha256 and counts.
STDLIB_BYTES_SHA256 = "b557e7709570eeaaa38fc2173908d26acc41836ab8441b6b65915ca011b3c0d2"
STDLIB_BPE = {"identity": "bpe-8152c6fa2eed781d", "n_train": 8530305, "n_val": 910179,
              "sha256": "454613d5e3aa876632c5535894afdb06ded5232c2ab9d111ce447285662943a8"}


def test_the_stdlib_corpus_keeps_its_bpe_tokens(tmp_path):
    byte_corpus = load_corpus(DataConfig(cache_dir=str(tmp_path)))
    if byte_corpus.sha256 != STDLIB_BYTES_SHA256:
        pytest.skip(f"another standard library ({sysconfig.get_paths()['stdlib']}): its tokens were not pinned")
    corpus = load_corpus(DataConfig(cache_dir=str(tmp_path)), TokenizerConfig(kind="bpe"))
    found = {"identity": corpus.tokenizer.identity, "n_train": len(corpus.train), "n_val": len(corpus.val),
             "sha256": corpus.sha256}
    assert found == STDLIB_BPE


@pytest.mark.parametrize("holdout", ["tail", "hash"])
def test_the_tokens_do_not_depend_on_workers_or_batch_size(tmp_path, holdout):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": _code(30, seed=i)}) + "\n" for i in range(100)), encoding="utf-8")
    files = [rows, tmp_path / "long.txt"]
    files[1].write_bytes(_code(3000).encode())
    runs = [load_corpus(_config(tmp_path, files, cache=f"c{w}-{b}", holdout=holdout, workers=w, batch_bytes=b), BPE)
            for w, b in ((1, 1 << 20), (2, 700), (2, 50_000))]
    first = _ids(runs[0])
    for corpus in runs[1:]:
        again = _ids(corpus)
        assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
        assert corpus.sha256 == runs[0].sha256


# ---------------------------------------------------------------- bounded memory


def test_memory_holds_batches_not_the_corpus(tmp_path, monkeypatch):
    """A 4 MB corpus (16 MB as one str: it holds characters beyond U+FFFF) prepared in batches of one piece (64k
    characters; a data.batch_bytes below a piece is a piece): the preparing process's Python allocations peak
    below a few MB, the BPE's learning included (its sample cut to 100 kB here). The text is read from its
    file and decoded 64 kB at a time; the workers hold a batch each. The path that held the text whole peaked at some
    40 times the corpus."""
    monkeypatch.setattr(tokenizer_module, "BPE_TRAIN_BYTES", 100_000)
    path = tmp_path / "big.txt"
    path.write_bytes(_code(4000).encode() * 30)
    size = path.stat().st_size
    assert size > 3_500_000
    tracemalloc.start()
    try:
        corpus = load_corpus(_config(tmp_path, [path], workers=2, batch_bytes=1), BPE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(corpus.train) > 1_000_000
    assert peak < 4_000_000, (peak, size)


# ---------------------------------------------------------------- resuming


KILLED_AFTER_TWO_SHARDS = """
import os, signal, sys
from normlab.config import DataConfig, TokenizerConfig
from normlab.data import load_corpus
from normlab.data import prepare as prep

prep.SHARD_TOKENS = 20_000
checkpoint, seen = prep._checkpoint, []

def checkpoint_then_die(*args):
    checkpoint(*args)
    seen.append(1)
    if len(seen) == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or `kill -9` would

prep._checkpoint = checkpoint_then_die
load_corpus(DataConfig(source="text", files=sys.argv[1:2], cache_dir=sys.argv[2], workers=2, batch_bytes=1),
            TokenizerConfig(kind="bpe", vocab_size=300))
"""


def test_a_killed_preparation_resumes_from_its_last_complete_shard(tmp_path, monkeypatch):
    path = tmp_path / "code.txt"
    path.write_bytes(_code(30_000).encode())  # 1 MB: 16 pieces, about 15 shards of 20k ids
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_AFTER_TWO_SHARDS))
    killed = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "c")], capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (partial,) = (tmp_path / "c").glob("tokens-*.partial")
    assert not list((tmp_path / "c").glob("tokens-*/meta.json")), "a killed preparation publishes no entry"
    progress = json.loads((partial / "progress.json").read_text())
    assert progress["written"]["train"] >= 40_000

    monkeypatch.setattr(prep, "SHARD_TOKENS", 20_000)
    batches, starts = prep._batches, []
    monkeypatch.setattr(prep, "_batches", lambda units, unit, offset, *a: starts.append((unit, offset)) or
                        batches(units, unit, offset, *a))
    resumed = load_corpus(_config(tmp_path, [path], workers=2, batch_bytes=1), BPE)
    assert starts == [(progress["unit"], progress["offset"])] and starts[0] != (0, 0)
    clean = load_corpus(_config(tmp_path, [path], cache="clean", workers=1), BPE)
    assert resumed.sha256 == clean.sha256 and len(resumed.train.shards) == len(clean.train.shards) > 5
    assert not list((tmp_path / "c").glob("*.partial"))


def test_a_full_disk_publishes_nothing_and_the_next_run_resumes(tmp_path, monkeypatch, capsys):
    path = tmp_path / "code.txt"
    path.write_bytes(_code(30_000).encode())
    monkeypatch.setattr(prep, "SHARD_TOKENS", 20_000)
    append, calls = prep.ShardWriter.append, []

    def full_after_a_while(self, ids):
        calls.append(1)
        if len(calls) > 12:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return append(self, ids)

    monkeypatch.setattr(prep.ShardWriter, "append", full_after_a_while)
    cfg = _config(tmp_path, [path], workers=1, batch_bytes=1)  # a batch a piece: a write every 64k characters
    with pytest.raises(DataError) as caught:
        load_corpus(cfg, BPE)
    message = str(caught.value)
    assert "\n" not in message and "No space left on device" in message and "resumes" in message
    assert not list((tmp_path / "c").glob("tokens-*/meta.json")), "no entry is published"
    assert list((tmp_path / "c").glob("tokens-*.partial/progress.json"))
    monkeypatch.setattr(prep.ShardWriter, "append", append)
    again = load_corpus(cfg, BPE)
    clean = load_corpus(_config(tmp_path, [path], cache="clean"), BPE)
    assert again.sha256 == clean.sha256


# ---------------------------------------------------------------- holding documents out


def _documents(tmp_path, n: int = 400) -> tuple[Path, list[str]]:
    """n documents of one line each, as a .jsonl file."""
    rows = [f"document {i}: " + _code(1, seed=i).strip() for i in range(n)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows), encoding="utf-8")
    return path, rows


def _text_of(split) -> str:
    return split.numpy().astype(np.uint8).tobytes().decode()


def test_hash_holdout_keeps_a_fixed_share_of_documents_whatever_their_order(tmp_path):
    path, rows = _documents(tmp_path)
    byte = TokenizerConfig(kind="byte")
    corpus = load_corpus(_config(tmp_path, [path], holdout="hash", val_fraction=0.2), byte)
    share = DataConfig(holdout="hash", val_fraction=0.2)
    expected = [(i, r) for i, r in enumerate(rows) if held_out(r.encode(), i, share)]
    assert 0.12 < len(expected) / len(rows) < 0.28
    # each document with the separator before it (none before the first): the splits together are the corpus text
    assert _text_of(corpus.val) == "".join(("\n" if i else "") + r for i, r in expected)
    assert corpus.n_bytes == len("\n".join(rows).encode()) == len(corpus.train) + len(corpus.val)
    shuffled = tmp_path / "shuffled.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    random.Random(0).shuffle(lines)
    shuffled.write_text("".join(lines))
    other = load_corpus(_config(tmp_path, [shuffled], holdout="hash", val_fraction=0.2), byte)
    assert sorted(filter(None, _text_of(other.val).split("\n"))) == sorted(r for _, r in expected)


def test_first_holdout_holds_out_the_first_documents(tmp_path):
    path, rows = _documents(tmp_path, 50)
    corpus = load_corpus(_config(tmp_path, [path], holdout="first", val_docs=7), TokenizerConfig(kind="byte"))
    assert _text_of(corpus.val) == "\n".join(rows[:7])
    assert _text_of(corpus.train) == "\n" + "\n".join(rows[7:])


def test_a_dataset_built_in_memory_streams_into_shards(tmp_path):
    import datasets

    rows = [f"row {i} ünï " + "x" * (i % 17) for i in range(300)]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "saved"))
    for streaming in (False, True):
        cfg = DataConfig(source="hf", name=str(tmp_path / "saved"), holdout="first", val_docs=30, streaming=streaming,
                         cache_dir=str(tmp_path / "c"))  # a stream needs no data.max_bytes when held out as it comes
        corpus = load_corpus(cfg, BPE)
        decode = corpus.tokenizer.decode
        assert decode(corpus.val.numpy().tolist()) == "\n".join(rows[:30])
        assert decode(corpus.train.numpy().tolist()) == "\n" + "\n".join(rows[30:])
    assert not list((tmp_path / "c").glob("hf-*.bin")), "documents held out as they come need no byte cache"


# ---------------------------------------------------------------- text that is not UTF-8


def test_text_that_is_not_utf8_is_refused_before_anything_is_cached(tmp_path):
    paths = [tmp_path / "bin.dat", tmp_path / "bin2.dat"]
    for seed, path in enumerate(paths):
        path.write_bytes(random.Random(seed).randbytes(20_000))
    for holdout in ("tail", "hash", "first"):
        cfg = _config(tmp_path, paths, holdout=holdout, val_fraction=0.5, val_docs=1 if holdout == "first" else 1000)
        with pytest.raises(DataError) as caught:
            load_corpus(cfg, BPE)
        message = str(caught.value)
        assert "\n" not in message and "is not UTF-8: the byte 0x" in message and "data.not_utf8=replace" in message
    assert {p.suffix for p in (tmp_path / "c").iterdir()} == {".lock"}, "nothing but the locks is left"


def test_replaced_bytes_count_as_the_bytes_they_stand_for(tmp_path):
    """data.not_utf8=replace: the validation tokens' bytes, with each U+FFFD counted as the one byte 0xff it stands
    for, add up to the validation text's own bytes; and the held-out windows count the corrections they hold."""
    text = "".join(random.Random(3).choice("abc def\n") for _ in range(120_000)).encode()
    raw = bytearray(text)
    for spot in sorted(random.Random(2).sample(range(len(text)), 400), reverse=True):
        raw[spot:spot] = b"\xff"
    path = tmp_path / "latin.txt"
    path.write_bytes(bytes(raw))
    corpus = load_corpus(_config(tmp_path, [path], not_utf8="replace"), BPE)
    cut = len(raw) - int(len(raw) * 0.1)
    val_ids = corpus.val.numpy().astype(np.int64)
    corrections = corpus.val_corrections
    assert len(corrections) == bytes(raw[cut:]).count(b"\xff") > 10
    assert int(corpus.tokenizer.token_bytes[val_ids].sum()) + int(corrections[:, 1].sum()) == len(raw) - cut
    assert all("\ufffd" in corpus.tokenizer.decode(val_ids[max(0, p - 2): p + 1].tolist()) for p, _ in corrections)
    generator, expected = torch.Generator().manual_seed(1234), 0
    for _ in range(5):
        starts = torch.randint(0, len(val_ids) - 64, (8,), generator=generator).tolist()
        expected += sum(int(d) for p, d in corrections for s in starts if s < p <= s + 64)
    assert corpus.held_out_correction(5, 8, 64) == expected < 0
    with pytest.raises(DataError, match="is not UTF-8"):
        load_corpus(_config(tmp_path, [path], cache="refused"), BPE)


# ---------------------------------------------------------------- the cache


def test_a_damaged_cache_entry_is_reported_once(tmp_path, caplog):
    path = tmp_path / "a.txt"
    path.write_bytes(b"0123456789" * 50)
    cfg = _config(tmp_path, [path])
    load_corpus(cfg)
    (bin_path,) = (tmp_path / "c").glob("text-*.bin")
    bin_path.write_bytes(b"X" * 500)
    with caplog.at_level(logging.WARNING, logger="normlab.data.cache"):
        load_corpus(cfg)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert len(caplog.records) == 1 and "rebuilding" in caplog.records[0].getMessage()


def test_progress_shows_bytes_and_speed_only_when_asked(tmp_path, capfd):
    path = tmp_path / "code.txt"
    path.write_bytes(_code(500).encode())
    load_corpus(_config(tmp_path, [path], cache="quiet"), BPE)
    assert capfd.readouterr().err == ""
    load_corpus(_config(tmp_path, [path], cache="shown"), BPE, progress=True)
    err = capfd.readouterr().err
    assert "tokenizing text:" in err and "B/s" in err and "100%" in err


def test_the_train_command_refuses_random_bytes_under_a_bpe_and_writes_nothing(tmp_path):
    from cli_here import normlab_here

    (tmp_path / "bin.dat").write_bytes(random.Random(1).randbytes(200_000))
    result = normlab_here("train", "model=tiny", "max_steps=20", "data=text", "data.files=[bin.dat]", "tokenizer=bpe",
                          "tokenizer.vocab_size=300", "wandb.mode=disabled", cwd=tmp_path,
                          env={"NORMLAB_CACHE": str(tmp_path / "cache")})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("normlab: error: text:bin.dat is not UTF-8: the byte 0x")
    assert not list(tmp_path.rglob("summary.json")) and not list(tmp_path.rglob("*.json"))
    assert {p.suffix for p in (tmp_path / "cache").iterdir()} == {".lock"}


TWO_AT_ONCE = """
import logging, sys, time
from normlab.config import DataConfig, TokenizerConfig
from normlab.data import load_corpus

logging.basicConfig(level=logging.INFO, format="%(message)s")
while time.time() < float(sys.argv[3]):  # both start encoding at the same moment
    time.sleep(0.01)
corpus = load_corpus(DataConfig(source="text", files=[sys.argv[1]], cache_dir=sys.argv[2], workers=1),
                     TokenizerConfig(kind="bpe", vocab_size=300))
print(corpus.sha256)
"""


def test_two_jobs_at_once_prepare_a_corpus_once(tmp_path):
    path = tmp_path / "code.txt"
    path.write_bytes(_code(20_000).encode())
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TWO_AT_ONCE))
    start = str(__import__("time").time() + 8)  # after both have imported torch
    jobs = [subprocess.Popen([sys.executable, str(script), str(path), str(tmp_path / "c"), start],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [job.communicate(timeout=300) for job in jobs]
    assert all(job.returncode == 0 for job in jobs), [err[-2000:] for _, err in outs]
    assert outs[0][0] == outs[1][0]
    assert sum(err.count("encoding text:") for _, err in outs) == 1, [err for _, err in outs]


def test_the_benchmark_script_prints_every_figure(tmp_path):
    """scripts/bench/data_prep.py at a tiny size: each line holds its figures, and every encoding gave the same ids."""
    result = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "bench" / "data_prep.py"),
                             "--gb", "0.0005", "--old-max-gb", "0.0005", "--windows-gb", "0.001", "--vocab", "300",
                             "--batch-size", "4", "--seq-len", "64", "--window-seconds", "0.5", "--work", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    number = r"\d[\d,.]*"
    assert any(re.match(rf"prepare 0.5 MB, .*: {number} s \({number} CPU-s\), peak tree RSS {number} GB \(PSS {number} GB\)", l)
               for l in lines), result.stdout
    encoded = [l for l in lines if l.startswith("encode 0.5 MB") and "(no tokens)" not in l]
    assert len(encoded) == 3 and all(re.search(rf"{number} MB/s, .* {number} CPU-s/GB", l) for l in encoded)
    assert len({l.rsplit("sha256 ", 1)[1] for l in encoded}) == 1, "every way gave the same ids"
    assert re.search(rf"windows from 0.001 GB .*: {number}M tokens/s", result.stdout)
