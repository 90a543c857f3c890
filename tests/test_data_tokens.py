"""data=tokens (normlab.data.tokens, .shards) and `normlab prepare`: llm.c and nanoGPT files read back token for
token, windows across shards, bits per byte without the text, every bad input in one line, and a run on shards
that trains as the run on the text they were made from."""

import json
import shlex

import numpy as np
import pytest
import torch
from tokenizers import AddedToken

from cli_here import normlab_here
from conftest import tiny_config
from normlab.config import ConfigError, DataConfig, RunConfig, TokenizerConfig
from normlab.data import DataError, load_corpus, sample_batch
from normlab.data import tokens as tokens_module
from normlab.data.shards import HEADER_BYTES, TokenShards, header
from normlab.data.tokenizer import train_bpe
from normlab.data.tokens import boundary_bytes
from normlab.train.run import train

TEXT = "".join(f"def f_{i % 13}(x):\n    return x * {i} + 1  # ünï {i}\n" for i in range(2000))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A byte-level BPE of 300 ids, saved as a tokenizer.json (what tokenizer=hf tokenizer.name=PATH reads)."""
    folder = tmp_path_factory.mktemp("tok")
    tok = train_bpe(TEXT.encode(), 300, folder)
    tok.save(folder / "tokenizer.json")
    return folder / "tokenizer.json"


def llmc(path, ids, dtype="<u2"):
    """A shard as llm.c's dev/data/data_common.py writes one: 256 int32 (magic, version, count), then the ids."""
    ids = np.asarray(ids, dtype=dtype)
    path.write_bytes(header(np.dtype(dtype), len(ids)) + ids.tobytes())
    return path


def tokens_config(tmp_path, train, val, tokenizer_file, **keys) -> tuple[DataConfig, TokenizerConfig]:
    data = DataConfig(source="tokens", train=[str(p) for p in train], val=[str(p) for p in val],
                      cache_dir=str(tmp_path / "cache"), **keys)
    return data, TokenizerConfig(kind="hf", name=str(tokenizer_file))


def test_an_llmc_shard_and_a_nanogpt_array_read_back_token_for_token(tmp_path, tokenizer_file):
    rng = np.random.default_rng(0)
    a, b, v = (rng.integers(0, 300, n) for n in (1000, 777, 500))
    train = [llmc(tmp_path / "fineweb_train_000001.bin", a), llmc(tmp_path / "fineweb_train_000002.bin", b, "<u4")]
    np.asarray(v, dtype=np.uint16).tofile(tmp_path / "val.bin")  # nanoGPT's prepare.py writes a raw uint16 array
    (tmp_path / "val.bin.json").write_text(json.dumps({"dtype": "uint16"}))  # its dtype in a sidecar
    data, tok = tokens_config(tmp_path, [tmp_path / "fineweb_train_*.bin"], [tmp_path / "val.bin"], tokenizer_file)
    corpus = load_corpus(data, tok, seq_len=64)
    assert [s.dtype.name for s in corpus.train.shards] == ["uint16", "uint32"]
    assert np.array_equal(corpus.train.numpy(), np.concatenate([a, b])) and np.array_equal(corpus.val.numpy(), v)
    assert corpus.vocab_size == 300 and corpus.source.startswith("tokens:")
    assert all(isinstance(s, np.memmap) for s in corpus.train.shards), "shards are mapped, never read whole"
    (tmp_path / "val.bin.json").unlink()  # or data.dtype says it, for the raw arrays (a header says its own)
    data, tok = tokens_config(tmp_path, [train[0]], [tmp_path / "val.bin"], tokenizer_file, dtype="uint16")
    assert np.array_equal(load_corpus(data, tok, seq_len=64).val.numpy(), v)


