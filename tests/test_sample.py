"""`normlab sample`: text from a trained run, reproducible per seed, and one-line errors for bad input."""

import subprocess
import sys

import pytest

from cli_here import normlab_here
from normlab.cli import main
from normlab.config import ModelConfig
from normlab.sample import generate

PROMPT = "def "


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 3-step tiny run on a small text file, trained through the real command (in this process)."""
    root = tmp_path_factory.mktemp("sample-run")
    text = root / "code.txt"
    text.write_text("def square(x):\n    return x * x\n" * 200, encoding="utf-8")
    out = root / "run"
    args = ["model=tiny", "max_steps=3", "batch_size=4", "seq_len=16", "eval_batches=1", "eval_every=0",
            "telemetry.every=0", "wandb.mode=disabled", "progress=false", "device=cpu", "data=text", f"data.files=[{text}]",
            f"hydra.run.dir={out}"]
    result = normlab_here("train", *args, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_sample_prints_the_prompt_and_new_text(run_dir, capsys):
    assert main(["sample", str(run_dir), "--prompt", PROMPT, "--tokens", "40", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(PROMPT) and text.endswith("\n")
    # 40 byte tokens decode to 40 characters, fewer where bytes of a 3-step model are not valid UTF-8.
    assert 40 // 4 <= len(text) - len(PROMPT) - 1 <= 40


def test_sample_is_reproducible_per_seed_and_reads_a_checkpoint_file(run_dir, capsys):
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1]
    outputs = []
    for path, seed in ((run_dir, 3), (checkpoint, 3), (run_dir, 4), (run_dir / "checkpoints", 3)):
        assert main(["sample", str(path), "--tokens", "60", "--seed", str(seed), "--temperature", "1.5"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[3]  # the run dir, its newest checkpoint, its checkpoints dir
    assert outputs[0] != outputs[2]


def test_temperature_zero_is_greedy_and_top_k_one_equals_it(run_dir, capsys):
    main(["sample", str(run_dir), "--tokens", "30", "--temperature", "0", "--seed", "1"])
    greedy = capsys.readouterr().out
    main(["sample", str(run_dir), "--tokens", "30", "--top-k", "1", "--seed", "2"])
    assert capsys.readouterr().out == greedy


@pytest.mark.parametrize(
    "args, message",
    [
        (["no/such/run"], "no/such/run: no such file or directory"),
        (["{tmp}"], "no checkpoint in"),
        (["{tmp}/junk.pt"], "not written by normlab"),
        (["{run}", "--tokens", "0"], "--tokens=0: must be an integer >= 1"),
        (["{run}", "--temperature", "-1"], "--temperature=-1.0: must be a finite number >= 0"),
        (["{run}", "--tokens", "many"], "invalid int value"),
        (["{run}", "--tokens", "-3"], "--tokens=-3: must be an integer >= 1"),
        (["{run}", "--temperature", "inf"], "--temperature=inf: must be a finite number >= 0"),
        (["{run}", "--temperature", "nan"], "--temperature=nan: must be a finite number >= 0"),
        (["{run}", "--top-k", "0"], "--top-k=0: must be an integer >= 1"),
        (["{run}", "--seed", "99999999999999999999"], "--seed=99999999999999999999: must be an integer between 0 and 2**32-1"),
        (["{run}", "--seed", "-1"], "--seed=-1: must be an integer between 0 and 2**32-1"),
        (["{run}", "--device", "gpu"], "argument --device: invalid choice: 'gpu' (choose from 'auto', 'cpu', 'cuda')"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(run_dir, tmp_path, capsys, args, message):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    args = [a.format(tmp=tmp_path, run=run_dir) for a in args]
    assert main(["sample", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("normlab: error: ") and err.count("\n") == 1 and message in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_the_one_line_train_gives(run_dir, capsys):
    assert main(["sample", str(run_dir), "--device", "cuda", "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    # normlab train device=cuda says the same, with its own spelling of the setting (normlab.train.runtime.check_device)
    assert err.startswith("normlab: error: --device=cuda, but torch sees no CUDA device here (torch ")
    assert err.rstrip().endswith("use --device=cpu, or --device=auto to take CUDA when there is one")


def test_auto_device_samples_where_torch_computes(run_dir, capsys):
    assert main(["sample", str(run_dir), "--device", "auto", "--tokens", "5", "--seed", "1", "--temperature", "0"]) == 0
    auto = capsys.readouterr().out
    assert main(["sample", str(run_dir), "--tokens", "5", "--seed", "1", "--temperature", "0"]) == 0
    assert len(auto) > 5 and (__import__("torch").cuda.is_available() or auto == capsys.readouterr().out)


def test_a_byte_run_takes_the_prompts_raw_bytes(run_dir, capsys):
    """Bytes that are not UTF-8 reach Python's argv surrogate-escaped ('\\xff' as '\\udcff'): a byte-tokenizer
    run continues the very bytes typed, and the prompt is echoed with U+FFFD where a byte is not UTF-8."""
    import torch

    from normlab.sample import model_state, saved_config, _load_model
    from normlab.train.checkpoint import Checkpoint, find_checkpoint

    prompt = "def \udcff\udcfe"
    assert main(["sample", str(run_dir), "--prompt", prompt, "--tokens", "8", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    payload = Checkpoint.load(find_checkpoint(str(run_dir))).payload
    model = _load_model(saved_config(payload), model_state(payload), torch.device("cpu"))
    new = generate(model, [*b"def ", 0xFF, 0xFE], 8, 0.0, None, torch.Generator())
    assert out == "def \ufffd\ufffd" + bytes(new).decode("utf-8", errors="replace") + "\n"


def test_generate_conditions_on_at_most_the_context():
    import torch

    from normlab.config import RunConfig
    from normlab.nn.model import GPT

    torch.manual_seed(0)
    model = GPT(RunConfig(depth=1, model=ModelConfig(d_model=16, n_head=2, context=8, vocab_size=256))).eval()
    new = generate(model, list(range(20)), 12, 1.0, None, torch.Generator().manual_seed(0))
    assert len(new) == 12 and all(0 <= t < 256 for t in new)


def test_help_lists_sample_and_sample_help_needs_no_torch():
    code = (
        "import sys\n"
        "from normlab.cli import main\n"
        "main(['--help'])\n"
        "try:\n    main(['sample', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch-free')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "normlab sample RUN_DIR_OR_CHECKPOINT" in result.stdout and "--temperature" in result.stdout
    assert result.stdout.rstrip().endswith("torch-free")


def bpe_run(tmp_path):
    """A checkpoint of a BPE run, written by hand: its path, config, payload and corpus."""
    from normlab.train import checkpoint
    from normlab.config import DataConfig, RunConfig, TokenizerConfig, flatten_config
    from normlab.data import load_corpus
    from normlab.nn.model import GPT

    text = tmp_path / "code.txt"
    text.write_text("def square(x):\n    return x * x\n" * 300, encoding="utf-8")
    cfg = RunConfig(depth=1, model=ModelConfig(d_model=16, n_head=2, context=16, vocab_size=300), seq_len=16,
                    data=DataConfig(source="text", files=[str(text)], cache_dir=str(tmp_path / "c")),
                    tokenizer=TokenizerConfig(kind="bpe", vocab_size=300))
    corpus = load_corpus(cfg.data, cfg.tokenizer)
    payload = {"format": checkpoint.FORMAT, "step": 0, "state": {"model": GPT(cfg).state_dict()},
               "callbacks": {}, "rng": {}, "config": flatten_config(cfg)}
    path = checkpoint.checkpoint_path(tmp_path / "run", 0)
    checkpoint.write_atomic(path, payload)
    return path, cfg, payload, corpus


def test_a_bpe_run_refuses_a_prompt_that_is_not_utf8_in_one_line(tmp_path, capsys):
    path = bpe_run(tmp_path)[0]
    assert main(["sample", str(path), "--prompt", "def \udcff\udcfe", "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("normlab: error: --prompt is not UTF-8: the byte 0xff at position 4")
    assert "tokenizer=bpe" in err and "a byte-tokenizer run takes any bytes" in err


def test_sample_decodes_with_the_runs_bpe(tmp_path, capsys):
    """A checkpoint of a BPE run (written by hand here): the sample is decoded with the same BPE, found in the cache."""
    import torch

    from normlab.nn.model import GPT

    path, cfg, payload, corpus = bpe_run(tmp_path)
    assert main(["sample", str(path), "--prompt", "def", "--tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    model = GPT(cfg).eval()
    model.load_state_dict(payload["state"]["model"])
    ids = generate(model, corpus.tokenizer.encode("def").tolist(), 5, 0.0, None, torch.Generator())
    assert out == "def" + corpus.tokenizer.decode(ids) + "\n"


def test_a_sample_is_written_as_its_tokens_are_drawn(run_dir):
    """A long sample shows its text from the first tokens on (before: nothing until the last; 1e8 tokens took a
    day and a half in silence), and the pieces make the same text as the sample drawn whole."""
    from normlab.sample import sample_text

    pieces = []
    whole = sample_text(str(run_dir), PROMPT, 300, 1.5, None, 5, write=pieces.append)
    assert pieces[0] == PROMPT and len(pieces) > 50 and "".join(pieces) == whole
    assert sample_text(str(run_dir), PROMPT, 300, 1.5, None, 5) == whole


def test_the_streamed_text_of_random_bytes_is_their_whole_decoding():
    import random

    from normlab.sample import TextStream

    rng = random.Random(0)
    ids = [rng.choice([rng.randrange(256), rng.randrange(0x80), 0xE2, 0x82, 0xAC, 0xF0, 0x9F]) for _ in range(3000)]
    decode = lambda tokens: bytes(tokens).decode("utf-8", errors="replace")  # noqa: E731  (the byte tokenizer's)
    pieces = []
    stream = TextStream(decode, pieces.append)
    for token in ids:
        stream.add(token)
    stream.close()
    assert "".join(pieces) == decode(ids) and len(pieces) > 100


def test_a_sample_into_a_reader_that_stops_early_ends_quietly(run_dir, tmp_path):
    """`normlab sample RUN --tokens 1000000 | head -c 100`: no traceback, and 128 + SIGPIPE, as a Unix tool."""
    from test_cli import into_head

    code, taken, err = into_head(["sample", run_dir, "--tokens", "1000000"], tmp_path, keep=100)
    assert (code, len(taken), err) == (141, 100, "")
