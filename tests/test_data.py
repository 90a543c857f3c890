"""Tests for normlab.data: sources, cache, split, batch sampling, and the offline hub path."""

import hashlib
import json
import os
import socket
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from normlab.config import ConfigError, DataConfig, RunConfig
from normlab.data import Corpus, DataError, eval_batches, load_corpus, sample_batch, stdlib_files
from normlab.data import cache as token_cache
from normlab.data import hf, sources


def corpus_bytes(corpus: Corpus) -> bytes:
    return corpus.train.numpy().tobytes() + corpus.val.numpy().tobytes()


def fail_if_called(*args, **kwargs):
    raise AssertionError("the source was tokenized again although its cache entry exists")


# ---------------------------------------------------------------- stdlib source


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory):
    """One cold build of the real stdlib corpus, shared by the tests that only read it."""
    cache = tmp_path_factory.mktemp("stdlib-cache")
    return load_corpus(DataConfig(source="stdlib", cache_dir=str(cache))), cache


def test_stdlib_corpus_is_the_joined_stdlib_files(stdlib_corpus):
    corpus, _ = stdlib_corpus
    root = Path(sysconfig.get_paths()["stdlib"])
    names = stdlib_files()
    assert len(names) > 500
    assert corpus.vocab_size == 256
    assert corpus.train.dtype == np.uint8 and corpus.val.dtype == np.uint8
    assert corpus.train.numpy().ndim == 1 and corpus.val.numpy().ndim == 1
    assert corpus.source == f"stdlib:{root}"
    expected_size = sum((root / n).stat().st_size for n in names) + len(names) - 1
    assert corpus.n_bytes == expected_size == len(corpus.train) + len(corpus.val)
    stream = corpus_bytes(corpus)
    assert corpus.sha256 == hashlib.sha256(stream).hexdigest()
    first, second = (root / names[0]).read_bytes(), (root / names[1]).read_bytes()
    assert stream.startswith(first + b"\n" + second)
    assert stream.endswith((root / names[-1]).read_bytes())


def test_stdlib_val_is_the_tail_of_the_right_size(stdlib_corpus):
    corpus, _ = stdlib_corpus
    assert len(corpus.val) == int(corpus.n_bytes * 0.1)
    last = (Path(sysconfig.get_paths()["stdlib"]) / stdlib_files()[-1]).read_bytes()
    tail = min(len(last), 1000)
    assert corpus.val.numpy().tobytes()[-tail:] == last[-tail:]
    assert len(corpus.train) == corpus.n_bytes - len(corpus.val)


def _one_tensor_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """A batch as drawn from one tensor by indexing, written out here so that it does not go through TokenShards."""
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    index = starts[:, None] + torch.arange(seq_len)
    return tokens[index].long(), tokens[index + 1].long()


def test_the_main_jobs_corpus_gives_the_batches_of_its_bytes_in_one_tensor(stdlib_corpus):
    """The main job (stdlib, byte tokenizer): its tokens are the stdlib files' bytes joined by newlines, cut 10%
    before the end, and the training and held-out batches drawn from the cached splits are those drawn from the
    same bytes held in one tensor each, at the same generator state."""
    corpus, _ = stdlib_corpus
    root = Path(sysconfig.get_paths()["stdlib"])
    joined = b"\n".join((root / name).read_bytes() for name in stdlib_files())
    cut = len(joined) - int(len(joined) * 0.1)
    train = torch.frombuffer(bytearray(joined[:cut]), dtype=torch.uint8)
    val = torch.frombuffer(bytearray(joined[cut:]), dtype=torch.uint8)
    assert np.array_equal(corpus.train.numpy(), train.numpy()) and np.array_equal(corpus.val.numpy(), val.numpy())
    for seed in (0, 1):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(3):
            x, y = sample_batch(corpus.train, 16, 256, ours)
            tx, ty = _one_tensor_batch(train, 16, 256, theirs)
            assert torch.equal(x, tx) and torch.equal(y, ty)
    fixed = torch.Generator().manual_seed(1234)  # eval_batches' default seed
    for x, y in eval_batches(corpus.val, 4, 16, 256):
        tx, ty = _one_tensor_batch(val, 16, 256, fixed)
        assert torch.equal(x, tx) and torch.equal(y, ty)