def test_windows_run_across_shards_as_across_one_array():
    ids = torch.randint(0, 50000, (10_000,), generator=torch.Generator().manual_seed(0)).to(torch.int32).numpy()
    cuts = [0, 1, 40, 3000, 3001, 9000, 10_000]
    shards = TokenShards([ids[a:b].astype(np.uint16) for a, b in zip(cuts, cuts[1:])])
    for seq_len in (1, 63, 5000, 9999):
        one = sample_batch(torch.from_numpy(ids.astype(np.int64)), 16, seq_len, torch.Generator().manual_seed(3))
        many = sample_batch(shards, 16, seq_len, torch.Generator().manual_seed(3))
        assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_bits_per_byte_counts_a_special_token_as_one_byte(tmp_path, tokenizer_file):
    """<|endoftext|> before each document, as llm.c's shards have it: a boundary, counted as one byte (normlab's
    own corpora separate documents with a newline); every other id counts its bytes."""
    from normlab.data.tokenizer import from_file

    tok = from_file(tokenizer_file)
    tok.backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(tmp_path / "with_eot.json")
    with_eot = from_file(tmp_path / "with_eot.json")
    eot = with_eot.backend.token_to_id("<|endoftext|>")
    assert with_eot.token_bytes[eot] == len("<|endoftext|>") and boundary_bytes(with_eot)[eot] == 1
    docs = [with_eot.encode(f"document {i} ünï\n") for i in range(40)]
    stream = np.concatenate([np.concatenate([[eot], d]) for d in docs]).astype(np.uint16)
    llmc(tmp_path / "train.bin", stream[:600])
    llmc(tmp_path / "val.bin", stream[600:])
    data, _ = tokens_config(tmp_path, [tmp_path / "train.bin"], [tmp_path / "val.bin"], tokenizer_file)
    corpus = load_corpus(data, TokenizerConfig(kind="hf", name=str(tmp_path / "with_eot.json")))
    text = "".join(f"document {i} ünï\n" for i in range(40))
    assert corpus.n_bytes == len(text.encode()) + 40
    assert int(corpus.token_bytes[torch.from_numpy(stream.astype(np.int64))].sum()) == corpus.n_bytes


def test_the_check_reads_the_ids_once_and_keeps_what_it_found(tmp_path, tokenizer_file, monkeypatch):
    llmc(tmp_path / "train.bin", np.arange(1000) % 300)
    llmc(tmp_path / "val.bin", np.arange(200) % 300)
    data, tok = tokens_config(tmp_path, [tmp_path / "train.bin"], [tmp_path / "val.bin"], tokenizer_file)
    first = load_corpus(data, tok)
    monkeypatch.setattr(tokens_module, "_read_ids", lambda *a: pytest.fail("the ids were read again"))
    again = load_corpus(data, tok)
    assert again.sha256 == first.sha256 and again.n_bytes == first.n_bytes
    llmc(tmp_path / "val.bin", np.arange(201) % 300)  # another file: read again
    with pytest.raises(pytest.fail.Exception, match="read again"):
        load_corpus(data, tok)


@pytest.mark.parametrize("make, keys, fragments", [
    (lambda p: p.write_bytes(np.array([20240520, 3, 10], "<i4").tobytes() + bytes(1012 + 20)), {},
     ["has magic 20240520 and version 3", "normlab reads magic 20240520 version 1"]),
    (lambda p: p.write_bytes(header(np.dtype("<u2"), 1000) + bytes(1990)), {},
     ["header says 1000 tokens (2000 bytes), the file holds 1990 bytes", "truncated"]),
    (lambda p: p.write_bytes(bytes(4000)), {}, ["has no llm.c header (its first int32 is 0", "data.dtype=uint16"]),
    (lambda p: p.write_bytes(bytes(4001)), {"dtype": "uint16"}, ["holds 4001 bytes, not a whole number of uint16 ids"]),
    (lambda p: llmc(p, [5] * 500 + [300] + [7] * 500), {}, ["holds the id 300, at or above the vocabulary of 300 ids"]),
    (lambda p: llmc(p, [5] * 64), {}, ["holds 64 tokens, fewer than seq_len + 1 = 65"]),
])
def test_bad_shards_are_refused_in_one_line(tmp_path, tokenizer_file, make, keys, fragments):
    make(tmp_path / "bad.bin")
    llmc(tmp_path / "val.bin", np.arange(500) % 300)
    data, tok = tokens_config(tmp_path, [tmp_path / "bad.bin"], [tmp_path / "val.bin"], tokenizer_file, **keys)
    with pytest.raises(DataError) as caught:
        load_corpus(data, tok, seq_len=64)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"data.train: {tmp_path / 'bad.bin'}")
    for fragment in fragments:
        assert fragment in message, message


