"""Tests for normlab.data.tokenizer and the tokenizer side of normlab.data: BPE training and its cache,
pretrained tokenizers from local files and the offline hub path, byte counts and bits per byte."""

import math
import time

import numpy as np
import pytest
import torch

from normlab import data
from normlab.data import tokenizer
from normlab.config import ConfigError, DataConfig, ModelConfig, RunConfig, TokenizerConfig
from normlab.data import DataError, bits_per_byte, eval_batches, load_corpus, model_vocab_size, target_bytes
from normlab.data.tokenizer import ByteTokenizer, TokenizerError, from_file, train_bpe

SAMPLE = "héllo wörld\n  def f(x):\n\treturn x ** 2  # ünïcödé, 日本語, emoji 🙂\n"


def _text(n_lines: int = 400) -> str:
    """A few tens of kB of code-like text with repeats for BPE to merge and non-ASCII characters to split."""
    lines = [f"def function_{i % 37}(value, other={i}):\n    return value * {i % 11} + other  # naïve ünïcode {i}\n"
             for i in range(n_lines)]
    return "".join(lines)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(_text().encode(), 300, tmp_path_factory.mktemp("bpe-cache"))


def test_byte_tokenizer_is_the_identity_on_bytes():
    tok = ByteTokenizer()
    raw = SAMPLE.encode()
    ids = tok.encode(raw)
    assert ids.dtype == np.uint8 and ids.tobytes() == raw
    assert tok.decode(ids) == SAMPLE
    assert tok.vocab_size == 256 and tok.token_bytes.sum() == 256


def test_a_surrogate_escaped_byte_is_that_byte_to_the_byte_tokenizer_and_refused_in_one_line_by_a_bpe(bpe):
    """'\\udcff' is how Python hands over the byte 0xff of argv or a file name that is not UTF-8."""
    assert ByteTokenizer().encode("def \udcff\udcfe").tolist() == [*b"def ", 0xFF, 0xFE]
    with pytest.raises(TokenizerError, match=r"^the text is not UTF-8: the byte 0xff at position 4; tokenizer=bpe "):
        bpe.encode("def \udcff\udcfe")
    for tok in (ByteTokenizer(), bpe):  # a surrogate that escapes no byte is no text at all
        with pytest.raises(TokenizerError, match=r"the lone surrogate U\+D800 at position 1, which is neither"):
            tok.encode("a\ud800")


def test_bpe_has_the_asked_vocabulary_and_round_trips(bpe):
    assert bpe.vocab_size == 300
    ids = bpe.encode(SAMPLE.encode())
    assert ids.dtype == np.uint16 and ids.max() < 300
    assert bpe.decode(ids) == SAMPLE
    assert len(bpe.encode(_text(50).encode())) < len(_text(50).encode()) / 2  # merges shorten the text


def test_token_bytes_sum_to_the_utf8_length(bpe):
    for text in (SAMPLE, _text(30), "ü" * 7 + "🙂"):
        ids = bpe.encode(text.encode())
        assert int(bpe.token_bytes[ids].sum()) == len(text.encode())
    byte = ByteTokenizer()
    assert int(byte.token_bytes[byte.encode(SAMPLE)].sum()) == len(SAMPLE.encode())


def test_bpe_training_is_deterministic_and_cached(tmp_path, monkeypatch):
    text = _text().encode()
    first = train_bpe(text, 300, tmp_path / "a")
    again = train_bpe(text, 300, tmp_path / "b")
    assert first.backend.to_str() == again.backend.to_str() and first.identity == again.identity
    cached = tokenizer.bpe_cache_path(tmp_path / "a", __import__("hashlib").sha256(text).hexdigest(), 300)
    assert cached.is_file()

    def no_training(*args):
        raise AssertionError("the BPE was trained again although its cache file exists")

    monkeypatch.setattr(tokenizer, "_spread_sample", no_training)
    assert train_bpe(text, 300, tmp_path / "a").identity == first.identity
    with pytest.raises(AssertionError, match="trained again"):
        train_bpe(text, 301, tmp_path / "a")  # another size is another tokenizer