def test_stdlib_files_are_sorted_and_skip_installed_packages():
    names = stdlib_files()
    assert names == sorted(names)
    assert all(n.endswith(".py") for n in names)
    assert not any({"site-packages", "dist-packages"} & set(n.split("/")) for n in names)
    root = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    if purelib.is_relative_to(root) and any(purelib.rglob("*.py")):
        # On this layout the exclusion is what keeps pip-installed code out of the corpus.
        assert not any(n.startswith(purelib.relative_to(root).as_posix() + "/") for n in names)


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    root = tmp_path / "lib" / "python3.x"
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages" / "evil").mkdir(parents=True)
    (root / "pkg" / "dist-packages").mkdir()
    (root / "zeta.py").write_bytes(b"z = 1\n")
    (root / "abc.py").write_bytes(b"a = 1\n")
    (root / "pkg" / "mod.py").write_bytes(b"m = 2\n")
    (root / "pkg" / "notes.txt").write_bytes(b"not python\n")
    (root / "site-packages" / "installed.py").write_bytes(b"EVIL = 1\n")
    (root / "site-packages" / "evil" / "deep.py").write_bytes(b"EVIL = 2\n")
    (root / "pkg" / "dist-packages" / "debian.py").write_bytes(b"EVIL = 3\n")
    monkeypatch.setattr(sources, "_stdlib_root", lambda: root)
    return root


def test_stdlib_source_on_a_fake_tree(fake_stdlib, tmp_path):
    assert stdlib_files() == ["abc.py", "pkg/mod.py", "zeta.py"]
    corpus = load_corpus(DataConfig(source="stdlib", cache_dir=str(tmp_path / "cache"), val_fraction=0.25))
    assert corpus_bytes(corpus) == b"a = 1\n\nm = 2\n\nz = 1\n"
    assert b"EVIL" not in corpus_bytes(corpus)
    assert corpus.val.numpy().tobytes() == b" = 1\n"  # the last int(20 * 0.25) bytes


def test_stdlib_cache_key_follows_file_changes(fake_stdlib, tmp_path):
    cfg = DataConfig(source="stdlib", cache_dir=str(tmp_path / "cache"))
    load_corpus(cfg)
    (fake_stdlib / "pkg" / "new.py").write_bytes(b"n = 3\n")
    assert b"n = 3" in corpus_bytes(load_corpus(cfg))
    assert len(list((tmp_path / "cache").glob("stdlib-*.json"))) == 2


# ---------------------------------------------------------------- cache


def test_second_load_is_a_cache_hit(stdlib_corpus, monkeypatch):
    first, cache = stdlib_corpus
    monkeypatch.setattr(token_cache, "_write_tokens", fail_if_called)
    again = load_corpus(DataConfig(source="stdlib", cache_dir=str(cache)))
    assert np.array_equal(again.train.numpy(), first.train.numpy()) and np.array_equal(again.val.numpy(), first.val.numpy())
    assert again.sha256 == first.sha256 and again.n_bytes == first.n_bytes


def test_cache_entry_layout(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world\n" * 10)
    cache = tmp_path / "cache"
    corpus = load_corpus(DataConfig(source="text", files=[str(f)], cache_dir=str(cache)))
    (meta_path,) = cache.glob("text-*.json")
    meta = json.loads(meta_path.read_text())
    bin_path = meta_path.with_suffix(".bin")
    assert meta["tokenizer"] == "bytes-v1" and meta["n_bytes"] == corpus.n_bytes == 120
    assert meta["sha256"] == corpus.sha256 == hashlib.sha256(bin_path.read_bytes()).hexdigest()
    assert not list(cache.glob("*.tmp")), "temporary files must not outlive a build"


def test_normlab_cache_env_is_the_default_cache_dir(tmp_path, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_bytes(b"0123456789")
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "env-cache"))
    load_corpus(DataConfig(source="text", files=[str(f)]))
    assert len(list((tmp_path / "env-cache").glob("text-*.bin"))) == 1
    load_corpus(DataConfig(source="text", files=[str(f)], cache_dir=str(tmp_path / "explicit")))
    assert len(list((tmp_path / "explicit").glob("text-*.bin"))) == 1


def test_unusable_cache_dir_is_a_data_error(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"0123456789")
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"a file where the cache directory should go")
    with pytest.raises(DataError, match="cache"):
        load_corpus(DataConfig(source="text", files=[str(f)], cache_dir=str(blocker / "cache")))