def test_globs_that_match_nothing_overlap_or_repeat_are_refused(tmp_path, tokenizer_file):
    for name in ("a.bin", "b.bin"):
        llmc(tmp_path / name, np.arange(500) % 300)
    cases = [([tmp_path / "*.bin"], [tmp_path / "b.bin"], "data.train and data.val both name"),
             ([tmp_path / "nope_*.bin"], [tmp_path / "b.bin"], "data.train: '"),
             ([tmp_path / "a.bin", tmp_path / "a.bin"], [tmp_path / "b.bin"], "data.train names"),
             ([tmp_path / "a.bin"], [tmp_path / "missing.bin"], "data.val: '")]
    for train, val, fragment in cases:
        data, tok = tokens_config(tmp_path, train, val, tokenizer_file)
        with pytest.raises(DataError, match=fragment.replace("*", r"\*")):
            load_corpus(data, tok)


def test_the_config_says_what_data_tokens_needs():
    cases = [({"data": {"source": "tokens"}}, "data.train is empty"),
             ({"data": {"source": "tokens", "train": ["a"], "val": ["b"]}, "tokenizer": {"kind": "bpe"}},
              "tokenizer=bpe with data=tokens"),
             ({"data": {"train": ["a.bin"]}}, "data.train is set, but data=stdlib does not read it"),
             ({"data": {"source": "tokens", "train": ["a"], "val": ["b"], "max_bytes": 10}},
              "data.max_bytes is set, but data=tokens does not read it"),
             ({"data": {"source": "tokens", "train": ["a"], "val": ["b"], "dtype": "int8"}},
              "data.dtype='int8' is not allowed: choose one of uint16, uint32"),
             ({"data": {"val_docs": 5}}, "data.val_docs is set, but data.holdout=tail does not read it"),
             ({"data": {"holdout": "random"}}, "data.holdout='random' is not allowed: choose one of tail, hash, first"),
             ({"data": {"workers": 0}}, "data.workers=0: must be an integer >= 1")]
    for keys, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            RunConfig.from_dict(keys)
    RunConfig.from_dict({"data": {"source": "tokens", "train": ["a"], "val": ["b"], "dtype": "uint16"},
                         "tokenizer": {"kind": "hf", "name": "gpt2"}})


def test_the_train_command_refuses_bad_shards_in_one_line_and_leaves_no_run_dir(tmp_path, tokenizer_file):
    llmc(tmp_path / "val.bin", np.arange(500) % 300)
    result = normlab_here("train", "data=tokens", "data.train=[nothing_*.bin]", "data.val=[val.bin]", "tokenizer=hf",
                          f"tokenizer.name={tokenizer_file}", "model=tiny", "max_steps=1", "progress=false",
                          "wandb.mode=disabled", cwd=tmp_path, env={"NORMLAB_CACHE": str(tmp_path / "cache")})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0] == "normlab: error: data.train: 'nothing_*.bin' matches no file"
    assert not list(tmp_path.rglob("summary.json"))