@pytest.mark.parametrize("vocab", [0, 256, 65537])
def test_bpe_vocabulary_out_of_range_is_one_line(tmp_path, vocab):
    with pytest.raises(TokenizerError, match=f"tokenizer.vocab_size={vocab}: .*257.*65536") as caught:
        train_bpe(b"some text", vocab, tmp_path)
    assert "\n" not in str(caught.value)
    cfg = RunConfig(tokenizer=TokenizerConfig(kind="bpe", vocab_size=vocab))
    with pytest.raises(ConfigError, match=f"tokenizer.vocab_size={vocab}"):
        cfg.validate()


def test_config_refuses_an_unknown_tokenizer_and_an_hf_tokenizer_without_name():
    with pytest.raises(ConfigError, match="tokenizer.kind='sentencepiece' is not allowed: choose one of byte, bpe, hf"):
        RunConfig(tokenizer=TokenizerConfig(kind="sentencepiece")).validate()
    with pytest.raises(ConfigError, match="tokenizer.name is not set"):
        RunConfig(tokenizer=TokenizerConfig(kind="hf")).validate()
    RunConfig(model=ModelConfig(vocab_size=None), tokenizer=TokenizerConfig(kind="bpe", vocab_size=257)).validate()


def test_pretrained_loads_a_local_file_and_directory(bpe, tmp_path):
    folder = tmp_path / "my-tokenizer"
    folder.mkdir()
    bpe.save(folder / "tokenizer.json")
    for name in (str(folder), str(folder / "tokenizer.json")):
        loaded = tokenizer.pretrained(name, local_only=True)
        assert loaded.vocab_size == 300 and loaded.identity.endswith(bpe.identity.split("-", 1)[1])
        assert loaded.decode(loaded.encode(SAMPLE)) == SAMPLE
    with pytest.raises(TokenizerError, match="not a tokenizers file"):
        (tmp_path / "bad.json").write_text("{}")
        from_file(tmp_path / "bad.json")


def test_pretrained_not_cached_while_offline_fails_within_a_second(tmp_path, monkeypatch):
    import huggingface_hub  # noqa: F401  (import cost is paid before the clock starts)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    text = tmp_path / "a.txt"
    text.write_text(_text(20))
    t0 = time.monotonic()
    with pytest.raises(DataError) as caught:
        load_corpus(DataConfig(source="text", files=[str(text)], cache_dir=str(tmp_path / "c")),
                    TokenizerConfig(kind="hf", name="surely/not-cached-tokenizer-xyz"))
    assert time.monotonic() - t0 < 5.0  # a network attempt takes 10 s or more; 5 s leaves room for a loaded CPU
    message = str(caught.value)
    assert "\n" not in message and "offline" in message and "surely/not-cached-tokenizer-xyz" in message


def test_bpe_corpus_round_trips_and_reads_its_tokens_from_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "code.txt"
    path.write_text(_text(), encoding="utf-8")
    cfg = DataConfig(source="text", files=[str(path)], cache_dir=str(tmp_path / "c"))
    corpus = load_corpus(cfg, TokenizerConfig(kind="bpe", vocab_size=320))
    assert corpus.vocab_size == 320 and corpus.tokenizer.kind == "bpe"
    assert corpus.train.dtype == np.uint16 and corpus.val.dtype == np.uint16
    decode = corpus.tokenizer.decode
    assert decode(corpus.train.numpy().tolist()) + decode(corpus.val.numpy().tolist()) == _text()
    assert corpus.n_bytes == len(_text().encode())
    # The cut lies 10% before the end, moved to a character boundary: the validation text is that tail.
    val_text = decode(corpus.val.numpy().tolist())
    assert abs(len(val_text.encode()) - int(corpus.n_bytes * 0.1)) < 4
    assert int(corpus.token_bytes[corpus.val.numpy().astype(np.int64)].sum()) == len(val_text.encode())

    def no_encoding(*args, **kwargs):
        raise AssertionError("the corpus was encoded again although its tokens are cached")

    monkeypatch.setattr(tokenizer.HFTokenizer, "encode", no_encoding)
    monkeypatch.setattr(tokenizer, "_spread_sample", no_encoding)
    again = load_corpus(cfg, TokenizerConfig(kind="bpe", vocab_size=320))
    assert np.array_equal(again.train.numpy(), corpus.train.numpy()) and np.array_equal(again.val.numpy(), corpus.val.numpy())
    assert again.sha256 == corpus.sha256