def test_cache_key_changes_when_a_text_file_changes(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"aaaaaaaaaa")
    cfg = DataConfig(source="text", files=[str(f)], cache_dir=str(tmp_path / "cache"))
    assert corpus_bytes(load_corpus(cfg)) == b"aaaaaaaaaa"
    # Same size, later mtime: only the mtime tells the cache that the content is new.
    before = f.stat().st_mtime_ns
    f.write_bytes(b"bbbbbbbbbb")
    os.utime(f, ns=(before + 10**9, before + 10**9))
    assert corpus_bytes(load_corpus(cfg)) == b"bbbbbbbbbb"


def test_damaged_cache_entry_is_rebuilt(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"0123456789" * 5)
    cfg = DataConfig(source="text", files=[str(f)], cache_dir=str(tmp_path / "cache"))
    good = load_corpus(cfg)
    (bin_path,) = (tmp_path / "cache").glob("text-*.bin")
    bin_path.write_bytes(b"X" * 50)
    again = load_corpus(cfg)
    assert corpus_bytes(again) == b"0123456789" * 5 and again.sha256 == good.sha256


# ---------------------------------------------------------------- text source


def test_text_files_are_joined_in_order_with_a_newline(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes("first file, ünïcode\r\n".encode())
    b.write_bytes(b"second file")
    corpus = load_corpus(DataConfig(source="text", files=[str(b), str(a)], cache_dir=str(tmp_path / "c")))
    expected = b.read_bytes() + b"\n" + a.read_bytes()
    assert corpus_bytes(corpus) == expected
    assert corpus.n_bytes == len(expected)
    assert corpus.sha256 == hashlib.sha256(expected).hexdigest()
    assert corpus.source == f"text:{b},{a}"


def test_missing_text_file_names_it(tmp_path):
    present = tmp_path / "present.txt"
    present.write_bytes(b"some text here")
    missing = tmp_path / "nope" / "missing.txt"
    with pytest.raises(DataError, match="missing.txt"):
        load_corpus(DataConfig(source="text", files=[str(present), str(missing)], cache_dir=str(tmp_path / "c")))


def test_empty_corpus_is_a_data_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        load_corpus(DataConfig(source="text", files=[str(empty)], cache_dir=str(tmp_path / "c")))


# ---------------------------------------------------------------- hf source


def test_hf_offline_flags_fail_fast_with_one_line(tmp_path, monkeypatch):
    import datasets  # noqa: F401  (import cost is paid before the clock starts: it is not a hang)

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(DataError) as caught:
        load_corpus(DataConfig(source="hf", name="surely/not-cached-xyz", cache_dir=str(tmp_path)))
    assert time.monotonic() - t0 < 5.0  # a network attempt takes 10 s or more; 5 s leaves room for a loaded CPU
    message = str(caught.value)
    assert "surely/not-cached-xyz" in message and "offline" in message and "\n" not in message


def test_hf_unreachable_hub_falls_back_to_cache_and_fails_fast(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    probes = []
    monkeypatch.setattr(hf, "_hub_reachable", lambda: probes.append(1) or False)
    t0 = time.monotonic()
    with pytest.raises(DataError) as caught:
        load_corpus(DataConfig(source="hf", name="surely/not-cached-xyz", cache_dir=str(tmp_path)))
    assert time.monotonic() - t0 < 5.0  # a network attempt takes 10 s or more; 5 s leaves room for a loaded CPU
    assert probes == [1]
    message = str(caught.value)
    assert "cannot reach the Hugging Face hub" in message and "surely/not-cached-xyz" in message
    assert "\n" not in message
    # The offline switch was only for that one call.
    assert "HF_HUB_OFFLINE" not in os.environ and "HF_DATASETS_OFFLINE" not in os.environ
    assert datasets.config.HF_HUB_OFFLINE is False and huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_hub_probe_tells_open_from_closed_ports(monkeypatch):
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hf._hub_reachable() is True
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    assert hf._hub_reachable() is False
    assert time.monotonic() - t0 < 5.0  # a network attempt takes 10 s or more; 5 s leaves room for a loaded CPU


@pytest.fixture
def local_dataset(tmp_path, monkeypatch):
    """A dataset directory that datasets loads without the hub, with its Arrow cache kept in tmp_path."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    root = tmp_path / "my_dataset"
    root.mkdir()
    rows = [{"text": "hello", "label": 0}, {"text": "wörld", "label": 1}, {"text": "third row", "label": 2}]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


def test_hf_local_dataset_rows_become_documents(local_dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(hf, "_hub_reachable", fail_if_called)
    corpus = load_corpus(DataConfig(source="hf", name=str(local_dataset), cache_dir=str(tmp_path / "c")))
    assert corpus_bytes(corpus) == "hello\nwörld\nthird row".encode()
    assert corpus.source == f"hf:{local_dataset}/train"


def test_hf_missing_column_lists_the_available_ones(local_dataset, tmp_path):
    with pytest.raises(DataError, match="no column 'body'.*text, label"):
        load_corpus(DataConfig(source="hf", name=str(local_dataset), text_field="body", cache_dir=str(tmp_path / "c")))


def test_hf_non_text_column_is_rejected(local_dataset, tmp_path):
    with pytest.raises(DataError, match="not text"):
        load_corpus(DataConfig(source="hf", name=str(local_dataset), text_field="label", cache_dir=str(tmp_path / "c")))


def test_hf_local_dataset_uses_its_own_validation_split(local_dataset, tmp_path):
    rows = [{"text": "held out one"}, {"text": "held out two"}]
    (local_dataset / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    corpus = load_corpus(DataConfig(source="hf", name=str(local_dataset), cache_dir=str(tmp_path / "c")))
    assert corpus.train.numpy().tobytes() == "hello\nwörld\nthird row".encode()
    assert corpus.val.numpy().tobytes() == b"held out one\nheld out two"
    assert corpus.source == f"hf:{local_dataset}/train+validation"
    cut = load_corpus(DataConfig(source="hf", name=str(local_dataset), val_split=None, val_fraction=0.25,
                                 cache_dir=str(tmp_path / "c")))
    assert corpus_bytes(cut) == "hello\nwörld\nthird row".encode() and len(cut.val) == int(cut.n_bytes * 0.25)


# ---------------------------------------------------------------- datasets saved to disk, streaming, jsonl, max_bytes


@pytest.fixture
def saved_dataset(tmp_path):
    """A DatasetDict written with save_to_disk: a train and a validation split."""
    import datasets

    train = datasets.Dataset.from_dict({"text": [f"train row {i} ünï" for i in range(40)], "n": list(range(40))})
    validation = datasets.Dataset.from_dict({"text": ["valid row a", "valid row b"], "n": [0, 1]})
    path = tmp_path / "saved"
    datasets.DatasetDict({"train": train, "validation": validation}).save_to_disk(str(path))
    return path


def _joined(rows: list[str]) -> bytes:
    return "\n".join(rows).encode()


def test_saved_dataset_train_and_validation_splits(saved_dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(hf, "_hub_reachable", fail_if_called)
    corpus = load_corpus(DataConfig(source="hf", name=str(saved_dataset), cache_dir=str(tmp_path / "c")))
    assert corpus.train.numpy().tobytes() == _joined([f"train row {i} ünï" for i in range(40)])
    assert corpus.val.numpy().tobytes() == b"valid row a\nvalid row b"
    assert corpus.n_bytes == len(corpus.train) + len(corpus.val)
    assert corpus.sha256 == hashlib.sha256(corpus_bytes(corpus)).hexdigest()
    again = load_corpus(DataConfig(source="hf", name=str(saved_dataset), val_split="validation", cache_dir=str(tmp_path / "c")))
    assert again.sha256 == corpus.sha256


def test_saved_dataset_missing_split_names_the_ones_it_has(saved_dataset, tmp_path):
    with pytest.raises(DataError, match="data.val_split='test'.*it has train, validation"):
        load_corpus(DataConfig(source="hf", name=str(saved_dataset), val_split="test", cache_dir=str(tmp_path / "c")))


def test_a_single_saved_dataset_is_the_train_split_cut_for_validation(tmp_path):
    import datasets

    rows = [f"row {i}" for i in range(30)]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "one"))
    corpus = load_corpus(DataConfig(source="hf", name=str(tmp_path / "one"), cache_dir=str(tmp_path / "c")))
    assert corpus_bytes(corpus) == _joined(rows) and len(corpus.val) == int(len(_joined(rows)) * 0.1)


def test_streaming_reads_max_bytes_of_each_split(saved_dataset, tmp_path):
    cfg = DataConfig(source="hf", name=str(saved_dataset), streaming=True, max_bytes=100, cache_dir=str(tmp_path / "c"))
    corpus = load_corpus(cfg)
    assert corpus.train.numpy().tobytes() == _joined([f"train row {i} ünï" for i in range(40)])[:100]
    assert corpus.val.numpy().tobytes() == b"valid row a\nvalid row b"
    whole = load_corpus(DataConfig(source="hf", name=str(saved_dataset), cache_dir=str(tmp_path / "c")))
    assert whole.train.numpy().tobytes().startswith(corpus.train.numpy().tobytes())


def test_streaming_without_max_bytes_is_refused_in_one_line(saved_dataset, tmp_path):
    cfg = DataConfig(source="hf", name=str(saved_dataset), streaming=True, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="data.streaming=true needs data.max_bytes") as caught:
        load_corpus(cfg)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="data.streaming=true needs data.max_bytes"):
        RunConfig(data=cfg).validate()
    with pytest.raises(ConfigError, match="only data=hf streams"):
        RunConfig(data=DataConfig(streaming=True, max_bytes=10)).validate()


def test_max_bytes_cuts_a_local_corpus_and_keys_its_cache(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"0123456789" * 10)
    full = load_corpus(DataConfig(source="text", files=[str(path), str(path)], cache_dir=str(tmp_path / "c")))
    cut = load_corpus(DataConfig(source="text", files=[str(path), str(path)], max_bytes=105, cache_dir=str(tmp_path / "c")))
    assert full.n_bytes == 201 and cut.n_bytes == 105
    assert corpus_bytes(cut) == corpus_bytes(full)[:105]
    exact = load_corpus(DataConfig(source="text", files=[str(path), str(path)], max_bytes=101, cache_dir=str(tmp_path / "c")))
    assert corpus_bytes(exact) == path.read_bytes()  # a separator with no document after it is left out


def test_jsonl_files_give_one_document_per_row(tmp_path):
    rows = [{"text": "first row", "id": 1}, {"text": "second ünï row", "id": 2}, {"body": "x", "text": "third"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    plain = tmp_path / "notes.txt"
    plain.write_bytes(b"plain text file")
    corpus = load_corpus(DataConfig(source="text", files=[str(path), str(plain)], cache_dir=str(tmp_path / "c")))
    assert corpus_bytes(corpus) == "first row\nsecond ünï row\nthird\nplain text file".encode()
    with pytest.raises(DataError, match="rows.jsonl:1 has no text field 'body'"):
        load_corpus(DataConfig(source="text", files=[str(path)], text_field="body", cache_dir=str(tmp_path / "e")))


def test_val_split_is_only_for_hub_datasets():
    with pytest.raises(ConfigError, match="data.val_split='validation' with data=stdlib"):
        RunConfig(data=DataConfig(val_split="validation")).validate()
    RunConfig(data=DataConfig(val_split=None)).validate()


# ---------------------------------------------------------------- batches


@pytest.fixture
def tokens():
    return torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def test_sample_batch_windows_match_the_corpus(tokens):
    x, y = sample_batch(tokens, 8, 64, torch.Generator().manual_seed(7))
    assert x.shape == y.shape == (8, 64)
    assert x.dtype == y.dtype == torch.long
    assert x.device.type == "cpu" and x.is_contiguous() and y.is_contiguous()
    starts = torch.randint(0, tokens.numel() - 64, (8,), generator=torch.Generator().manual_seed(7))
    for row, s in enumerate(starts.tolist()):
        assert torch.equal(x[row], tokens[s : s + 64].long())
        assert torch.equal(y[row], tokens[s + 1 : s + 65].long())


def test_sample_batch_can_reach_the_last_token():
    tokens = torch.arange(11, dtype=torch.uint8)
    x, y = sample_batch(tokens, 64, 10, torch.Generator().manual_seed(0))
    assert torch.equal(x[0], torch.arange(10)) and torch.equal(y[0], torch.arange(1, 11))


def test_sample_batch_is_reproducible_per_generator_seed(tokens):
    a = sample_batch(tokens, 4, 32, torch.Generator().manual_seed(3))
    b = sample_batch(tokens, 4, 32, torch.Generator().manual_seed(3))
    c = sample_batch(tokens, 4, 32, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_sample_batch_rejects_a_split_shorter_than_a_window():
    with pytest.raises(DataError, match="seq_len=16"):
        sample_batch(torch.zeros(16, dtype=torch.uint8), 2, 16, torch.Generator())


def test_eval_batches_are_fixed_and_leave_global_rng_alone(tokens):
    state = torch.get_rng_state()
    first = eval_batches(tokens, 3, 4, 32)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)
    second = eval_batches(tokens, 3, 4, 32)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    other = eval_batches(tokens, 3, 4, 32, seed=1)
    assert not torch.equal(first[0][0], other[0][0])