def test_a_run_on_shards_trains_as_the_run_on_their_text(tmp_path, tokenizer_file):
    """`normlab prepare` a text corpus, then train once on the text and once on its shards (data=tokens, as the
    command prints it): the same batches, so the same losses and bits per byte."""
    (tmp_path / "code.txt").write_text(TEXT * 3, encoding="utf-8")
    env = {"NORMLAB_CACHE": str(tmp_path / "cache")}
    text_keys = ["data=text", f"data.files=[{tmp_path / 'code.txt'}]", "tokenizer=bpe", "tokenizer.vocab_size=300"]
    prepared = normlab_here("prepare", *text_keys, "progress=false", cwd=tmp_path, env=env)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    lines = prepared.stdout.splitlines()
    assert lines[2] == "train on them: normlab train " + shlex.join([*text_keys, "progress=false"])
    folder = tmp_path.joinpath("cache").glob("tokens-*[0-9a-f]").__next__()
    assert lines[3].startswith("or as token shards: normlab train data=tokens ") and str(folder) in lines[3]
    again = normlab_here("prepare", *text_keys, "progress=false", cwd=tmp_path, env=env)
    assert again.stdout == prepared.stdout
    results = []
    for data, tok in [(DataConfig(source="text", files=[str(tmp_path / "code.txt")], cache_dir=str(tmp_path / "cache")),
                       TokenizerConfig(kind="bpe", vocab_size=300)),
                      (DataConfig(source="tokens", train=[f"{folder}/train-*.bin"], val=[f"{folder}/val-*.bin"],
                                  cache_dir=str(tmp_path / "cache")),
                       TokenizerConfig(kind="hf", name=str(folder / "tokenizer.json")))]:
        cfg = tiny_config(data=data, tokenizer=tok, sinks=[])
        results.append(train(cfg, tmp_path / f"run-{data.source}"))
    assert results[0]["final_val_loss"] == results[1]["final_val_loss"]
    assert results[0]["final_val_bpb"] == results[1]["final_val_bpb"]
    saved = tmp_path / "run-tokens" / "tokenizer.json"  # what `normlab sample` decodes with
    assert saved.read_text() == (folder / "tokenizer.json").read_text()


def test_prepare_refuses_options_and_bad_overrides_in_one_line(tmp_path):
    for args, fragment in ((["-m", "lr=1e-3,3e-3"], "prepare: -m: prepare takes the overrides of one run"),
                           (["nrom=rms"], "did you mean norm=rms?")):
        result = normlab_here("prepare", *args, cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and fragment in result.stderr
    assert HEADER_BYTES == 1024


def test_a_run_on_shards_resumes_exactly(tmp_path, tokenizer_file, one_thread):
    """Stopped by a signal and resumed, a run on several shards logs the rows of the run that went through: the
    generator that draws its windows across shards is restored from the checkpoint."""
    import os
    import signal

    from normlab.train import preempt
    from normlab.train.sinks import MetricsFile, RunDir, Sink

    ids = np.random.default_rng(1).integers(0, 300, 3000)
    train_shards = [llmc(tmp_path / f"train_{i}.bin", part) for i, part in enumerate(np.array_split(ids[:2400], 3))]
    llmc(tmp_path / "val.bin", ids[2400:])

    class StopAt(Sink):
        def log(self, record):
            if record["step"] == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    def config():
        data, tok = tokens_config(tmp_path, train_shards, [tmp_path / "val.bin"], tokenizer_file)
        cfg = tiny_config(data=data, tokenizer=tok, max_steps=8, eval_every=3, log_every=1, sinks=["jsonl"])
        cfg.wandb.mode, cfg.ckpt.every = "disabled", 3
        return cfg

    def rows(path):
        drop = {"tokens_per_s", "train_time_s", "wall_time_s", "eval_time_s"}
        return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in (path / "metrics.jsonl").open()]

    train(config(), tmp_path / "whole")
    cut = RunDir(tmp_path / "cut")
    with preempt.watch():
        with pytest.raises(preempt.Preempted):
            train(config(), cut, sinks=[MetricsFile(cut), StopAt()])
    resumed = config()
    resumed.resume = "auto"
    assert train(resumed, cut)["resumed_from_step"] == 4
    whole = rows(tmp_path / "whole")
    assert [r["step"] for r in whole] == list(range(9)) and rows(cut.path) == whole


def test_shards_hold_uint16_ids_while_the_vocabulary_fits_and_uint32_past_it(tmp_path):
    from normlab.data.shards import read_shard, shard_dtype

    assert shard_dtype(65_536) == np.dtype("<u2") and shard_dtype(65_537) == np.dtype("<u4")
    ids = np.array([0, 65_535, 65_536, 128_255], dtype="<u4")
    path = tmp_path / "llama3.bin"
    path.write_bytes(header(shard_dtype(128_256), len(ids)) + ids.tobytes())
    assert np.frombuffer(path.read_bytes()[:12], "<i4").tolist() == [20240801, 7, 4]  # llm.c's uint32 header
    assert read_shard(path).tolist() == ids.tolist()