def test_byte_tokenizer_corpus_is_unchanged_by_the_tokenizer_argument(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(SAMPLE.encode() * 20)
    cfg = DataConfig(source="text", files=[str(path)], cache_dir=str(tmp_path / "c"))
    plain, explicit = load_corpus(cfg), load_corpus(cfg, TokenizerConfig(kind="byte"))
    assert np.array_equal(plain.train.numpy(), explicit.train.numpy()) and plain.sha256 == explicit.sha256
    assert explicit.train.dtype == np.uint8 and explicit.vocab_size == 256


def test_bits_per_byte_of_the_byte_tokenizer_is_nats_over_ln2(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(SAMPLE.encode() * 50)
    corpus = load_corpus(DataConfig(source="text", files=[str(path)], cache_dir=str(tmp_path / "c")))
    batches = eval_batches(corpus.val, 3, 4, 16)
    n_tokens, n_bytes = target_bytes(batches, corpus.token_bytes)
    assert n_tokens == n_bytes == 3 * 4 * 16
    assert bits_per_byte(1.7496, n_tokens, n_bytes) == pytest.approx(1.7496 / math.log(2), rel=1e-15)


def test_bits_per_byte_counts_the_bytes_each_target_token_stands_for(bpe):
    ids = torch.from_numpy(bpe.encode(_text(40)).astype(np.int64))
    y = ids[: 4 * 8].reshape(4, 8)
    n_tokens, n_bytes = target_bytes([(y, y)], torch.from_numpy(bpe.token_bytes))
    assert n_tokens == 32 and n_bytes == len(bpe.decode(y.reshape(-1).tolist()).encode())
    assert n_bytes > n_tokens
    assert bits_per_byte(2.0, n_tokens, n_bytes) == pytest.approx(2.0 * 32 / (n_bytes * math.log(2)))


def test_model_vocabulary_follows_the_tokenizer(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(SAMPLE.encode() * 20)
    corpus = load_corpus(DataConfig(source="text", files=[str(path)], cache_dir=str(tmp_path / "c")))
    assert model_vocab_size(None, corpus) == 256
    assert model_vocab_size(320, corpus) == 320  # padding is allowed
    with pytest.raises(ConfigError, match="model.vocab_size=200 is smaller than the tokenizer's vocabulary"):
        model_vocab_size(200, corpus)


def test_load_tokenizer_finds_the_bpe_the_corpus_was_encoded_with(tmp_path, monkeypatch):
    path = tmp_path / "code.txt"
    path.write_text(_text(), encoding="utf-8")
    cfg = DataConfig(source="text", files=[str(path)], cache_dir=str(tmp_path / "c"))
    corpus = load_corpus(cfg, TokenizerConfig(kind="bpe", vocab_size=300))
    monkeypatch.setattr(tokenizer, "_spread_sample", lambda *a: pytest.fail("trained again"))
    assert data.load_tokenizer(cfg, TokenizerConfig(kind="bpe", vocab_size=300)).identity == corpus.tokenizer.identity


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tokenizer=bpe", "tokenizer.vocab_size=100"], "tokenizer.vocab_size=100: a byte-level BPE needs between 257"),
        (["tokenizer=bpe", "tokenizer.vocab_size=70000"], "tokenizer.vocab_size=70000"),
        (["tokenizer=hf"], "tokenizer.name is not set"),
        (["tokenizer.kind=wordpiece"], "tokenizer.kind='wordpiece' is not allowed: choose one of byte, bpe, hf"),
        (["data=hf", "data.name=some/set", "data.streaming=true"], "data.streaming=true needs data.max_bytes"),
    ],
)
def test_the_train_command_refuses_bad_tokenizer_and_data_settings_in_one_line(overrides, message, tmp_path, monkeypatch, capsys):
    from normlab.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", *overrides, "max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("normlab: error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "outputs").exists()
