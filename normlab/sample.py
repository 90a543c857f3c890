"""`normlab sample`: print text from a trained model, as nanoGPT's sample.py does.

    normlab sample RUN_DIR_OR_CHECKPOINT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S] [--device D]

The model is rebuilt from the configuration saved in the checkpoint and loaded with its weights
(read safely: tensors and plain containers only). The tokenizer is the run's own: the
`tokenizer.json` in the run dir when there is one, else the one its config names (a BPE is
read from the token cache, or learned again, deterministically, from the same text).

The text is written as it is drawn (TextStream), so a long sample shows from its first tokens on.
The prompt is the bytes typed: a byte-tokenizer run continues them as they are, UTF-8 or not (Python
hands argv's other bytes over surrogate-escaped); a BPE or pretrained tokenizer reads UTF-8 text only.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from normlab.config.validate import DEVICES
from normlab.util.errors import fail

USAGE = "normlab sample RUN_DIR_OR_CHECKPOINT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S] [--device D]"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise SampleError(message)


class SampleError(RuntimeError):
    """Bad input to `normlab sample`; the message is one line."""


def main(argv: list[str]) -> int:
    """Run `normlab sample ARGV`; print the text to stdout. Bad input: one line on stderr, exit 2."""
    parser = _Parser(prog="normlab sample", usage=USAGE, description="Print text sampled from a trained model.")
    parser.add_argument("path", help="a run dir (its newest checkpoint) or a checkpoint file")
    parser.add_argument("--prompt", default="", help="text the sample continues (default: a newline)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: always the likeliest token")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens only")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default="cpu", choices=DEVICES, help="cpu (default), cuda, or auto: cuda where there is one")
    try:
        args = parser.parse_args(argv)
        _check_args(args)
        sample_text(args.path, args.prompt, args.tokens, args.temperature, args.top_k, args.seed, args.device,
                    write=_written)
    except SampleError as err:
        return fail(err)
    except KeyboardInterrupt:  # Ctrl-C: the text so far is out; end its line, no traceback
        print()
        return 130
    print()
    return 0


def _written(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()  # each piece as it is drawn: a long sample shows its text from the first tokens on


def _check_args(args: argparse.Namespace) -> None:
    if args.tokens < 1:
        raise SampleError(f"--tokens={args.tokens}: must be an integer >= 1")
    if not 0 <= args.temperature < math.inf:
        raise SampleError(f"--temperature={args.temperature}: must be a finite number >= 0")
    if args.top_k is not None and args.top_k < 1:
        raise SampleError(f"--top-k={args.top_k}: must be an integer >= 1")
    if not 0 <= args.seed < 2**32:  # the seeds `normlab train seed=` takes
        raise SampleError(f"--seed={args.seed}: must be an integer between 0 and 2**32-1")


def sample_text(path: str, prompt: str, n_tokens: int, temperature: float, top_k: int | None, seed: int,
                device: str = "cpu", write: Callable[[str], None] | None = None) -> str:
    """The prompt followed by `n_tokens` sampled tokens, decoded. Raises SampleError for an unusable path.
    `write`, when given, receives the same text in pieces as it is made: the prompt, then the new text as its
    tokens are drawn (TextStream)."""
    # Here and below, torch and the model's stack load only when a sample is drawn: `normlab sample --help`
    # and a bad argument answer at once.
    import torch

    from normlab.config import ConfigError
    from normlab.data import DataError
    from normlab.data.tokenizer import TokenizerError
    from normlab.train.checkpoint import CHECKPOINT_DIR, Checkpoint, CheckpointError, find_checkpoint, run_dir_of
    from normlab.train.runtime import check_device

    try:
        device = check_device(device, key="--device")  # the one line `normlab train device=cuda` gives
    except ConfigError as err:
        raise SampleError(str(err)) from None
    if Path(path).name == CHECKPOINT_DIR and not (Path(path) / CHECKPOINT_DIR).is_dir():
        path = str(Path(path).parent)  # a run's checkpoints dir: that run's newest checkpoint
    try:
        checkpoint = Checkpoint.load(find_checkpoint(path))
    except CheckpointError as err:
        raise SampleError(str(err).removeprefix("resume=")) from None
    cfg = saved_config(checkpoint.payload)
    state = model_state(checkpoint.payload)
    run_dir = run_dir_of(checkpoint.path)
    try:
        tokenizer = _run_tokenizer(run_dir, cfg)
    except DataError as err:
        raise SampleError(f"cannot rebuild the run's tokenizer: {err}") from None
    model = _load_model(cfg, state, torch.device(device))
    try:
        ids = tokenizer.encode(prompt or "\n").tolist()
    except TokenizerError as err:
        raise SampleError("--prompt" + str(err).removeprefix("the text")) from None
    generator = torch.Generator(device=device).manual_seed(seed)
    # The prompt as typed, a byte that is not UTF-8 shown as U+FFFD, as the new bytes are decoded.
    shown = prompt.encode("utf-8", "surrogateescape").decode("utf-8", errors="replace")
    stream = TextStream(tokenizer.decode, write) if write is not None else None
    if write is not None:
        write(shown)
    new = generate(model, ids, n_tokens, temperature, top_k, generator, stream.add if stream else None)
    if stream is not None:
        stream.close()
    return shown + tokenizer.decode(new)


class TextStream:
    """New tokens' text handed to `write` as the tokens come, each piece as `decode` will have it in the end.

    A piece is written once the text of the tokens so far extends what was written and does not end in U+FFFD
    (what decoding gives for a character whose bytes have not all come yet). The tokens are decoded from a window:
    past WINDOW tokens it starts again from the last OVERLAP, at a whole character, whose text gives later tokens
    their context (a BPE's spaces), so each token costs one decode of at most WINDOW + OVERLAP ids."""

    WINDOW, OVERLAP = 256, 8

    def __init__(self, decode: Callable[[list[int]], str], write: Callable[[str], None]):
        self.decode, self.write = decode, write
        self.ids: list[int] = []
        self.shown = ""  # the text of self.ids already written (or given as context)

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return
        if len(text) > len(self.shown):
            self.write(text[len(self.shown):])
        self.shown = text
        if len(self.ids) > self.WINDOW:
            self.ids = self.ids[-self.OVERLAP:]
            self.shown = self.decode(self.ids)

    def close(self) -> None:
        """Write what is left: the last tokens' text, a U+FFFD at the end included."""
        text = self.decode(self.ids)
        if len(text) > len(self.shown):
            self.write(text[len(self.shown):] if text.startswith(self.shown) else text)


def saved_config(payload: Mapping[str, Any]):
    """The RunConfig a checkpoint was written with (its `config` holds the flattened dotted keys)."""
    from normlab.config import ConfigError, RunConfig, nest_config

    try:
        return RunConfig.from_dict(nest_config(payload["config"]), validate=False)
    except ConfigError as err:
        raise SampleError(f"the checkpoint's config does not fit this normlab: {err}") from None


def model_state(payload: Mapping[str, Any]) -> dict:
    """The model's state_dict in a checkpoint payload: `payload["state"]["model"]` (TrainState.state_dict)."""
    try:
        return payload["state"]["model"]
    except (KeyError, TypeError):
        raise SampleError("the checkpoint holds no model state (state.model)") from None


def _run_tokenizer(run_dir: Path | None, cfg):
    from normlab.data import load_tokenizer
    from normlab.data.tokenizer import TokenizerError, from_file

    saved = run_dir / "tokenizer.json" if run_dir is not None else None
    if saved is not None and saved.is_file() and cfg.tokenizer.kind != "byte":
        try:
            return from_file(saved, kind=cfg.tokenizer.kind)
        except TokenizerError as err:
            raise SampleError(str(err)) from None
    return load_tokenizer(cfg.data, cfg.tokenizer)


def _load_model(cfg, state: Mapping[str, Any], device):
    from normlab.nn.model import GPT

    # The embedding's rows are the model's vocabulary, whatever model.vocab_size said (null: the tokenizer's).
    cfg.model.vocab_size = int(state["tok_emb.weight"].shape[0])
    model = GPT(cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise SampleError(f"the checkpoint's model state does not fit its config: {str(err).splitlines()[0]}") from None
    return model.to(device).eval()


def generate(model, ids: list[int], n_tokens: int, temperature: float, top_k: int | None, generator,
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """`n_tokens` ids drawn one at a time after `ids`, each from the model's next-token distribution
    (divided by `temperature`; temperature 0 takes the likeliest), conditioned on at most its context;
    each handed to `on_token` as it is drawn."""
    import torch

    device = next(model.parameters()).device
    seq = torch.tensor([ids], dtype=torch.long, device=device)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(n_tokens):
            logits = model(seq[:, -model.context :])[0, -1].float()
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    floor = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < floor, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
            new.append(nxt)
            if on_token is not None:
                on_token(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]], device=device)], dim=1)
    return new
